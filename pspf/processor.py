"""The batch processor: exactly-once effects on state from at-least-once stream delivery.

One cycle (``BatchProcessor.run_once``) over the partitions this worker owns:

1. read: one XREADGROUP over the owned streams, in a MULTI/EXEC that WATCHes their leases, so a
   worker that lost a lease takes nothing more from it. A stream that must first re-read its own
   pending entries reads them from its pending list, one at a time while their delivery counts
   say an earlier attempt may have crashed the worker (so a poison entry cannot drag its
   batch-mates' counts up with it); parked entries that are due are claimed again;
2. skip done work: an entry at or below its stream's checkpoint was applied before a crash; it is
   acknowledged without running the handler (or, if it was judged dead, moved to the DLQ);
3. decode: with the handler's reusable msgspec decoder;
4. handle: the handler runs with a ``Context``; an entry's state writes join the batch only if
   its handler returns. A failure is retried (ordered mode: the stream waits), parked (deferred
   mode: the stream goes on) or dead-lettered (not retryable, out of attempts, or delivered more
   than ``max_deliveries`` times);
5. commit: ONE store transaction per partition holds the state writes, the new checkpoints and
   the retry bookkeeping (attempts, parked entries, dead-letter decisions);
6. acknowledge: ONE pipelined round trip acknowledges every stream's batch and moves its dead
   entries to the DLQ, each stream in a Lua call that checks its lease token; it happens only
   after step 5 returned.

Invariants kept here: nothing is acknowledged before the commit that holds its effects; a stream
is applied in id order by one owner, and an owner works through its own pending entries before it
reads new ones, so no entry at or below a checkpoint is ever still unapplied (parked and dead
entries at or below it are recorded in the store and stay pending until they are dealt with).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import codec
from pspf.app import App, Handler
from pspf.broker import AckRequest, Broker, Fields, RawEntry
from pspf.codec import StateDecoder
from pspf.errors import BrokerError, LeaseLost, StateError
from pspf.execution import UNCHANGED, Entry, EntryMeta, run_async, run_sync
from pspf.failures import DeadLetter, Failure, RetryPolicy, classify, record_failure
from pspf.keys import ZERO_ID, StreamId

if TYPE_CHECKING:
    from state_stores import StateStore, StoreTransaction

log = logging.getLogger(__name__)

#: The store namespace that holds ``ctx.state``.
STATE_NAMESPACE = "state"
#: Retry bookkeeping by "topic/id": attempts so far, and the due time of parked entries.
FAILURES_NAMESPACE = "__failures"
#: Entries judged dead whose move to the DLQ is not confirmed yet, by "topic/id".
DEAD_NAMESPACE = "__dead"
#: The consumers whose reads this store's checkpoints account for: an entry pending at one of
#: them, at or below a checkpoint, was applied. Others (a foreign consumer of the group) never
#: applied anything here.
CONSUMERS_NAMESPACE = "__consumers"
#: Entries taken over from consumers outside that history at or below the checkpoint, by
#: "topic/id": run although the checkpoint passed them, then forgotten in the same commit.
FOREIGN_NAMESPACE = "__foreign"
#: Committed values kept in memory per partition; the store is ours alone while we own it.
CACHE_LIMIT = 100_000
#: Header a redrive adds so that only the app that dead-lettered an entry runs it again.
REDRIVE_APP_HEADER = "pspf-redrive-app"

_failure_decoder = msgspec.msgpack.Decoder(Failure)
_fields_decoder = msgspec.msgpack.Decoder(dict[bytes, bytes])


class Outcome(enum.Enum):
    APPLIED = "applied"
    RETRY = "retry"  # ordered mode: the stream waits and tries again
    PARKED = "parked"  # deferred mode: tried again when due, the stream goes on
    DEAD = "dead"


@dataclass(slots=True, eq=False)
class StreamCursor:
    """Where this worker stands in one owned topic partition."""

    topic: str
    partition: int
    stream: str
    dlq: str
    lease_key: str
    lease_value: str
    checkpoint: StreamId | None
    #: Read own pending entries after this id before new ones; None once caught up.
    pending_after: StreamId | None = ZERO_ID
    #: After a failure, the stream is not read before this monotonic time.
    retry_at: float = 0.0
    #: The next pending read takes one entry: the one being retried.
    isolate: bool = False
    #: Deliveries this worker made that ended without an attempt (the stream stopped before
    #: them): they explain part of an entry's delivery count, so they do not make it look poison.
    unattempted: dict[bytes, int] = field(default_factory=dict)
    #: Entries taken from foreign consumers (mirrors FOREIGN_NAMESPACE): never applied, even
    #: at or below the checkpoint, so they are run.
    foreign: set[bytes] = field(default_factory=set)

    def rewind(self) -> None:
        """Re-read all own pending entries: after a failure or a lost connection.

        From the start, not from the checkpoint: entries at or below it may be pending too when
        their acknowledgement was lost; reading them again acknowledges them.
        """
        self.pending_after = ZERO_ID


@dataclass(slots=True, eq=False)
class OwnedPartition:
    """A partition this worker holds the leases of, with its open store and bookkeeping."""

    partition: int
    store: StateStore
    streams: dict[str, StreamCursor]
    cache: dict[str, bytes | None] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    dead: dict[str, Fields] = field(default_factory=dict)
    consumers: set[str] = field(default_factory=set)

    def load_bookkeeping(self) -> None:
        self.failures = {k: _failure_decoder.decode(v) for k, v in self.store.items(FAILURES_NAMESPACE)}
        self.dead = {k: _fields_decoder.decode(v) for k, v in self.store.items(DEAD_NAMESPACE)}
        self.consumers = {name for name, _ in self.store.items(CONSUMERS_NAMESPACE)}
        by_topic = {cursor.topic: cursor for cursor in self.streams.values()}
        for name, _ in self.store.items(FOREIGN_NAMESPACE):
            topic, _, entry_id = name.rpartition("/")
            if topic in by_topic:
                by_topic[topic].foreign.add(entry_id.encode())

    def mark_foreign(self, marks: dict[StreamCursor, list[bytes]], consumer: str | None = None) -> None:
        """Record entries to run although at or below the checkpoint, before they are claimed.

        With ``consumer``, also that this consumer's reads count here from now on.
        """
        if not any(marks.values()) and (consumer is None or consumer in self.consumers):
            return
        with self.store.transaction() as tx:
            for cursor, ids in marks.items():
                for entry_id in ids:
                    tx.set(FOREIGN_NAMESPACE, failure_key(cursor.topic, entry_id), b"")
            if consumer is not None:
                tx.set(CONSUMERS_NAMESPACE, consumer, b"")
        for cursor, ids in marks.items():
            cursor.foreign.update(ids)
        if consumer is not None:
            self.consumers.add(consumer)


class CycleResult(msgspec.Struct, kw_only=True):
    """What one cycle did."""

    read: int = 0
    skipped: int = 0
    handled: int = 0
    failed: int = 0
    retried: int = 0
    parked: int = 0
    dead_lettered: int = 0
    lost_entries: int = 0
    lost_partitions: list[int] = msgspec.field(default_factory=list)
    idle: bool = False


class ProcessorHooks:
    """Extension points (metrics, audit); the defaults do nothing. A failing hook is logged.

    Hooks run on the worker's thread. The success path calls them per cycle, partition or stream,
    never per entry, so they stay cheap; only failures are reported entry by entry.
    """

    def on_read(self, entries: int) -> None:
        """A cycle read ``entries`` entries (> 0) over all owned streams."""

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        """A stream's batch is committed and about to be acknowledged.

        ``handled``: entries its handler completed; ``skipped``: entries that needed no handler
        (at or below the checkpoint, or redriven for another app). Also called when the batch
        needed no store write, if it handled or skipped anything.
        """

    def on_commit(self, partition: int, seconds: float) -> None:
        """One store transaction of a partition's batch took ``seconds``."""

    def on_ack(self, seconds: float) -> None:
        """The cycle's acknowledging round trip (acks and DLQ moves) took ``seconds``."""

    def on_failure(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        """An attempt failed: a handler error, an undecodable entry or a poison entry.

        ``on_retry`` follows if it will be tried again; otherwise the entry goes to the DLQ and
        ``on_dead_letter`` is called once the move is acknowledged.
        """

    def on_retry(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        """An entry failed and will be tried again (ordered retry or parked)."""

    def on_dead_letter(self, record: DeadLetter) -> None:
        """An entry was moved to the DLQ."""


class PartitionBatch:
    """The writes of one partition in one batch, on top of the committed state."""

    __slots__ = ("broken", "dead", "decode_state", "failures", "overlay", "owned")

    def __init__(self, owned: OwnedPartition, state_decoder: StateDecoder) -> None:
        self.owned = owned
        self.decode_state = state_decoder.decode
        self.overlay: dict[str, bytes | None] = {}
        self.failures: dict[str, Failure | None] = {}
        self.dead: dict[str, Fields | None] = {}
        #: A store read that failed under a handler: it stops the worker, whatever the handler
        #: did with the exception, and is never an entry's failure.
        self.broken: StateError | None = None

    def base(self, key: str) -> bytes | None:
        """The value of ``key`` as the next entry must see it."""
        overlay = self.overlay
        if key in overlay:
            return overlay[key]
        cache = self.owned.cache
        if key in cache:
            return cache[key]
        try:
            value = self.owned.store.get(STATE_NAMESPACE, key)
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc
        if len(cache) < CACHE_LIMIT:
            cache[key] = value
        return value

    def failure(self, name: str) -> Failure | None:
        if name in self.failures:
            return self.failures[name]
        return self.owned.failures.get(name)


class _Read(NamedTuple):
    """Entries of one stream read in this cycle; ``due`` marks parked entries claimed again."""

    cursor: StreamCursor
    entries: list[RawEntry]
    counts: dict[bytes, int]
    poison: frozenset[bytes] = frozenset()
    due: bool = False
    #: a crash suspect, read with nothing else
    alone: bool = False


class _StreamOutcome(NamedTuple):
    cursor: StreamCursor
    checkpoint: StreamId | None
    ack_ids: list[bytes]
    dead: list[tuple[bytes, Fields]]
    retry_in_s: float | None
    handled: int
    skipped: int


def check_tail(stream: str, last_id: bytes | None, checkpoint: StreamId | None) -> None:
    """Refuse a stream whose last id is below the checkpoint, before anything more is acknowledged.

    Redis gives a new entry an id above the stream's last one: once that is below the checkpoint,
    new entries can land at or below it and would be skipped as done.
    """
    if checkpoint is None or last_id is None or StreamId.parse(last_id) >= checkpoint:
        return
    raise BrokerError(
        f"stream {stream} went back: its last id {last_id.decode()} is below the app's checkpoint "
        f"{checkpoint} (the topic was recreated, or Redis lost writes: a restart without its data, "
        "a fail-over, a restore). Entries added now could get ids at or below the checkpoint and "
        "be skipped as done, so nothing more is acknowledged. If no entry was added since, "
        f"`XSETID {stream} {checkpoint}` moves the stream past the checkpoint; otherwise replay "
        "the app (pspf replay)"
    )


def failure_key(topic: str, entry_id: bytes) -> str:
    return f"{topic}/{entry_id.decode()}"


def _parked(failure: Failure | None) -> bool:
    return failure is not None and failure.due_ms > 0


class BatchProcessor:
    """Runs the cycle for the partitions in ``owned``; the worker adds and removes them."""

    def __init__(
        self,
        app: App,
        broker: Broker,
        consumer: str,
        batch_size: int,
        block_ms: int,
        policies: dict[str, RetryPolicy],
        hooks: ProcessorHooks | None = None,
    ) -> None:
        self.app = app
        self.broker = broker
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.policies = policies
        self.hooks = hooks or ProcessorHooks()
        self.owned: dict[int, OwnedPartition] = {}
        self._by_stream: dict[str, StreamCursor] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- ownership bookkeeping (called by the worker) -----------------------------------------

    def add(self, owned: OwnedPartition) -> None:
        owned.load_bookkeeping()
        self.owned[owned.partition] = owned
        for cursor in owned.streams.values():
            self._by_stream[cursor.stream] = cursor

    def remove(self, partition: int) -> OwnedPartition:
        owned = self.owned.pop(partition)
        for cursor in owned.streams.values():
            self._by_stream.pop(cursor.stream, None)
        return owned

    def cursors(self) -> list[StreamCursor]:
        return list(self._by_stream.values())

    def take_over(self, owned: OwnedPartition) -> None:
        """Start on a partition whose leases are ours: claim every pending entry of its streams.

        An entry pending at a consumer outside the store's history, at or below the checkpoint,
        was never applied here (a foreign consumer of the group took it): it is marked, durably
        and before the claim, so it runs. A store from before the history was kept (checkpoints
        but no history) trusts every consumer, as it did then.
        """
        self.add(owned)
        legacy = not owned.consumers and any(c.checkpoint is not None for c in owned.streams.values())
        marks = {
            cursor: [
                pending.id
                for pending in self.broker.pending_entries(cursor.stream, self.app.name, cursor.checkpoint)
                if pending.consumer not in owned.consumers
            ]
            for cursor in owned.streams.values()
            if cursor.checkpoint is not None and not legacy
        }
        owned.mark_foreign(marks, self.consumer)
        for cursor in owned.streams.values():
            claimed, _ = self.broker.claim_idle(cursor.stream, self.app.name, self.consumer, 0)
            if claimed:
                log.info(
                    "claimed %s pending entries of earlier consumers stream=%s (%s never applied here)",
                    len(claimed),
                    cursor.stream,
                    len(marks.get(cursor, ())),
                )

    def claim_idle(self, min_idle_ms: int) -> None:
        """Take over entries other consumers of the group left idle on the owned streams.

        Takeover claims an earlier owner's entries at once; this periodic pass is the safety net
        for entries another consumer took without holding the lease. Those at or below the
        checkpoint are marked foreign before they are claimed, so they run.
        """
        for owned in self.owned.values():
            for cursor in owned.streams.values():
                idle = [
                    pending
                    for pending in self.broker.pending_entries(
                        cursor.stream, self.app.name, min_idle_ms=min_idle_ms
                    )
                    if pending.consumer != self.consumer
                ]
                if not idle:
                    continue
                checkpoint = cursor.checkpoint
                foreign = [
                    p.id
                    for p in idle
                    if checkpoint is not None
                    and p.consumer not in owned.consumers
                    and StreamId.parse(p.id) <= checkpoint
                ]
                owned.mark_foreign({cursor: foreign})
                claimed = self.broker.claim_ids(
                    cursor.stream, self.app.name, self.consumer, min_idle_ms, [p.id for p in idle]
                )
                log.warning(
                    "claimed %s entries idle over %s ms from other consumers stream=%s; "
                    "they are applied now, out of order",
                    len(claimed),
                    min_idle_ms,
                    cursor.stream,
                )
                cursor.rewind()

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
        reads = self._read(block, result)
        if not any(read.alone for read in reads):
            reads = self._read_due() + reads
        by_partition: dict[int, list[_Read]] = {}
        for read in reads:
            by_partition.setdefault(read.cursor.partition, []).append(read)
            result.read += len(read.entries)
        if result.read:
            self._call_hook(self.hooks.on_read, result.read)
        outcomes: list[tuple[PartitionBatch, list[_StreamOutcome]]] = []
        for partition, partition_reads in by_partition.items():
            batch = PartitionBatch(self.owned[partition], self.app.state_decoder)
            stream_outcomes = [self._handle(batch, read, result) for read in partition_reads]
            self._commit(batch, stream_outcomes)
            outcomes.append((batch, stream_outcomes))
        self._acknowledge(outcomes, result)
        self._advance([o for _, stream_outcomes in outcomes for o in stream_outcomes], reads)
        result.idle = (
            result.read == 0
            and all(c.pending_after is None and c.retry_at == 0.0 for c in self._by_stream.values())
            and not any(_parked(f) for owned in self.owned.values() for f in owned.failures.values())
        )
        return result

    # -- step 1: read -------------------------------------------------------------------------

    def _read(self, block: bool, result: CycleResult) -> list[_Read]:
        now = time.monotonic()
        ready = [c for c in self._by_stream.values() if c.retry_at <= now]
        if not ready:
            self._wait_for_retry(now)
            return []
        windows = {c.stream: self._pending_window(c) for c in ready if c.pending_after is not None}
        for stream, window in windows.items():
            if window and self._unexplained(self._by_stream[stream], window[0]) >= 2:
                # It may have crashed the worker before: it runs alone, nothing else is delivered,
                # so if it crashes again only its own delivery count grows.
                return [
                    r._replace(alone=True) for r in self._claim_pending(self._by_stream[stream], window[:1])
                ]
        out = [
            read
            for stream, window in windows.items()
            for read in self._read_pending(self._by_stream[stream], window)
        ]
        live = [(c.stream, c.lease_key, c.lease_value) for c in ready if c.pending_after is None]
        if live:
            lost, replies, last_ids = self.broker.read_new(
                self.app.name, self.consumer, live, self.batch_size
            )
            for stream in lost:
                self._lease_lost(stream, "the read found the lease taken", result)
            new = [_Read(self._by_stream[s.decode()], entries, {}) for s, entries in replies if entries]
            self._check_tails(new, last_ids)
            out += new
            if block and not out and last_ids:
                self.broker.wait_for_new(last_ids, self.block_ms)
        return out

    def _check_tails(self, new: list[_Read], last_ids: dict[str, bytes]) -> None:
        """Check the streams' last ids against the checkpoints wherever they are at hand.

        New entries at or below the checkpoint mean the group's position went back: the stream's
        last id is looked up then, so that a lost tail is seen before they are skipped as done.
        """
        for stream, last_id in last_ids.items():
            check_tail(stream, last_id, self._by_stream[stream].checkpoint)
        for read in new:
            checkpoint = read.cursor.checkpoint
            if checkpoint is not None and StreamId.parse(read.entries[0][0]) <= checkpoint:
                check_tail(read.cursor.stream, self.broker.last_id(read.cursor.stream), checkpoint)

    def _pending_window(self, cursor: StreamCursor) -> list[tuple[bytes, int]]:
        """The next own pending entries and their delivery counts (XPENDING delivers nothing).

        Parked entries are left out: their count must not grow while they wait.
        """
        assert cursor.pending_after is not None
        window = self.broker.pending_counts(
            cursor.stream, self.app.name, self.consumer, cursor.pending_after, self.batch_size
        )
        if not window:
            cursor.pending_after = None
            return []
        failures = self.owned[cursor.partition].failures
        wanted = [
            (entry_id, delivered)
            for entry_id, delivered in window
            if not (failures and _parked(failures.get(failure_key(cursor.topic, entry_id))))
        ]
        if not wanted:
            cursor.pending_after = StreamId.parse(window[-1][0])
        return wanted

    def _unexplained(self, cursor: StreamCursor, pending: tuple[bytes, int]) -> int:
        """Deliveries of an entry that ended with no recorded outcome: each may have been a crash."""
        entry_id, delivered = pending
        failure = self.owned[cursor.partition].failures.get(failure_key(cursor.topic, entry_id))
        return delivered - (failure.attempts if failure else 0) - cursor.unattempted.get(entry_id, 0)

    def _read_pending(self, cursor: StreamCursor, window: list[tuple[bytes, int]]) -> list[_Read]:
        """Re-deliver the next pending entries, stopping before any that may have crashed us."""
        if not window:
            return []
        suspect = [i for i, pending in enumerate(window) if self._unexplained(cursor, pending) >= 2]
        take = 1 if cursor.isolate else (suspect[0] if suspect else len(window))
        return self._claim_pending(cursor, window[:take])

    def _claim_pending(self, cursor: StreamCursor, window: list[tuple[bytes, int]]) -> list[_Read]:
        ids = [entry_id for entry_id, _ in window]
        claimed = dict(self.broker.claim_entries(cursor.stream, self.app.name, self.consumer, ids))
        entries: list[RawEntry] = [(entry_id, claimed.get(entry_id)) for entry_id in ids]
        counts = {entry_id: delivered + 1 for entry_id, delivered in window}
        return [_Read(cursor, entries, counts, self._poison(cursor, counts))]

    def _poison(self, cursor: StreamCursor, counts: dict[bytes, int]) -> frozenset[bytes]:
        """Entries delivered more than ``max_deliveries`` times with no recorded outcome."""
        limit = self.policies[cursor.topic].max_deliveries or 1
        return frozenset(e for e, n in counts.items() if self._unexplained(cursor, (e, n)) > limit)

    def _read_due(self) -> list[_Read]:
        """Claim parked entries whose retry is due (XCLAIM counts it as a delivery)."""
        now_ms = int(time.time() * 1000)
        out = []
        for owned in self.owned.values():
            if not owned.failures:
                continue
            for cursor in owned.streams.values():
                prefix = f"{cursor.topic}/"
                due = [
                    name[len(prefix) :].encode()
                    for name, failure in owned.failures.items()
                    if failure.due_ms and failure.due_ms <= now_ms and name.startswith(prefix)
                ][: self.batch_size]
                if not due:
                    continue
                entries = self.broker.claim_entries(cursor.stream, self.app.name, self.consumer, due)
                gone = set(due) - {entry_id for entry_id, _ in entries}
                for entry_id in gone:
                    log.warning(
                        "parked entry deleted from its stream, lost stream=%s id=%s", cursor.stream, entry_id
                    )
                    owned.failures.pop(failure_key(cursor.topic, entry_id), None)
                    with owned.store.transaction() as tx:
                        tx.delete(FAILURES_NAMESPACE, failure_key(cursor.topic, entry_id))
                if entries:
                    counts = self.broker.delivery_counts(
                        cursor.stream, self.app.name, [entry_id for entry_id, _ in entries]
                    )
                    out.append(_Read(cursor, entries, counts, self._poison(cursor, counts), due=True))
        return out

    def _wait_for_retry(self, now: float) -> None:
        """Sleep until the first stream may retry, but no longer than one read would block."""
        if not self._by_stream:
            time.sleep(self.block_ms / 1000)
            return
        first = min(c.retry_at for c in self._by_stream.values())
        time.sleep(max(0.0, min(first - now, self.block_ms / 1000)))

    # -- steps 2-4: skip, decode, handle ------------------------------------------------------

    def _handle(self, batch: PartitionBatch, read: _Read, result: CycleResult) -> _StreamOutcome:
        cursor = read.cursor
        policy = self.policies[cursor.topic]
        done_ids: list[bytes] = []
        dead: list[tuple[bytes, Fields]] = []
        skipped_before = result.skipped
        todo = self._screen(batch, read, done_ids, dead, result)
        skipped = result.skipped - skipped_before  # not the lost entries, also in done_ids
        decisions: dict[int, tuple[Outcome, Failure]] = {}
        ran, errors = self._run(batch, read, todo, decisions)
        owned = batch.owned
        retry_in_s = None
        if not errors:  # the common case, kept free of per-entry bookkeeping
            ids = [id_b for id_b, _ in (todo if ran == len(todo) else todo[:ran])]
            done_ids += ids
            handled = ran
            last_done = ids[-1] if ids else None
            if owned.failures:
                for id_b in ids:
                    name = failure_key(cursor.topic, id_b)
                    if batch.failure(name) is not None:
                        batch.failures[name] = None
        else:
            handled, last_done, retry_in_s = self._settle(
                batch, cursor, policy, todo[:ran], errors, decisions, dead, done_ids, result
            )
        for id_b, _ in todo[ran:]:  # delivered, not attempted: it did not crash us
            cursor.unattempted[id_b] = cursor.unattempted.get(id_b, 0) + 1
        result.handled += handled
        checkpoint = None if read.due or last_done is None else StreamId.parse(last_done)
        if checkpoint is not None and cursor.checkpoint is not None and checkpoint <= cursor.checkpoint:
            checkpoint = None  # only entries taken from other consumers, below the checkpoint
        return _StreamOutcome(cursor, checkpoint, done_ids, dead, retry_in_s, handled, skipped)

    def _run(
        self,
        batch: PartitionBatch,
        read: _Read,
        todo: list[Entry],
        decisions: dict[int, tuple[Outcome, Failure]],
    ) -> tuple[int, dict[int, BaseException]]:
        """Run the handler over ``todo``; how many ran, their errors, and each failure's outcome.

        A store that failed under a handler stops here, whatever the handler did with its error.
        """
        cursor = read.cursor
        handler = self.app.handlers[cursor.topic]
        policy = self.policies[cursor.topic]
        meta = EntryMeta(cursor.topic, cursor.partition, read.counts, read.poison, policy.max_deliveries or 1)

        def stop(index: int, exc: BaseException) -> bool:
            if batch.broken is not None:
                raise batch.broken
            decisions[index] = self._decide(batch, cursor, handler, policy, todo[index][0], exc, read.due)
            return decisions[index][0] is Outcome.RETRY

        if handler.is_async:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            ran, errors, states = run_async(self._loop, handler, meta, todo, batch, stop)
            for index in sorted(states):
                key, new = states[index]
                if index < ran and new is not UNCHANGED:
                    batch.overlay[key] = new
        else:
            ran, errors = run_sync(handler, meta, todo, batch.overlay, batch, stop)
        if batch.broken is not None:
            raise batch.broken
        return ran, errors

    def _settle(
        self,
        batch: PartitionBatch,
        cursor: StreamCursor,
        policy: RetryPolicy,
        ran: list[Entry],
        errors: dict[int, BaseException],
        decisions: dict[int, tuple[Outcome, Failure]],
        dead: list[tuple[bytes, Fields]],
        done_ids: list[bytes],
        result: CycleResult,
    ) -> tuple[int, bytes | None, float | None]:
        """Apply each entry's outcome when some failed; (handled, last done id, retry delay)."""
        handled = 0
        last_done: bytes | None = None
        for index, (id_b, fields) in enumerate(ran):
            name = failure_key(cursor.topic, id_b)
            if index not in errors:
                if batch.failure(name) is not None:
                    batch.failures[name] = None
                done_ids.append(id_b)
                handled += 1
                last_done = id_b
                continue
            outcome, failure = decisions[index]
            result.failed += 1
            self._call_hook(self.hooks.on_failure, cursor.topic, cursor.partition, id_b.decode(), failure)
            if outcome is not Outcome.DEAD:
                batch.failures[name] = failure
                self._call_hook(self.hooks.on_retry, cursor.topic, cursor.partition, id_b.decode(), failure)
            if outcome is Outcome.RETRY:
                result.retried += 1
                return handled, last_done, policy.delay_s(failure.attempts)
            if outcome is Outcome.PARKED:
                result.parked += 1
            else:
                dlq_fields = self._dead_letter(cursor, id_b, fields, failure).to_fields()
                batch.failures[name] = None
                batch.dead[name] = dlq_fields
                dead.append((id_b, dlq_fields))
            last_done = id_b
        return handled, last_done, None

    def _screen(
        self,
        batch: PartitionBatch,
        read: _Read,
        done_ids: list[bytes],
        dead: list[tuple[bytes, Fields]],
        result: CycleResult,
    ) -> list[Entry]:
        """Sort out entries that need no handler; return the ones that do, in id order."""
        cursor, entries, owned = read.cursor, read.entries, batch.owned
        forced: list[RawEntry] = []
        start = 0
        checkpoint = cursor.checkpoint
        # Ids in a reply ascend, so the entries at or below the checkpoint are a prefix.
        if checkpoint is not None and not read.due:
            while start < len(entries) and StreamId.parse(entries[start][0]) <= checkpoint:
                id_b, fields = entries[start]
                start += 1
                if id_b in cursor.foreign:
                    forced.append((id_b, fields))
                    continue
                if owned.dead or owned.failures:
                    name = failure_key(cursor.topic, id_b)
                    if name in owned.dead:
                        dead.append((id_b, owned.dead[name]))  # decided before a crash: move it now
                        continue
                    if _parked(owned.failures.get(name)):
                        continue  # stays pending until it is due
                done_ids.append(id_b)
                result.skipped += 1
        rest = entries[start:]
        if not forced and all(fields is not None and codec.HEADERS not in fields for _, fields in rest):
            return rest  # type: ignore[return-value]
        todo: list[Entry] = []
        for id_b, fields in forced + rest:
            if fields is None:
                log.warning(
                    "entry deleted while pending, lost before processing topic=%s partition=%s id=%s",
                    cursor.topic,
                    cursor.partition,
                    id_b.decode(),
                )
                done_ids.append(id_b)
                result.lost_entries += 1
            elif codec.HEADERS in fields and not self._meant_for_us(fields[codec.HEADERS]):
                done_ids.append(id_b)
                result.skipped += 1
            else:
                todo.append((id_b, fields))
        return todo

    def _meant_for_us(self, headers: bytes) -> bool:
        """False for an entry a redrive sent back for another app reading the same topic."""
        if REDRIVE_APP_HEADER.encode() not in headers:
            return True
        try:
            target = codec.decode_headers(headers).get(REDRIVE_APP_HEADER)
        except Exception:
            return True
        return target is None or target == self.app.name

    def _decide(
        self,
        batch: PartitionBatch,
        cursor: StreamCursor,
        handler: Handler,
        policy: RetryPolicy,
        id_b: bytes,
        exc: BaseException,
        due: bool,
    ) -> tuple[Outcome, Failure]:
        failure = record_failure(exc, batch.failure(failure_key(cursor.topic, id_b)))
        log.warning(
            "entry failed topic=%s partition=%s id=%s attempt=%s error=%s: %s",
            cursor.topic,
            cursor.partition,
            id_b.decode(),
            failure.attempts,
            failure.error_type,
            failure.message,
        )
        if classify(exc, handler.non_retryable) or failure.attempts >= (policy.max_retries or 1):
            return Outcome.DEAD, failure
        if policy.mode == "deferred" or due:
            due_ms = int(time.time() * 1000 + policy.delay_s(failure.attempts) * 1000) or 1
            return Outcome.PARKED, msgspec.structs.replace(failure, due_ms=due_ms)
        return Outcome.RETRY, failure

    def _dead_letter(self, cursor: StreamCursor, id_b: bytes, fields: Fields, failure: Failure) -> DeadLetter:
        return DeadLetter(
            source_topic=cursor.topic,
            source_partition=cursor.partition,
            source_id=id_b.decode(),
            app=self.app.name,
            consumer=self.consumer,
            original=fields,
            error_type=failure.error_type,
            message=failure.message,
            traceback=failure.traceback,
            attempts=failure.attempts,
            first_failed_ms=failure.first_failed_ms,
            last_failed_ms=failure.last_failed_ms,
        )

    # -- step 5: commit -----------------------------------------------------------------------

    def _commit(self, batch: PartitionBatch, outcomes: list[_StreamOutcome]) -> None:
        checkpoints = {o.cursor.topic: o.checkpoint for o in outcomes if o.checkpoint is not None}
        foreign_done = [
            failure_key(o.cursor.topic, entry_id)
            for o in outcomes
            if o.cursor.foreign
            for entry_id in [*o.ack_ids, *(entry_id for entry_id, _ in o.dead)]
            if entry_id in o.cursor.foreign
        ]
        if not (checkpoints or batch.overlay or batch.failures or batch.dead or foreign_done):
            for o in outcomes:  # nothing to write, but entries were done: report them all the same
                if o.handled or o.skipped:
                    c = o.cursor
                    self._call_hook(self.hooks.on_batch_committed, c.topic, c.partition, o.handled, o.skipped)
            return
        owned = batch.owned
        started = time.perf_counter()
        with owned.store.transaction() as tx:
            _put(tx, STATE_NAMESPACE, batch.overlay)
            _put(tx, FAILURES_NAMESPACE, {n: _encode(f) for n, f in batch.failures.items()})
            _put(tx, DEAD_NAMESPACE, {n: _encode(f) for n, f in batch.dead.items()})
            for name in foreign_done:
                tx.delete(FOREIGN_NAMESPACE, name)
            for topic, entry_id in checkpoints.items():
                tx.set_checkpoint(topic, entry_id)
        self._call_hook(self.hooks.on_commit, owned.partition, time.perf_counter() - started)
        if len(owned.cache) + len(batch.overlay) > CACHE_LIMIT:
            owned.cache.clear()
        owned.cache.update(batch.overlay)
        for name, failure in batch.failures.items():
            if failure is None:
                owned.failures.pop(name, None)
            else:
                owned.failures[name] = failure
        owned.dead.update((name, fields) for name, fields in batch.dead.items() if fields is not None)
        for o in outcomes:
            if o.checkpoint is not None:
                o.cursor.checkpoint = o.checkpoint
            self._call_hook(
                self.hooks.on_batch_committed, o.cursor.topic, o.cursor.partition, o.handled, o.skipped
            )

    # -- step 6: acknowledge ------------------------------------------------------------------

    def _acknowledge(
        self, outcomes: list[tuple[PartitionBatch, list[_StreamOutcome]]], result: CycleResult
    ) -> None:
        merged: dict[str, tuple[PartitionBatch, list[bytes], list[tuple[bytes, Fields]]]] = {}
        for batch, stream_outcomes in outcomes:
            for o in stream_outcomes:
                _, ids, dead = merged.setdefault(o.cursor.stream, (batch, [], []))
                ids += o.ack_ids
                dead += o.dead
        requests = []
        for stream, (_, ids, dead) in merged.items():
            if ids or dead:
                c = self._by_stream[stream]
                requests.append(
                    AckRequest(stream, self.app.name, c.lease_key, c.lease_value, ids, c.dlq, dead)
                )
        if not requests:
            return
        started = time.perf_counter()
        replies = self.broker.ack(requests)
        self._call_hook(self.hooks.on_ack, time.perf_counter() - started)
        for request, reply in zip(requests, replies, strict=True):
            if isinstance(reply, LeaseLost):
                self._lease_lost(request.stream, str(reply), result)
            elif request.dead:
                result.dead_lettered += reply[1]
                self._forget_dead(merged[request.stream][0].owned, request)

    def _forget_dead(self, owned: OwnedPartition, request: AckRequest) -> None:
        """The DLQ moves are confirmed: drop their records (a crash first only repeats a no-op)."""
        topic = self._by_stream[request.stream].topic
        with owned.store.transaction() as tx:
            for entry_id, fields in request.dead:
                tx.delete(DEAD_NAMESPACE, failure_key(topic, entry_id))
                owned.dead.pop(failure_key(topic, entry_id), None)
                log.error(
                    "entry moved to the DLQ topic=%s partition=%s id=%s error=%s",
                    topic,
                    owned.partition,
                    entry_id.decode(),
                    fields.get(b"error_type", b"").decode(),
                )
                self._call_hook(self.hooks.on_dead_letter, DeadLetter.from_fields(fields))

    def _lease_lost(self, stream: str, reason: str, result: CycleResult) -> None:
        partition = self._by_stream[stream].partition
        log.warning("lease lost, giving the partition up stream=%s: %s", stream, reason)
        if partition not in result.lost_partitions:
            result.lost_partitions.append(partition)

    def _advance(self, outcomes: list[_StreamOutcome], reads: list[_Read]) -> None:
        """Move each stream's read position: past what it read, or back to its pending entries."""
        last_read = {r.cursor.stream: StreamId.parse(r.entries[-1][0]) for r in reads if not r.due}
        for o in outcomes:
            cursor = o.cursor
            if cursor.unattempted or cursor.foreign:
                for entry_id in [*o.ack_ids, *(entry_id for entry_id, _ in o.dead)]:
                    cursor.unattempted.pop(entry_id, None)
                    cursor.foreign.discard(entry_id)
            if cursor.stream not in last_read:
                continue  # only parked entries were tried
            if o.retry_in_s is not None:
                cursor.rewind()
                cursor.isolate = True
                cursor.retry_at = time.monotonic() + o.retry_in_s
            else:
                cursor.isolate = False
                cursor.retry_at = 0.0
                if cursor.pending_after is not None:
                    cursor.pending_after = last_read[cursor.stream]

    @staticmethod
    def _call_hook(hook: Any, *args: Any) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("a processor hook failed: %s", getattr(hook, "__qualname__", hook))


def _encode(value: Any) -> bytes | None:
    return None if value is None else msgspec.msgpack.encode(value)


def _put(tx: StoreTransaction, namespace: str, values: dict[str, bytes | None]) -> None:
    for key, value in values.items():
        if value is None:
            tx.delete(namespace, key)
        else:
            tx.set(namespace, key, value)


def iter_state(store: StateStore, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every key's decoded state in one store, in key order."""
    for key, raw in store.items(STATE_NAMESPACE, prefix):
        yield key, codec.state_decoder.decode(raw)
