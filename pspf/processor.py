"""The batch processor: exactly-once effects on state from at-least-once stream delivery.

One cycle (``BatchProcessor.run_once``) over the partitions this worker owns:

1. read: one XREADGROUP over the owned streams, in a MULTI/EXEC that WATCHes their leases, so a
   worker that lost a lease takes nothing more from it (a stream that must first re-read its own
   pending entries is read from its pending list);
2. skip done work: an entry at or below its stream's checkpoint was applied before a crash; it is
   acknowledged without running the handler;
3. decode: with the handler's reusable msgspec decoder;
4. handle: the handler runs with a ``Context``; an entry's state writes join the batch only if
   its handler returns. The first failure stops its stream: the entries before it commit, the
   entries after it wait and are re-read from the pending list after a delay;
5. commit: ONE store transaction per partition holds the state writes and the new checkpoints;
6. acknowledge: ONE pipelined round trip acknowledges every stream's batch, each in a Lua call
   that checks the stream's lease token; it happens only after step 5 returned.

Invariants kept here: nothing is acknowledged before the commit that holds its effects; a stream
is applied in id order by one owner, and an owner works through its own pending entries before it
reads new ones, so no entry at or below a checkpoint is ever still unapplied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import codec
from pspf.app import App, Handler
from pspf.broker import AckRequest, Broker, RawEntry
from pspf.context import Context
from pspf.errors import DecodeError, LeaseLost, StateError
from pspf.keys import ZERO_ID, StreamId

if TYPE_CHECKING:
    from state_stores import StateStore

log = logging.getLogger(__name__)

#: The store namespace that holds ``ctx.state``.
STATE_NAMESPACE = "state"
#: Committed values kept in memory per partition; the store is ours alone while we own it.
CACHE_LIMIT = 100_000


@dataclass(slots=True, eq=False)
class StreamCursor:
    """Where this worker stands in one owned topic partition."""

    topic: str
    partition: int
    stream: str
    lease_key: str
    lease_value: str
    checkpoint: StreamId | None
    #: Read own pending entries after this id before new ones; None once caught up.
    pending_after: StreamId | None = ZERO_ID
    #: After a failure, the stream is not read before this monotonic time.
    retry_at: float = 0.0

    def rewind(self) -> None:
        """Re-read all own pending entries: after a failure or a lost connection.

        From the start, not from the checkpoint: entries at or below it may be pending too when
        their acknowledgement was lost; reading them again acknowledges them.
        """
        self.pending_after = ZERO_ID


@dataclass(slots=True, eq=False)
class OwnedPartition:
    """A partition this worker holds the leases of, with its open store."""

    partition: int
    store: StateStore
    streams: dict[str, StreamCursor]
    cache: dict[str, bytes | None] = field(default_factory=dict)


class CycleResult(msgspec.Struct, kw_only=True):
    """What one cycle did."""

    read: int = 0
    skipped: int = 0
    handled: int = 0
    failed: int = 0
    lost_entries: int = 0
    lost_partitions: list[int] = msgspec.field(default_factory=list)
    idle: bool = False


class PartitionBatch:
    """The state writes of one partition in one batch, on top of the committed state."""

    __slots__ = ("overlay", "owned")

    def __init__(self, owned: OwnedPartition) -> None:
        self.owned = owned
        self.overlay: dict[str, bytes | None] = {}

    def base(self, key: str) -> bytes | None:
        """The value of ``key`` as the next entry must see it."""
        overlay = self.overlay
        if key in overlay:
            return overlay[key]
        cache = self.owned.cache
        if key in cache:
            return cache[key]
        value = self.owned.store.get(STATE_NAMESPACE, key)
        if len(cache) < CACHE_LIMIT:
            cache[key] = value
        return value


class _ChainSource:
    """The state one key's chain of async handlers sees: the batch's, then its own results."""

    __slots__ = ("batch", "results")

    def __init__(self, batch: PartitionBatch) -> None:
        self.batch = batch
        self.results: dict[str, bytes | None] = {}

    def base(self, key: str) -> bytes | None:
        if key in self.results:
            return self.results[key]
        return self.batch.base(key)


_UNCHANGED = b"\x00unchanged"


def _state_result(ctx: Context) -> bytes | None:
    """The key's new encoded state after a handler returned, ``_UNCHANGED`` if untouched."""
    state = ctx._state
    if state is None:
        return _UNCHANGED
    try:
        new = codec.state_encoder.encode(state) if state else None
    except (TypeError, msgspec.EncodeError) as exc:
        raise StateError(f"state of key {ctx.key!r} cannot be encoded: {exc}") from exc
    return _UNCHANGED if new == ctx._base else new


