"""Writing entries: producers' XADDs, the outbox's publishing calls, sinks' chunks, the memory guard.

Every write first passes ``guard_memory``: near the servers' maxmemory producers slow down, and
at ``memory_fail_at`` they stop (MemoryFull) before the server evicts or refuses writes.
Publishing calls (``lua/publish.lua``) add each producer's row at most once; ``send_publish``
sends them in one write and ``SentCalls`` reads their replies later, sending again only the calls
the server refused for a lost script cache, so nothing runs twice.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import redis
from redis.exceptions import NoScriptError

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import MEMORY_CHECK_S, MEMORY_PAUSE_S, Fields, _text, send_packed
from pspf.codec import interleaved
from pspf.errors import BrokerError, BrokerUnavailable, MemoryFull

log = logging.getLogger(__name__)


class PublishCall(NamedTuple):
    """One publishing call (``lua/publish.lua``): rows of one shape to one target partition."""

    target: tuple[str, int]
    #: the sequence number the producer's record there must have reached before it runs (0: none)
    prev: int
    #: the rows' sequence numbers as runs, "first:count,..."
    seqs: str
    names: tuple[bytes, ...]
    #: the headers' JSON up to the source entry id, the last value of each row (b"": the last
    #: value is the headers whole)
    head: bytes
    #: each row's values, one after another
    values: list[bytes]
    #: the layout generation the rows were routed in (the target refuses another: a repartition)
    layout: str = "0"


def refused_layout(reply: object) -> str | None:
    """The target's layout when ``reply`` is a refusal of the caller's (``LAYOUT <current>``)."""
    if isinstance(reply, Exception):
        found = re.search(r"\bLAYOUT (\S+)", str(reply))
        if found is not None:
            return found.group(1)
    return None


class Publishing:
    """Producers' and the outbox's writes, held back near the servers' maxmemory."""

    def __init__(self, conn: Connection, memory_limits: tuple[float, float]) -> None:
        self.conn = conn
        #: (``memory_slow_at``, ``memory_fail_at``): shares of maxmemory
        self._memory_limits = memory_limits
        #: (when last read, highest share of maxmemory in use over the servers)
        self._memory: tuple[float, float] = (-MEMORY_CHECK_S, 0.0)
        self._slowed = False
        self._publish = conn.register("publish")
        self._add = conn.register("add")
        self._sink_write = conn.register("sink_write")

    def guard_memory(self) -> None:
        """Producers' brake: pause near the servers' maxmemory, and refuse (MemoryFull) at it.

        Above ``memory_slow_at`` of maxmemory a write waits, the longer the fuller the server
        (up to MEMORY_PAUSE_S), so workers can drain and retention trim; above ``memory_fail_at``
        it fails, before the server evicts keys or refuses writes. No limit without maxmemory.
        """
        checked, used = self._memory
        if used > 0 or time.monotonic() - checked >= MEMORY_CHECK_S:  # with a limit, before each write
            used = 0.0
            for server in self.conn.servers():
                with self.conn.translate_errors():
                    info = server.info("memory")
                limit = int(info.get("maxmemory", 0))
                if limit:
                    used = max(used, int(info["used_memory"]) / limit)
            self._memory = (time.monotonic(), used)
        slow_at, fail_at = self._memory_limits
        if used >= fail_at:
            raise MemoryFull(
                f"the server at {self.conn.url} uses {used:.0%} of its maxmemory: producing stops before it "
                f"evicts or refuses writes (PSPF_MEMORY_FAIL_AT={fail_at}); let the apps catch up and "
                "trim the topics (pspf topic trim), or give the server more memory"
            )
        if used >= slow_at:
            if not self._slowed:  # said once per stretch
                log.warning(
                    "the server at %s uses %.0f%% of its maxmemory: producing slows down",
                    self.conn.url,
                    100 * used,
                )
            self._slowed = True
            time.sleep(MEMORY_PAUSE_S * min(1.0, (used - slow_at) / max(fail_at - slow_at, 1e-9)))
        else:
            self._slowed = False

    def add_entries(
        self, entries: Sequence[tuple[str, Fields]], maxlen: str = "", minid: str = ""
    ) -> list[bytes]:
        """XADD many entries in one pipelined round trip; their ids, in order.

        ``maxlen`` or ``minid`` trim each stream approximately as it grows. Held back near the
        server's maxmemory (``guard_memory``).
        """
        self.guard_memory()
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for stream, fields in entries:
                pipe.xadd(
                    stream,
                    fields,
                    maxlen=int(maxlen) if maxlen else None,
                    minid=minid or None,
                    approximate=True,
                )
            return list(pipe.execute())

    def add_in_layout(
        self, topic: str, layout: str, entries: Mapping[int, Sequence[Fields]], after: str = ""
    ) -> dict[int, list[bytes] | None]:
        """Append each partition's entries unless its layout is not ``layout``; one round trip.

        Per partition, the new ids, or None when its layout moved on (nothing of it was written:
        the producer reads the topic's count again). Held back near the server's maxmemory.
        ``after``: an id ("MS-SEQ") the entries' ids follow (an ordered producer; see
        ``lua/add.lua``); "": the server's ids.
        """
        self.guard_memory()
        partitions = list(entries)
        calls = []
        for partition in partitions:
            args: list[Any] = [layout, after]
            for fields in entries[partition]:
                args.append(2 * len(fields))
                for name, value in fields.items():
                    args += (name, value)
            calls.append(([keys.stream_key(topic, partition), keys.layout_key(topic, partition)], args))
        # EVALSHA straight into the pipeline (one per node): redis-py's script objects would send
        # SCRIPT EXISTS, which an ACL user may lack, and a cluster pipeline refuses them.
        replies = self.conn.eval_pipelined(self._add, calls, raise_on_error=False)
        found: dict[int, list[bytes] | None] = {}
        for partition, reply in zip(partitions, replies, strict=True):
            if refused_layout(reply) is not None:
                found[partition] = None
            elif isinstance(reply, Exception):
                raise reply
            else:
                found[partition] = list(reply)
        return found

    def publish(self, topic: str, partition: int, producer: str, rows: Sequence[tuple[int, Fields]]) -> int:
        """Append a producer's rows to a topic partition, each at most once; how many were new.

        Rows are (sequence, fields), the same field names in each; this waits for the reply (see
        ``lua/publish.lua``).
        """
        names = tuple(rows[0][1]) if rows else ()
        seqs = ",".join(f"{seq}:1" for seq, _ in rows)
        values = [value for _, fields in rows for value in fields.values()]
        (reply,) = self.send_publish(
            producer, [PublishCall((topic, partition), 0, seqs, names, b"", values)]
        ).replies()
        if isinstance(reply, BaseException):
            raise reply
        return int(reply[0])

    def send_views(self, kinds: Mapping[str, str], writes: Mapping[str, Mapping[Any, Any]]) -> ViewsSent:
        """Send views' final values in one write; the replies are read later (``ViewsSent.wait``).

        ``writes``: view -> field (or member) -> value (or score), None removing it; ``kinds``:
        each view's "hash" or "zset". Each view is one HSET (ZADD), and one HDEL (ZREM) when some
        are removed. On a cluster each view's key goes to its own node, at once.
        """
        commands = [
            command
            for view, fields in writes.items()
            for command in _view_commands(view, kinds[view], fields)
        ]
        with self.conn.translate_errors():
            if self.conn.cluster:
                pipe = self.conn.client.pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                pipe.execute()
                return ViewsSent(self.conn, None, 0)
            connection = send_packed(self.conn.client.connection_pool, commands)
        return ViewsSent(self.conn, connection, len(commands))

    def key_types(self, names: Sequence[str]) -> list[str]:
        """The type of each key (``none`` when missing), in one pipelined round trip."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for name in names:
                pipe.type(name)
            return [_text(t) for t in pipe.execute()]

    def published_up_to(self, producer: str, targets: Sequence[tuple[str, int]]) -> list[int]:
        """The last sequence number each target partition recorded for a producer (0: none)."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for target in targets:
                pipe.hget(keys.producers_key(*target), producer)
            return [int(v or 0) for v in pipe.execute()]

    def send_publish(self, producer: str, calls: Sequence[PublishCall]) -> SentCalls:
        """Send publishing calls (``lua/publish.lua``) in one write; their replies are read later.

        The server runs them while this process goes on; ``SentCalls.replies`` reads them. On a
        cluster the calls run at once, one round trip per node.
        """
        scripted = [
            (
                [keys.stream_key(*t), keys.producers_key(*t), keys.layout_key(*t)],
                [
                    call.layout,
                    producer,
                    call.prev,
                    call.seqs,
                    len(call.names),
                    *call.names,
                    call.head,
                    *call.values,
                ],
            )
            for call in calls
            for t in (call.target,)
        ]
        if self.conn.cluster:
            try:
                replies = self.conn.eval_pipelined(self._publish, scripted, raise_on_error=False)
            except BrokerError as exc:
                return SentCalls.failed(len(calls), exc)
            return SentCalls(self, None, scripted, [self.conn.reply_or_error(r) for r in replies])
        try:
            with self.conn.translate_errors():
                connection = send_packed(
                    self.conn.client.connection_pool,
                    [("EVALSHA", self._publish.sha, 3, *k, *a) for k, a in scripted],
                )
        except BrokerError as exc:
            return SentCalls.failed(len(calls), exc)
        return SentCalls(self, connection, scripted)

    def add_chunks(
        self,
        topic: str,
        layout: str,
        chunks: Mapping[int, tuple[str | None, list[Any]]],
        marker_ttl_s: int,
        maxlen: str = "",
        minid: str = "",
    ) -> dict[int, int | None]:
        """Add chunks of entries to a topic's partitions, one Lua call each, in one pipelined round trip.

        ``chunks`` maps a partition to (marker or None, flat entries): per entry the number of field
        and value arguments, then those arguments. A chunk's marker counts its entries already
        added, which are skipped. Per partition, how many entries its chunk added, or None when the
        partition's layout is not ``layout`` (a repartition): then nothing of it was written, marker
        included. Held back near the server's maxmemory (``guard_memory``).
        """
        self.guard_memory()
        partitions = list(chunks)
        calls = []
        for partition in partitions:
            marker, flat = chunks[partition]
            names = [keys.stream_key(topic, partition), keys.layout_key(topic, partition)]
            calls.append(
                (names if marker is None else [*names, marker], [layout, marker_ttl_s, maxlen, minid, *flat])
            )
        replies = self.conn.eval_pipelined(self._sink_write, calls, raise_on_error=False)
        added: dict[int, int | None] = {}
        for partition, reply in zip(partitions, replies, strict=True):
            if refused_layout(reply) is not None:
                added[partition] = None
                continue
            if isinstance(reply, redis.ResponseError):
                with self.conn.translate_errors():
                    raise reply
            added[partition] = int(reply)
        return added


