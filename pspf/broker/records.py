"""The broker's shared vocabulary: entry shapes, the records its reads return, limits, parsers.

Everything here is plain data or a pure function: no round trip, no client. The connection and
every family of the broker may import it; it imports none of them. Replies stay bytes until
these parsers (or a family's method) turn them into text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import hiredis
import redis

from pspf import codec

Fields = dict[bytes, bytes]
#: One entry as read: its id and its fields, or None for an entry deleted while pending.
RawEntry = tuple[bytes, Fields | None]

_CLAIM_COUNT = 1000
#: How often a worker idle on a cluster looks for new entries (``Reading.wait_for_new``).
CLUSTER_POLL_MS = 20
#: How often producers look whether a server without maxmemory got one (``Publishing.guard_memory``);
#: with one, they read its memory use before each write.
MEMORY_CHECK_S = 5.0
#: The longest pause a producer takes per write when the server nears its maxmemory.
MEMORY_PAUSE_S = 1.0


class PendingEntry(NamedTuple):
    """One entry of a group's pending list: who holds it, since when, how often delivered."""

    id: bytes
    consumer: str
    idle_ms: int
    deliveries: int


class GroupInfo(NamedTuple):
    """One consumer group of a stream, as XINFO GROUPS says."""

    consumers: int
    pending: int
    last_delivered_id: bytes


class StreamInfo(NamedTuple):
    """A stream's length, last generated id and consumer groups by name (empty if absent)."""

    length: int
    last_id: bytes | None
    groups: dict[str, GroupInfo]


class ServerInfo(NamedTuple):
    """What the connected server is and what it lacks for PSPF's guarantees."""

    version: str
    warnings: list[str]
    #: "Valkey" or "Redis", from INFO (Valkey reports a Redis compatibility version too)
    name: str = "Redis"


class GroupPosition(NamedTuple):
    """Where a consumer group stands in one stream (what ``lag`` and the metrics report)."""

    length: int
    last_id: bytes | None
    #: the group's last delivered id; None when the group does not exist
    delivered_id: bytes | None
    #: entries after ``delivered_id``; capped at LAG_COUNT_LIMIT where the server cannot say
    undelivered: int
    pending: int
    oldest_pending_id: bytes | None
    consumers: int

    @property
    def lag(self) -> int:
        """Entries the group has not acknowledged: not yet delivered, or delivered and pending."""
        return self.undelivered + self.pending


#: Without XINFO GROUPS' ``lag`` field (Redis 6.2, or after deletions) lag is counted with XRANGE
#: up to this many entries per stream, and reported as this number beyond it.
LAG_COUNT_LIMIT = 100_000


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _entries(raw: list[Any]) -> list[RawEntry]:
    """Parse XREADGROUP's entry list; a pending entry deleted from the stream has no fields.

    An entry that gives a field name twice keeps a mark of it (``codec.RepeatedFields``).
    """
    parsed: list[RawEntry] = []
    append = parsed.append
    for entry_id, flat in raw:
        if flat is None:
            append((entry_id, None))
        elif len(flat) == 4 and flat[0] != flat[2]:  # the common key + value entry, built directly
            append((entry_id, {flat[0]: flat[1], flat[2]: flat[3]}))
        else:
            append((entry_id, codec.entry_fields_of(flat)))
    return parsed


def packed(commands: Sequence[tuple[Any, ...]]) -> list[bytes]:
    """Commands packed into ONE buffer: one write, so the server wakes once for the whole call.

    (redis-py writes each packed item with a ``sendall`` of its own.)
    """
    return [b"".join([hiredis.pack_command(command) for command in commands])]


def send_packed(pool: Any, commands: Sequence[tuple[Any, ...]]) -> Any:
    """A connection of ``pool`` with ``commands`` sent on it in one write, their replies unread.

    The connection is the caller's until it has read the replies and released it; a send that
    fails holds nothing (the connection is closed and given back).
    """
    connection = pool.get_connection()
    try:
        connection.send_packed_command(packed(commands))
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    return connection


def usable(pool: Any, connection: Any) -> Any:
    """``connection`` (taken from ``pool`` when None), checked as the pool checks those it hands out.

    A connection kept out of the pool (a read sent ahead's, an acknowledgement's) would otherwise
    fail its next call after a server restart: one the server closed is made anew here, silently.
    """
    if connection is None:
        return pool.get_connection()
    try:
        if connection.can_read():  # a closed socket reads as end of file; a live one has nothing
            raise ConnectionError("the connection has unread data")
    except (ConnectionError, OSError, redis.ConnectionError):
        connection.disconnect()
        connection.connect()
    return connection
