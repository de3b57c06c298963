"""Every round trip PSPF makes to Redis or Valkey, one method each, composed into one ``Broker``.

The methods come in families, one module each, as redis-py composes its client from per-family
command mixins; importers use ``Broker`` and the records re-exported here, never the families:

- ``connection``: the client of the URL's topology, error translation, the server checks, the
  Lua scripts and the raw pipelined round trips (the base of every other family);
- ``reading``: fenced reads, reads sent ahead, waiting for new entries, pending lists and claims;
- ``acknowledging``: the fenced acknowledgement with its state backup update, leases,
  memberships, the backup's reads and rewrites;
- ``publishing``: producers' and the outbox's writes, sinks' chunks, the memory guard;
- ``admin``: topics, apps, groups, stream positions;
- ``requests``: the DLQ's entries and moves, outbox-replay requests;
- ``moving``: a repartition's copies into staged keys and the renames that swap them in;
- ``records``: the entry shapes, records and limits they share;
- ``counts``: not a family but the one rule over them, ``partition_count``: the partition count
  of a topic now, with the layout guard and the apps' records.

Replies stay bytes (never ``decode_responses``) so a binary value cannot poison a batch, the
protocol is pinned to RESP2 because the stream replies are parsed here, and redis-py's own retries
are off: re-sending an XREADGROUP whose reply was lost would hide delivered entries, so the worker
reconnects itself and re-reads its pending entries instead. Redis errors are translated in one
place (``Connection.translate_errors``) into PSPF's error types.
"""

from __future__ import annotations

from pspf.broker.acknowledging import (
    BACKUP_LOG_LENGTH,
    AckInFlight,
    Acknowledging,
    AckRequest,
    BackupUpdate,
    log_data,
)
from pspf.broker.admin import Admin
from pspf.broker.ahead import ReadAhead
from pspf.broker.connection import Connection
from pspf.broker.counts import TopicCount, partition_count
from pspf.broker.moving import Moving
from pspf.broker.publishing import PublishCall, Publishing, SentCalls, refused_layout
from pspf.broker.reading import Reading
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

__all__ = [
    "BACKUP_LOG_LENGTH",
    "CLUSTER_POLL_MS",
    "LAG_COUNT_LIMIT",
    "MEMORY_CHECK_S",
    "MEMORY_PAUSE_S",
    "AckInFlight",
    "AckRequest",
    "BackupUpdate",
    "Broker",
    "Connection",
    "Fields",
    "GroupInfo",
    "GroupPosition",
    "PendingEntry",
    "PublishCall",
    "RawEntry",
    "ReadAhead",
    "SentCalls",
    "ServerInfo",
    "StreamInfo",
    "TopicCount",
    "log_data",
    "partition_count",
    "refused_layout",
]


class Broker(Reading, Acknowledging, Publishing, Admin, Requests, Moving):
    """A connection pool to one Redis or Valkey server and the commands PSPF sends it."""