def _view_commands(view: str, kind: str, fields: Mapping[Any, Any]) -> list[tuple[Any, ...]]:
    """A view's writes as plain commands: HSET (ZADD) of what it sets, HDEL (ZREM) of what it removes.

    Plain commands, not a script: a script unpacking the same values costs the server 3-9 times
    the HSET (and more than the worker saves by packing msgpack instead), measured on Valkey 9.1
    and Redis 7.0 alike.
    """
    hash_ = kind == "hash"
    removed = None in fields.values()  # C speed; the common batch removes nothing
    kept = fields if not removed else {field: value for field, value in fields.items() if value is not None}
    commands: list[tuple[Any, ...]] = []
    if kept:
        head = ("HSET", view) if hash_ else ("ZADD", view)
        flat = interleaved(head, kept, kept.values()) if hash_ else interleaved(head, kept.values(), kept)
        commands.append(tuple(flat))
    if removed:
        gone = [field for field, value in fields.items() if value is None]
        commands.append(("HDEL" if hash_ else "ZREM", view, *gone))
    return commands


class ViewsSent:
    """Views' writes sent (``Publishing.send_views``); their connection is theirs until ``wait``."""

    def __init__(self, conn: Connection, connection: Any, count: int) -> None:
        self.conn = conn
        self._connection = connection
        self._count = count

    def wait(self) -> None:
        """Read the replies: raises the PSPF error of the first that failed (then none may have run)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        failed: BaseException | None = None
        try:
            with self.conn.translate_errors():
                for _ in range(self._count):
                    try:
                        connection.read_response()
                    except redis.ResponseError as exc:
                        failed = failed or exc
                if failed is not None:
                    raise failed
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self.conn.client.connection_pool.release(connection)

    def abandon(self) -> None:
        """Close the connection unread (the writes may or may not have run)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()
            self.conn.client.connection_pool.release(connection)


