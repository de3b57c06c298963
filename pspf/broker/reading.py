"""Reading a group's entries: fenced reads, reads sent ahead, waiting, pending lists and claims.

Every read that delivers new entries to the group is fenced by the partition's lease: the
lease is WATCHed and checked around the XREADGROUP (one MULTI/EXEC on one server), or checked
inside ``lua/read.lua`` (on a cluster, and for a read sent ahead), so a worker that lost a lease
delivers nothing and cannot take entries out of the group's order. Re-delivering own pending
entries (``claim_entries``) is fenced the same way. Entries deleted while pending come back with
no fields (``RawEntry``), never silently dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from pspf import keys
from pspf.broker.ahead import ReadAhead, Reader, fenced_reads
from pspf.broker.connection import Connection
from pspf.broker.records import (
    _CLAIM_COUNT,
    CLUSTER_POLL_MS,
    PendingEntry,
    RawEntry,
    _entries,
    _text,
    send_packed,
)
from pspf.keys import StreamId

log = logging.getLogger(__name__)


class Reading:
    """Fenced reads of new entries, reads sent ahead, waiting for entries, pending lists and claims."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._read = conn.register("read")
        self._last_ids = conn.register("last_ids")
        self._read_loaded = False
        #: the connection of the reads sent ahead, kept out of the pool (``pspf.broker.ahead``)
        self.reader = Reader(getattr(conn.client, "connection_pool", None))  # none on a cluster

    def oldest_pending(self, stream: str, group: str) -> bytes | None:
        """The id of the group's oldest pending entry in the stream (None when nothing is pending)."""
        with self.conn.translate_errors(stream):
            summary = self.conn.client.xpending(stream, group)
        return cast(bytes | None, summary.get("min"))

    def read_group(
        self,
        group: str,
        consumer: str,
        streams: dict[str, str],
        count: int,
        block_ms: int | None,
    ) -> list[tuple[bytes, list[RawEntry]]]:
        """One XREADGROUP; ``streams`` maps a stream to ``>`` (new entries) or an id (own PEL)."""
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", *streams.keys(), *streams.values()]
        with self.conn.translate_errors():
            reply = self.conn.on(next(iter(streams))).execute_command(*args)  # type: ignore[no-untyped-call]
        if not reply:
            return []
        return [(stream, _entries(entries)) for stream, entries in reply]

    def read_after(
        self, positions: Mapping[str, StreamId | None], count: int
    ) -> list[tuple[str, list[RawEntry]]]:
        """Up to ``count`` entries of each stream after its position (None: from the start), no group.

        One pipelined XRANGE per stream (on a cluster, per node); streams with nothing new are left out.
        """
        streams = list(positions)
        with self.conn.translate_errors(", ".join(streams)):
            pipe = self.conn.client.pipeline(transaction=False)
            for stream in streams:
                pipe.xrange(stream, _after(positions[stream]), "+", count)
            replies = pipe.execute()
        return [(stream, list(entries)) for stream, entries in zip(streams, replies, strict=True) if entries]

    def send_read_after(self, positions: Mapping[str, StreamId | None], count: int) -> ReadSent | None:
        """``read_after`` sent now, its replies read later (``ReadSent.take``): the caller goes on meanwhile.

        None on a cluster (the streams may be on several nodes): the caller reads with ``read_after``.
        """
        if self.conn.cluster:
            return None
        streams = list(positions)
        commands = [("XRANGE", stream, _after(positions[stream]), "+", "COUNT", count) for stream in streams]
        with self.conn.translate_errors(", ".join(streams)):
            connection = send_packed(self.conn.client.connection_pool, commands)
        return ReadSent(self.conn, connection, streams)

    def read_tails(self, streams: Sequence[str], count: int) -> list[tuple[str, list[RawEntry]]]:
        """The last ``count`` entries of each stream, oldest first, no group (``pspf topic read``).

        One pipelined XREVRANGE per stream; empty streams are left out.
        """
        with self.conn.translate_errors(", ".join(streams)):
            pipe = self.conn.client.pipeline(transaction=False)
            for stream in streams:
                pipe.xrevrange(stream, "+", "-", count)
            replies = pipe.execute()
        pairs = zip(streams, replies, strict=True)
        return [(stream, list(reversed(entries))) for stream, entries in pairs if entries]

    def read_new(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]:
        """Deliver new entries from the streams (stream, lease key, lease value) we hold leases on.

        The leases are WATCHed, checked, and the XREADGROUP runs in MULTI/EXEC: if another worker
        takes a lease in between, nothing is delivered. So a worker that lost a lease cannot take
        entries out of the group's order, and none can end up unapplied below the new owner's
        checkpoint. Returns the streams whose lease is lost, the entries read, and, when nothing
        was read, each stream's last generated id (``lua/last_ids.lua``) for ``wait_for_new``.

        On a cluster, where one MULTI cannot span partitions, each partition's read is a Lua call
        that checks its lease (``lua/read.lua``), pipelined per node.
        """
        if self.conn.cluster:
            return self._read_new_scripted(group, consumer, streams, count)
        lease_keys = [lease for _, lease, _ in streams]
        with (
            self.conn.translate_errors(", ".join(s for s, _, _ in streams)),
            self.conn.client.pipeline(transaction=True) as pipe,
        ):
            while True:  # a lease renewed meanwhile (the keeper's thread) breaks the WATCH: again
                pipe.watch(*lease_keys)
                held_values = pipe.mget(lease_keys)
                held = [
                    stream
                    for (stream, _, value), current in zip(streams, held_values, strict=True)
                    if current is not None and _text(current) == value
                ]
                lost = [stream for stream, _, _ in streams if stream not in held]
                if not held:
                    pipe.unwatch()
                    return lost, [], {}
                pipe.multi()
                read = ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS")
                pipe.execute_command(*read, *held, *[">"] * len(held))
                try:
                    (reply,) = pipe.execute()
                    break
                except redis.WatchError:
                    continue  # the leases are read again: a moved one is lost then
        if reply:
            return lost, [(stream, _entries(raw)) for stream, raw in reply], {}
        (last,) = self.conn.eval_pipelined(self._last_ids, [(held, [])])
        return lost, [], {s: bytes(found) for s, found in zip(held, last, strict=True)}

    def _read_new_scripted(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]:
        calls = [([stream, lease], [group, consumer, count, value]) for stream, lease, value in streams]
        return fenced_reads([s for s, _, _ in streams], self.conn.eval_pipelined(self._read, calls))

    def read_ahead(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> ReadAhead:
        """Send ``read_new`` of the streams now and read its reply later (``pspf.broker.ahead``).

        The server builds the next batch while this process runs the current one. The read is
        fenced like any other: in MULTI/EXEC under leases watched since the last read sent ahead,
        or through ``lua/read.lua``. Not on a cluster, whose partitions' reads go to several nodes.
        """
        with self.conn.translate_errors():
            try:
                armed = self.reader.armed(streams)
                if not armed and not self._read_loaded:  # else the first read ahead finds no script
                    self.load_read_script()
                self.reader.send(ReadAhead.commands(self, group, consumer, streams, count, armed))
            except BaseException:
                self.reader.close()
                raise
        return ReadAhead(self, list(streams), armed)

    @property
    def read_sha(self) -> str:
        return str(self._read.sha)

    def load_read_script(self) -> None:
        """Load ``lua/read.lua`` into the server's script cache (a read sent ahead cannot load it)."""
        with self.conn.translate_errors():
            self.conn.client.script_load(self._read.script)
        self._read_loaded = True

    def wait_for_new(self, last_ids: dict[str, bytes], block_ms: int) -> None:
        """Block until an entry newer than ``last_ids`` arrives or ``block_ms`` passes.

        A plain XREAD delivers nothing to the group: the next ``read_new`` takes the entries. On a
        cluster, where one XREAD cannot span partitions, the streams are looked at every
        ``CLUSTER_POLL_MS`` instead (one XREAD per partition, pipelined: a round trip per node).
        """
        if not self.conn.cluster or len({self.conn.client.keyslot(s) for s in last_ids}) <= 1:
            with self.conn.translate_errors():
                self.conn.client.xread(dict(last_ids), count=1, block=block_ms)
            return
        deadline = time.monotonic() + block_ms / 1000
        while True:
            with self.conn.translate_errors():
                pipe = self.conn.client.pipeline(transaction=False)
                for stream, after in last_ids.items():
                    pipe.xread({stream: after}, count=1)
                if any(pipe.execute()) or time.monotonic() >= deadline:
                    return
            time.sleep(min(CLUSTER_POLL_MS / 1000, max(0.0, deadline - time.monotonic())))

    def delivery_counts(self, stream: str, group: str, ids: Sequence[bytes]) -> dict[bytes, int]:
        """How often each of these pending entries was delivered (one XPENDING each, pipelined)."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xpending_range(stream, group, entry_id, entry_id, 1)
            replies = pipe.execute()
        return {
            row["message_id"]: int(row["times_delivered"])
            for rows in replies
            for row in cast(list[dict[str, Any]], rows)
        }

    def claim_idle(self, stream: str, group: str, consumer: str, min_idle_ms: int) -> tuple[list[bytes], int]:
        """Move the group's entries idle longer than ``min_idle_ms`` in ``stream`` to ``consumer``.

        With 0 it takes every pending entry (on takeover). Follows the XAUTOCLAIM cursor in
        bounded steps. Entries deleted while pending are dropped from the PEL by Redis 7 and
        returned apart; they are logged as lost. Returns (claimed ids, deleted count).
        """
        claimed: list[bytes] = []
        deleted = 0
        cursor: bytes | str = b"0-0"
        while True:
            with self.conn.translate_errors():
                reply = self.conn.on(stream).execute_command(  # type: ignore[no-untyped-call]
                    "XAUTOCLAIM",
                    stream,
                    group,
                    consumer,
                    min_idle_ms,
                    cursor,
                    "COUNT",
                    _CLAIM_COUNT,
                    "JUSTID",
                )
            cursor, ids = reply[0], reply[1]
            claimed += ids
            if len(reply) > 2 and reply[2]:
                deleted += len(reply[2])
                log.warning(
                    "entries deleted while pending, lost before processing stream=%s ids=%s",
                    stream,
                    [_text(i) for i in reply[2]],
                )
            if _text(cursor) == "0-0":
                return claimed, deleted

    def pending_entries(
        self, stream: str, group: str, end: keys.StreamId | None = None, min_idle_ms: int = 0
    ) -> list[PendingEntry]:
        """The group's pending entries up to ``end`` (all without), of every consumer, in id order.

        With ``min_idle_ms`` only those idle at least that long. Read in pages of XPENDING.
        """
        found: list[PendingEntry] = []
        start, last = "-", "+" if end is None else str(end)
        while True:
            with self.conn.translate_errors(stream):
                rows = cast(
                    list[dict[str, Any]],
                    self.conn.client.xpending_range(
                        stream, group, start, last, _CLAIM_COUNT, idle=min_idle_ms or None
                    ),
                )
            found += [
                PendingEntry(
                    row["message_id"],
                    _text(row["consumer"]),
                    int(row["time_since_delivered"]),
                    int(row["times_delivered"]),
                )
                for row in rows
            ]
            if len(rows) < _CLAIM_COUNT:
                return found
            start = str(keys.StreamId.parse(rows[-1]["message_id"]).next())

    def acknowledged_after(self, stream: str, group: str, after: keys.StreamId | None, upto: bytes) -> bool:
        """Whether ``group`` acknowledged an entry after ``after`` and up to ``upto``.

        That is an entry of the range that exists and is not pending (``upto``: the group's last
        delivered id). Only the first 1,000 entries of the range are looked at: a store behind by
        more than 1,000 pending entries in a row with nothing acknowledged among them is missed.
        """
        end = keys.StreamId.parse(upto)
        if after is not None and end <= after:
            return False
        start = "-" if after is None else str(after.next())
        with self.conn.translate_errors(stream):
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.xrange(stream, start, str(end), count=_CLAIM_COUNT)
            pipe.xpending_range(stream, group, start, str(end), _CLAIM_COUNT)
            entries, pending = pipe.execute()
        held = {row["message_id"] for row in pending}
        if len(pending) == _CLAIM_COUNT:  # only as far as the pending page reaches
            last = keys.StreamId.parse(pending[-1]["message_id"])
            entries = [e for e in entries if keys.StreamId.parse(e[0]) <= last]
        return any(entry_id not in held for entry_id, _ in entries)

    def claim_ids(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, ids: Sequence[bytes]
    ) -> list[bytes]:
        """Move these pending entries to ``consumer`` where still idle ``min_idle_ms``; the ids moved.

        Unlike XAUTOCLAIM, it takes nothing but the entries named, so an entry that became
        pending (or active again) since they were chosen is left alone.
        """
        claimed: list[bytes] = []
        for start in range(0, len(ids), _CLAIM_COUNT):
            chunk = ids[start : start + _CLAIM_COUNT]
            with self.conn.translate_errors(stream):
                claimed += self.conn.on(stream).execute_command(  # type: ignore[no-untyped-call]
                    "XCLAIM", stream, group, consumer, min_idle_ms, *chunk, "JUSTID"
                )
        return claimed

    def pending_counts(
        self, stream: str, group: str, consumer: str, after: keys.StreamId, count: int
    ) -> list[tuple[bytes, int]]:
        """Own pending entries after ``after`` with their delivery counts, without delivering."""
        start = "-" if after == keys.ZERO_ID else str(after.next())
        with self.conn.translate_errors():
            rows = self.conn.client.xpending_range(stream, group, start, "+", count, consumer)
        return [(row["message_id"], int(row["times_delivered"])) for row in cast(list[dict[str, Any]], rows)]

    def claim_entries(
        self, stream: str, group: str, consumer: str, ids: Sequence[bytes], lease: tuple[str, str]
    ) -> list[RawEntry] | None:
        """Re-deliver own pending entries by id (XCLAIM counts the delivery); gone ones are left out.

        Only under the (lease key, value) held, as ``read_new``: None, and nothing claimed, when
        the lease moved. An ex-owner would otherwise take its old entries back from the new
        owner, and every such delivery would make them look more like poison.
        """
        lease_key, lease_value = lease
        with self.conn.translate_errors(stream), self.conn.on(stream).pipeline(transaction=True) as pipe:
            while True:  # a lease renewed meanwhile (the keeper's thread) breaks the WATCH: again
                pipe.watch(lease_key)  # type: ignore[no-untyped-call]
                if _text(pipe.get(lease_key)) != lease_value:
                    pipe.unwatch()
                    return None
                pipe.multi()
                pipe.execute_command("XCLAIM", stream, group, consumer, 0, *ids)  # type: ignore[no-untyped-call]
                try:
                    (reply,) = pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return [entry for entry in _entries([e for e in reply if e is not None]) if entry[1] is not None]


def _after(position: StreamId | None) -> str:
    """XRANGE's start for the entries past ``position`` (None: from the first)."""
    return "-" if position is None else str(position.next())


class ReadSent:
    """A ``read_after`` sent (``Reading.send_read_after``); its connection is its own until read."""

    def __init__(self, conn: Connection, connection: Any, streams: list[str]) -> None:
        self.conn = conn
        self._connection = connection
        self._streams = streams

    def take(self) -> list[tuple[str, list[RawEntry]]]:
        """What ``read_after`` returns: per stream with entries past its position, those entries."""
        connection, self._connection = self._connection, None
        assert connection is not None, "a read sent is taken once"
        pool = self.conn.client.connection_pool
        try:
            with self.conn.translate_errors(", ".join(self._streams)):
                replies = [connection.read_response() for _ in self._streams]
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        return [(stream, _entries(raw)) for stream, raw in zip(self._streams, replies, strict=True) if raw]

    def abandon(self) -> None:
        """Close the connection unread: the read changed nothing on the server."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()
            self.conn.client.connection_pool.release(connection)
