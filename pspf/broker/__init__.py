"""Every round trip PSPF makes to Redis or Valkey, one method each, in families of a ``Broker``.

A ``Broker`` is its connection (``broker.conn``, ``connection``: the client of the URL's topology,
error translation, the server checks, the raw pipelined round trips) and one object per family
of calls, each holding that connection, as redis-py groups its commands:

- ``broker.reading`` (``reading``): fenced reads, reads sent ahead, waiting for new entries,
  pending lists and claims;
- ``broker.acks`` (``acknowledging``): the fenced acknowledgement with its state backup update,
  the backup's reads and rewrites;
- ``broker.leases`` (``leasing``): partition leases with fencing tokens, workers' memberships;
- ``broker.publishing`` (``publishing``): producers' and the outbox's writes, sinks' chunks, the
  memory guard;
- ``broker.topics`` (``topics``): topics' records and retention, streams' positions and trimming;
- ``broker.apps`` (``apps``): apps' records and their consumer groups;
- ``broker.requests`` (``requests``): the DLQ's entries and moves, outbox-replay requests;
- ``broker.moving`` (``moving``): a repartition's copies into staged keys and the renames that
  swap them in;
- ``records``: the entry shapes, records and limits they share;
- ``counts``: not a family but the one rule over them, ``partition_count``: the partition count
  of a topic now, with the layout guard and the apps' records.

A room that needs one or two families takes those (``Leasing``, ``Publishing``, ...) rather than
the whole ``Broker``; importers take the names re-exported here. Each family sends its commands
inside ``Connection.translate_errors``, the one place Redis errors become PSPF's.

Replies stay bytes (never ``decode_responses``) so a binary value cannot poison a batch, the
protocol is pinned to RESP2 because the stream replies are parsed here, and redis-py's own retries
are off: re-sending an XREADGROUP whose reply was lost would hide delivered entries, so the worker
reconnects itself and re-reads its pending entries instead.
"""

from __future__ import annotations

from pspf.broker.acking import BACKUP_LOG_LENGTH, AckInFlight, AckRequest, BackupUpdate, log_data
from pspf.broker.acknowledging import Acknowledging
from pspf.broker.ahead import ReadAhead
from pspf.broker.apps import Apps
from pspf.broker.connection import Connection
from pspf.broker.counts import CountSource, TopicCount, partition_count
from pspf.broker.leasing import Leasing
from pspf.broker.moving import Moving
from pspf.broker.publishing import PublishCall, Publishing, SentCalls, refused_layout
from pspf.broker.reading import Reading, ReadSent
from pspf.broker.records import (
    CLUSTER_POLL_MS,
    LAG_COUNT_LIMIT,
    MEMORY_CHECK_S,
    MEMORY_PAUSE_S,
    Fields,
    GroupInfo,
    GroupPosition,
    PendingEntry,
    RawEntry,
    ServerInfo,
    StreamInfo,
)
from pspf.broker.requests import Requests
from pspf.broker.topics import Topics
from pspf.settings import RedisSettings

__all__ = [
    "BACKUP_LOG_LENGTH",
    "CLUSTER_POLL_MS",
    "LAG_COUNT_LIMIT",
    "MEMORY_CHECK_S",
    "MEMORY_PAUSE_S",
    "AckInFlight",
    "AckRequest",
    "Acknowledging",
    "Apps",
    "BackupUpdate",
    "Broker",
    "Connection",
    "CountSource",
    "Fields",
    "GroupInfo",
    "GroupPosition",
    "Leasing",
    "Moving",
    "PendingEntry",
    "PublishCall",
    "Publishing",
    "RawEntry",
    "ReadAhead",
    "ReadSent",
    "Reading",
    "Requests",
    "SentCalls",
    "ServerInfo",
    "StreamInfo",
    "TopicCount",
    "Topics",
    "log_data",
    "partition_count",
    "refused_layout",
]


class Broker:
    """A connection pool to one Redis or Valkey server (``conn``) and the commands PSPF sends it, by family.

    Composed, not inherited: the families hold the connection and the broker holds them all, so
    nothing refers back to the broker and one dropped unclosed is freed (its sockets closed) at once.
    """

    def __init__(self, settings: RedisSettings, socket_timeout_s: float = 30.0) -> None:
        self.conn = conn = Connection(settings, socket_timeout_s)
        self.reading = Reading(conn)
        self.acks = Acknowledging(conn)
        self.leases = Leasing(conn)
        self.publishing = Publishing(conn, (settings.memory_slow_at, settings.memory_fail_at))
        self.topics = Topics(conn)
        self.apps = Apps(conn, self.topics)
        self.requests = Requests(conn)
        self.moving = Moving(conn)

    def close(self) -> None:
        self.reading.reader.close()  # kept out of the pool: the client's close would miss it
        self.conn.close()