class SentCalls:
    """Publishing calls sent (``Publishing.send_publish``); their connection is theirs until read.

    ``replies`` gives one reply per call, or the PSPF error of the call: a call that did not run
    because the server had lost its scripts is sent again then; calls whose replies cannot be read
    (a lost connection) are errors, whether or not they ran.
    """

    def __init__(
        self,
        publishing: Publishing | None,
        connection: Any,
        calls: list[tuple[list[Any], list[Any]]],
        replies: list[Any] | None = None,
    ) -> None:
        self.publishing = publishing
        self._connection = connection
        self._calls = calls
        self._replies = replies

    @classmethod
    def failed(cls, count: int, error: BrokerError) -> SentCalls:
        return cls(None, None, [], [error] * count)

    def replies(self) -> list[Any]:
        if self._replies is not None:
            return self._replies
        publishing, connection = self.publishing, self._connection
        assert publishing is not None and connection is not None
        conn = publishing.conn
        self._connection = None
        replies: list[Any] = []
        try:
            with conn.translate_errors():
                for _ in self._calls:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:
                        replies.append(exc)
        except BrokerError as exc:
            connection.disconnect()
            replies += [exc] * (len(self._calls) - len(replies))
        finally:
            conn.client.connection_pool.release(connection)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            try:
                again = conn.eval_pipelined(
                    publishing._publish, [self._calls[i] for i in missing], raise_on_error=False
                )
            except BrokerError as exc:
                again = [exc] * len(missing)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        self._replies = [conn.reply_or_error(reply) for reply in replies]
        return self._replies

    def abandon(self) -> None:
        """Close the connection unread (the calls may or may not have run)."""
        if self._connection is not None and self.publishing is not None:
            self._connection.disconnect()
            self.publishing.conn.client.connection_pool.release(self._connection)
            self._connection = None
            self._replies = [BrokerUnavailable("the connection of the publishing calls was closed")] * len(
                self._calls
            )