class _Screened(NamedTuple):
    """Entries of one stream read in this cycle, sorted into what needs a handler and not."""

    todo: list[tuple[bytes, dict[bytes, bytes]]]
    done_ids: list[bytes]
    lost: int


class _StreamOutcome(NamedTuple):
    cursor: StreamCursor
    applied: list[bytes]
    ack_ids: list[bytes]
    failed: bool


class BatchProcessor:
    """Runs the cycle for the partitions in ``owned``; the worker adds and removes them."""

    def __init__(
        self,
        app: App,
        broker: Broker,
        consumer: str,
        batch_size: int,
        block_ms: int,
        retry_delay_ms: int,
    ) -> None:
        self.app = app
        self.broker = broker
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.retry_delay_s = retry_delay_ms / 1000
        self.owned: dict[int, OwnedPartition] = {}
        self._by_stream: dict[str, StreamCursor] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- ownership bookkeeping (called by the worker) -----------------------------------------

    def add(self, owned: OwnedPartition) -> None:
        self.owned[owned.partition] = owned
        for cursor in owned.streams.values():
            self._by_stream[cursor.stream] = cursor

    def remove(self, partition: int) -> OwnedPartition:
        owned = self.owned.pop(partition)
        for cursor in owned.streams.values():
            self._by_stream.pop(cursor.stream, None)
        return owned

    def rewind_all(self) -> None:
        """After a lost connection nothing read is trusted: re-read every own pending entry."""
        for cursor in self._by_stream.values():
            cursor.rewind()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -- the cycle ------------------------------------------------------------------------------

    def run_once(self, block: bool = True) -> CycleResult:
        """One cycle: read, skip done, decode, handle, commit, acknowledge.

        With ``block`` the read waits up to ``block_ms`` for new entries; without, it only looks.
        """
        result = CycleResult()
        reply = self._read(block, result)
        by_partition: dict[int, list[tuple[StreamCursor, list[RawEntry], dict[bytes, int]]]] = {}
        for stream, entries, counts in reply:
            cursor = self._by_stream[stream]
            by_partition.setdefault(cursor.partition, []).append((cursor, entries, counts))
            result.read += len(entries)
        acks: list[AckRequest] = []
        outcomes: list[_StreamOutcome] = []
        for partition, streams in by_partition.items():
            owned = self.owned[partition]
            batch = PartitionBatch(owned)
            partition_outcomes = self._handle(batch, streams, result)
            self._commit(batch, partition_outcomes)
            outcomes += partition_outcomes
            acks += [
                AckRequest(
                    o.cursor.stream, self.app.name, o.cursor.lease_key, o.cursor.lease_value, o.ack_ids
                )
                for o in partition_outcomes
                if o.ack_ids
            ]
        self._acknowledge(acks, result)
        self._advance(outcomes, reply)
        result.idle = result.read == 0 and all(
            c.pending_after is None and c.retry_at == 0.0 for c in self._by_stream.values()
        )
        return result

    # -- step 1: read -------------------------------------------------------------------------

    def _read(self, block: bool, result: CycleResult) -> list[tuple[str, list[RawEntry], dict[bytes, int]]]:
        now = time.monotonic()
        ready = [c for c in self._by_stream.values() if c.retry_at <= now]
        if not ready:
            self._wait_for_retry(now)
            return []
        group, consumer, count = self.app.name, self.consumer, self.batch_size
        out: list[tuple[str, list[RawEntry], dict[bytes, int]]] = []
        pending = {c.stream: str(c.pending_after) for c in ready if c.pending_after is not None}
        if pending:
            for stream_b, entries in self.broker.read_group(group, consumer, pending, count, None):
                stream = stream_b.decode()
                if entries:
                    counts = self.broker.delivery_counts(
                        stream, group, consumer, entries[0][0], entries[-1][0], len(entries)
                    )
                    out.append((stream, entries, counts))
            caught_up = set(pending) - {stream for stream, _, _ in out}
            for stream in caught_up:
                self._by_stream[stream].pending_after = None
        live = [(c.stream, c.lease_key, c.lease_value) for c in ready if c.pending_after is None]
        if live:
            lost, entries_by_stream, last_ids = self.broker.read_new(group, consumer, live, count)
            for stream in lost:
                self._lease_lost(stream, "the read found the lease taken", result)
            out += [(stream_b.decode(), entries, {}) for stream_b, entries in entries_by_stream if entries]
            if block and not out and last_ids:
                self.broker.wait_for_new(last_ids, self.block_ms)
        return out

    def _wait_for_retry(self, now: float) -> None:
        """Sleep until the first stream may retry, but no longer than one read would block."""
        if not self._by_stream:
            time.sleep(self.block_ms / 1000)
            return
        first = min(c.retry_at for c in self._by_stream.values())
        time.sleep(max(0.0, min(first - now, self.block_ms / 1000)))

    # -- steps 2-4: skip, decode, handle ------------------------------------------------------

    def _handle(
        self,
        batch: PartitionBatch,
        streams: list[tuple[StreamCursor, list[RawEntry], dict[bytes, int]]],
        result: CycleResult,
    ) -> list[_StreamOutcome]:
        outcomes = []
        for cursor, entries, counts in streams:
            screened = self._screen(cursor, entries)
            result.skipped += len(screened.done_ids) - screened.lost
            result.lost_entries += screened.lost
            handler = self.app.handlers[cursor.topic]
            if handler.is_async:
                applied = self._run_async(handler, cursor, screened.todo, counts, batch)
            else:
                applied = self._run_sync(handler, cursor, screened.todo, counts, batch)
            failed = len(applied) < len(screened.todo)
            result.handled += len(applied)
            result.failed += int(failed)
            ack_ids = screened.done_ids + applied
            outcomes.append(_StreamOutcome(cursor, applied, ack_ids, failed))
        return outcomes

    @staticmethod
    def _screen(cursor: StreamCursor, entries: list[RawEntry]) -> _Screened:
        # Ids in a reply ascend, so the entries at or below the checkpoint are a prefix: only
        # those ids need parsing.
        done_ids = []
        start = 0
        checkpoint = cursor.checkpoint
        if checkpoint is not None:
            while start < len(entries) and StreamId.parse(entries[start][0]) <= checkpoint:
                done_ids.append(entries[start][0])
                start += 1
        rest = entries[start:]
        if all(fields is not None for _, fields in rest):
            return _Screened(rest, done_ids, 0)  # type: ignore[arg-type]
        todo = []
        lost = 0
        for id_b, fields in rest:
            if fields is None:
                log.warning(
                    "entry deleted while pending, lost before processing topic=%s partition=%s id=%s",
                    cursor.topic,
                    cursor.partition,
                    id_b.decode(),
                )
                done_ids.append(id_b)
                lost += 1
            else:
                todo.append((id_b, fields))
        return _Screened(todo, done_ids, lost)

    def _run_sync(
        self,
        handler: Handler,
        cursor: StreamCursor,
        todo: list[tuple[bytes, dict[bytes, bytes]]],
        counts: dict[bytes, int],
        batch: PartitionBatch,
    ) -> list[bytes]:
        """Run entries in id order until the first failure; return the applied ones."""
        applied = []
        overlay = batch.overlay
        decode, func = handler.decoder.decode, handler.func
        topic, partition = cursor.topic, cursor.partition
        for id_b, fields in todo:
            try:
                ctx = Context(
                    topic,
                    partition,
                    id_b,
                    _key(fields),
                    counts.get(id_b, 1),
                    fields.get(codec.HEADERS),
                    batch,
                )
                func(decode(fields), ctx)
                new = _state_result(ctx)
            except Exception as exc:
                self._log_failure(cursor, id_b, exc)
                break
            if new is not _UNCHANGED:
                overlay[ctx.key] = new
            applied.append(id_b)
        return applied

    def _run_async(
        self,
        handler: Handler,
        cursor: StreamCursor,
        todo: list[tuple[bytes, dict[bytes, bytes]]],
        counts: dict[bytes, int],
        batch: PartitionBatch,
    ) -> list[bytes]:
        """Run one chain per key concurrently; keep the id-ordered prefix before the first failure."""
        chains: dict[str, list[int]] = {}
        for index, (_, fields) in enumerate(todo):
            try:
                key = _key(fields)
            except DecodeError:
                key = ""
            chains.setdefault(key, []).append(index)
        results: list[tuple[str, bytes | None]] = [("", _UNCHANGED)] * len(todo)
        first_failure = len(todo)

        async def chain(indexes: list[int]) -> None:
            nonlocal first_failure
            source = _ChainSource(batch)
            for index in indexes:
                if index > first_failure:
                    return
                id_b, fields = todo[index]
                try:
                    ctx = Context(
                        cursor.topic,
                        cursor.partition,
                        id_b,
                        _key(fields),
                        counts.get(id_b, 1),
                        fields.get(codec.HEADERS),
                        source,
                    )
                    await handler.func(handler.decoder.decode(fields), ctx)
                    new = _state_result(ctx)
                except Exception as exc:
                    self._log_failure(cursor, id_b, exc)
                    first_failure = min(first_failure, index)
                    return
                if new is not _UNCHANGED:
                    source.results[ctx.key] = new
                results[index] = (ctx.key, new)

        async def run_all() -> None:
            await asyncio.gather(*(chain(indexes) for indexes in chains.values()))

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(run_all())
        applied = []
        for index in range(first_failure):
            key, new = results[index]
            if new is not _UNCHANGED:
                batch.overlay[key] = new
            applied.append(todo[index][0])
        return applied

    @staticmethod
    def _log_failure(cursor: StreamCursor, entry_id: bytes, exc: Exception) -> None:
        log.warning(
            "entry failed, its partition waits topic=%s partition=%s id=%s error=%s: %s",
            cursor.topic,
            cursor.partition,
            entry_id.decode(),
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, DecodeError),
        )

    # -- step 5: commit -----------------------------------------------------------------------

    @staticmethod
    def _commit(batch: PartitionBatch, outcomes: list[_StreamOutcome]) -> None:
        checkpoints = {o.cursor.topic: StreamId.parse(o.applied[-1]) for o in outcomes if o.applied}
        if not checkpoints and not batch.overlay:
            return
        owned = batch.owned
        with owned.store.transaction() as tx:
            for key, value in batch.overlay.items():
                if value is None:
                    tx.delete(STATE_NAMESPACE, key)
                else:
                    tx.set(STATE_NAMESPACE, key, value)
            for topic, entry_id in checkpoints.items():
                tx.set_checkpoint(topic, entry_id)
        if len(owned.cache) + len(batch.overlay) > CACHE_LIMIT:
            owned.cache.clear()
        owned.cache.update(batch.overlay)
        for o in outcomes:
            if o.applied:
                o.cursor.checkpoint = checkpoints[o.cursor.topic]

    # -- step 6: acknowledge ------------------------------------------------------------------

    def _acknowledge(self, acks: list[AckRequest], result: CycleResult) -> None:
        for request, reply in zip(acks, self.broker.ack(acks), strict=True):
            if isinstance(reply, LeaseLost):
                self._lease_lost(request.stream, str(reply), result)

    def _lease_lost(self, stream: str, reason: str, result: CycleResult) -> None:
        partition = self._by_stream[stream].partition
        log.warning("lease lost, giving the partition up stream=%s: %s", stream, reason)
        if partition not in result.lost_partitions:
            result.lost_partitions.append(partition)

    def _advance(
        self, outcomes: list[_StreamOutcome], reply: list[tuple[str, list[RawEntry], dict[bytes, int]]]
    ) -> None:
        """Move each stream's read position: past what it read, or back to its pending entries."""
        last_read = {stream: StreamId.parse(entries[-1][0]) for stream, entries, _ in reply}
        for o in outcomes:
            cursor = o.cursor
            if o.failed:
                cursor.rewind()
                cursor.retry_at = time.monotonic() + self.retry_delay_s
            else:
                cursor.retry_at = 0.0
                if cursor.pending_after is not None:
                    cursor.pending_after = last_read[cursor.stream]


def _key(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(codec.KEY)
    if raw is None:
        return ""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise DecodeError("the entry key is not valid UTF-8") from None


def iter_state(store: StateStore, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every key's decoded state in one store, in key order."""
    for key, raw in store.items(STATE_NAMESPACE, prefix):
        yield key, codec.state_decoder.decode(raw)
