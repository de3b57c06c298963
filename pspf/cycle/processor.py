"""The batch processor: exactly-once effects on state from at-least-once stream delivery.

One cycle (``BatchProcessor.run_once``) over the partitions this worker owns; each step names
the module that holds it:

1. read (``delivery``): one XREADGROUP over the owned streams, in a MULTI/EXEC that WATCHes their
   leases, so a worker that lost a lease takes nothing more from it. A stream that must first
   re-read its own pending entries reads them from its pending list, one at a time while their
   delivery counts say an earlier attempt may have crashed the worker; parked entries that are
   due are claimed again;
2. skip done work (``delivery``): an entry at or below its stream's checkpoint was applied before
   a crash; it is acknowledged without running the handler (or, if it was judged dead, moved to
   the DLQ), unless a foreign consumer took it;
3. decode and 4. handle (``attempts``, running ``execution``): the handler runs with a
   ``Context``; an entry's state writes join the batch only if its handler returns. A failure is
   retried (ordered mode: the stream waits), parked (deferred mode: the stream goes on) or
   dead-lettered (``failures`` decides);
5. commit (``batch.Durability``): ONE store transaction per partition holds the state writes,
   the new checkpoints, the outbox rows of what the handlers emitted and the retry bookkeeping
   (attempts, parked entries, dead-letter decisions), and what time did in the batch
   (``timekeeping``: windows stream time closed, scheduled callbacks, expired state);
6. acknowledge (``batch.Durability``, through ``Acknowledging.ack``): ONE atomic call acknowledges
   every stream's batch, updates the partitions' state backups and moves dead entries to the
   DLQ, under the leases (a MULTI/EXEC with the leases WATCHed, or a Lua call per stream that
   checks its lease token); it happens only after step 5 returned; then the outbox rows of the
   partitions whose call succeeded may be published;
7. publish (``relay``): the relay publishes the rows whose acknowledgement succeeded, each at
   most once on its target; acknowledging never waits for it. The views' writes whose
   acknowledgement succeeded go to Redis in one round trip (``pspf.outbox.views``).

After the cycle, ``timekeeping`` runs what the clock calls for (timers, windows of idle
partitions, expiry) into a batch of no entries per partition, which ``batch.Durability`` commits
and sends to the backup (``commit_alone``) before its emits are published.

Invariants kept here: nothing is acknowledged before the commit that holds its effects; a stream
is applied in id order by one owner, and an owner works through its own pending entries before it
reads new ones, so no entry at or below a checkpoint is ever still unapplied (parked and dead
entries at or below it are recorded in the store and stay pending until they are dealt with;
entries a foreign consumer took are marked in the store before they are claimed). A store that
fails stops the worker: it is never an entry's failure.
"""

from __future__ import annotations

import logging
import time

import msgspec

from pspf import keys
from pspf.app import App
from pspf.broker import Broker
from pspf.contracts.registry import topic_checks
from pspf.cycle.attempts import Attempts
from pspf.cycle.delivery import Delivery
from pspf.cycle.ordering import empty_outcome, hold_runs, id_order_runs, joined
from pspf.cycle.timekeeping import TimeKeeping
from pspf.errors import BrokerError, BrokerUnavailable, LeaseLost
from pspf.failures import RetryPolicy
from pspf.hooks import CycleResult, ProcessorHooks, call_hook
from pspf.observability.tracing import configured
from pspf.outbox.emit import Emitter
from pspf.outbox.relay import Relay
from pspf.outbox.rows import RowState
from pspf.outbox.views import PartitionViews
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.durability import Acknowledged, Durability, flush
from pspf.partition.owned import CACHE_LIMIT, MIN_CACHE_SHARE, OwnedPartition, Read, StreamCursor
from pspf.settings import OutboxSettings
from pspf.tables.global_tables import GlobalTables
from pspf.tables.lookups import Lookups

log = logging.getLogger("pspf.processor")


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
        outbox: OutboxSettings | None = None,
        idle_close_s: float = 30.0,
        linger_ms: int = 0,
    ) -> None:
        self.app = app
        self.broker = broker
        self.consumer = consumer
        self.policies = policies
        self.hooks = hooks or ProcessorHooks()
        self.emitter = Emitter(broker.topics, app.name, lambda topic: topic_checks(broker, topic).current)
        self.relay = Relay(broker.publishing, consumer, outbox or OutboxSettings(), self.emitter, self.hooks)
        self.owned: dict[int, OwnedPartition] = {}
        self._by_stream: dict[str, StreamCursor] = {}
        if app.timers:  # a read waits no longer than a timer period (one it overruns runs late)
            block_ms = max(1, min([block_ms, *(t.every_ms for t in app.timers)]))
        self.delivery = Delivery(
            broker.reading,
            broker.topics,
            app.name,
            consumer,
            batch_size,
            block_ms,
            policies,
            self.owned,
            self._by_stream,
            frozenset(app.tables),
            ordered=app.dataflow.ordered,
            linger_ms=linger_ms,
        )
        self.time = TimeKeeping(app, self.emitter, self.hooks, idle_close_s)
        # Decided once: after the app's code and any ``opentelemetry-instrument`` set-up ran.
        tracing = configured(app.name)
        self.attempts = Attempts(app, consumer, self.emitter, policies, tracing)
        self.durability = Durability(broker.acks, app.name, self.hooks, tracing, sends=broker.acks)
        #: the app's tables, once the worker knows the partition count (``start_tables``)
        self.lookups: Lookups | None = None

    def start_tables(self, partitions: int, global_tables: GlobalTables | None) -> None:
        """Look tables up from now on; the global tables are read to their ends first."""
        if global_tables is not None:
            global_tables.bootstrap()
        if self.app.tables or global_tables is not None:
            tables = {**self.app.tables, **self.app.global_tables}
            self.lookups = Lookups(tables, partitions, global_tables)
            self.time.lookups = self.lookups

    # -- ownership bookkeeping (called by the worker) -----------------------------------------

    def add(self, owned: OwnedPartition) -> None:
        """Process a partition taken on (``ownership.Partitions.take``) from the next cycle on."""
        self.time.load(owned)
        if self.app.views:  # what the store committed and Redis may not have: written again
            owned.views = PartitionViews.load(self.app.views, owned.store.items(keys.VIEWS_NAMESPACE))
        self.relay.follow_layouts(owned.outbox)  # rows from before a repartition of their target
        self.owned[owned.partition] = owned
        for cursor in owned.streams.values():
            self._by_stream[cursor.stream] = cursor
        self._share_cache()

    def remove(self, partition: int, held: bool = False) -> OwnedPartition:
        """Stop processing a partition; ``held``: its lease is still ours (a hand-over, the end).

        Then its acknowledged view writes are written first; a lost partition's are left to its
        next owner, which writes them from the store (a late write could undo its newer ones).
        """
        owned = self.owned.pop(partition)
        self.relay.finish(owned.outbox)
        self._finish_views(owned, held)
        for cursor in owned.streams.values():
            self._by_stream.pop(cursor.stream, None)
        self._share_cache()
        return owned

    def _finish_views(self, owned: OwnedPartition, held: bool) -> None:
        """Read the view writes in flight; ``held``: send the acknowledged ones first, and read them."""
        views = owned.views
        if views is None:
            return
        try:
            if held:
                views.send(self.broker.publishing.send_views)
            views.settle()
        except BrokerError as exc:
            views.abandon()
            log.warning("view writes of partition %s left to its next owner: %s", owned.partition, exc)

    def _share_cache(self) -> None:
        """Each owned partition's share of the worker's cache of committed values."""
        limit = max(MIN_CACHE_SHARE, CACHE_LIMIT // max(1, len(self.owned)))
        for owned in self.owned.values():
            owned.cache_limit = limit

    def cursors(self) -> list[StreamCursor]:
        return list(self._by_stream.values())

    def rewind_all(self) -> None:
        """After a lost connection nothing read is trusted: re-read every own pending entry."""
        self.delivery.close()
        self.durability.abandon()
        for owned in self.owned.values():
            owned.rewind()

    def settle(self) -> CycleResult:
        """Read the acknowledgement still in flight; what it came to (the partitions it lost).

        Before anything else is sent for the owned partitions outside a cycle: a lease round's
        hand-overs and claims, the end.
        """
        result = CycleResult()
        self._settled(self.durability.settle(), result)
        return result

    def close(self) -> None:
        self.durability.abandon()
        self.delivery.close()
        for owned in self.owned.values():
            self.relay.finish(owned.outbox)
            self._finish_views(owned, held=False)
        self.attempts.close()
        if self.lookups is not None and self.lookups.global_tables is not None:
            self.lookups.global_tables.close()

    # -- the cycle ------------------------------------------------------------------------------

    def run_once(self, block: bool = True, block_ms: int | None = None) -> CycleResult:
        """One cycle: read, skip done, decode, handle, commit, acknowledge.

        With ``block`` the read waits up to ``block_ms`` for new entries (the processor's, or
        less when given: the worker's next lease round); without, it only looks.
        """
        result = CycleResult()
        if not self.delivery.reading_ahead:  # this read may wait: nothing to overlap the reply with
            self._settled(self.durability.settle(), result)
        reads = self._read(block, block_ms, result)
        by_partition: dict[int, list[Read]] = {}
        for read in reads:
            by_partition.setdefault(read.cursor.partition, []).append(read)
            result.read += len(read.entries)
        if result.read:
            call_hook(self.hooks.on_read, result.read)
        outcomes = [
            done
            for partition, partition_reads in by_partition.items()
            if (done := self._apply(partition, partition_reads, result)) is not None
        ]
        self._acknowledge(outcomes, result)
        self._publish(result)
        if result.read == 0:
            self._settle_sent(result)
        self.delivery.advance(
            [
                (o.cursor, o.finished, o.retry_in_s)
                for _, stream_outcomes in outcomes
                for o in stream_outcomes
            ],
            reads,
        )
        result.idle = (
            result.read == 0
            and not result.lost_partitions  # taken again by the next lease round, or handed over
            and all(c.pending_after is None and c.retry_at == 0.0 for c in self._by_stream.values())
            and not any(owned.has_parked for owned in self.owned.values())
            and not any(owned.outbox.waiting for owned in self.owned.values())
            and not any(owned.views is not None and owned.views.busy for owned in self.owned.values())
            and not self.delivery.lingering
        )
        for batch in self.time.passes(list(self.owned.values()), set(by_partition), result):
            self._settled(self.durability.settle(), result)
            self._given_up(self.durability.commit_alone(batch), result)
        if result.read == 0:  # no acknowledgement carries the relay's writes to the backups
            self._settled(self.durability.settle(), result)
            for owned in self.owned.values():
                if owned.backup is not None:
                    self._given_up(flush(owned), result)
        return result

    def _apply(
        self, partition: int, partition_reads: list[Read], result: CycleResult
    ) -> tuple[PartitionBatch, list[StreamOutcome]] | None:
        """Steps 2-5 for one partition: its batch handled and committed; None when it was lost."""
        batch = PartitionBatch(self.owned[partition], self.app.state_decoder, self.emitter, self.lookups)
        if self.app.dataflow.ordered:
            stream_outcomes = self._handle_in_id_order(batch, partition_reads, result)
        else:
            stream_outcomes = [self._handle(batch, read, result) for read in partition_reads]
        if self.delivery.order is not None:
            stream_outcomes, taken = self.delivery.order.stop_tables(
                partition_reads, stream_outcomes, batch.table_writes
            )
            result.handled -= taken
        if batch.owned.keeps_time:
            self.time.advance(batch, result)
        self._settled(self.durability.settle(), result)  # no commit after a refused acknowledgement
        if partition in result.lost_partitions:
            return None  # its entries stay pending, for the partition's next owner
        try:
            self.durability.commit(batch, stream_outcomes)
        except BrokerUnavailable:
            _outcomes_lost(partition_reads)
            raise
        return batch, stream_outcomes

    def _read(self, block: bool, block_ms: int | None, result: CycleResult) -> list[Read]:
        """Step 1: what the global tables have new, then the owned streams' entries to apply now."""
        lookups = self.lookups
        if lookups is not None and lookups.global_tables is not None:
            lookups.global_tables.follow_between()
        reads, lost = self.delivery.read(block, block_ms)
        for stream in lost:
            self._lease_lost(stream, LeaseLost("the read found the lease taken"), result)
        if not any(read.alone for read in reads):
            reads = self.delivery.read_due() + reads
        if self.delivery.order is not None:
            reads = self.delivery.order.hold_back(reads, set(self.app.tables))
        return reads

    def apply_outbox_replays(self) -> None:
        """Apply operators' outbox replay requests for the owned partitions (``pspf outbox replay``)."""
        requests = self.broker.requests.outbox_replay_requests(self.app.name, sorted(self.owned))
        for partition, raw in requests.items():
            owned = self.owned[partition]
            try:
                ids = msgspec.json.decode(raw, type=list[int])
            except msgspec.DecodeError:
                log.error("unreadable outbox replay request dropped partition=%s: %r", partition, raw[:100])
                ids = []
            replayed = owned.outbox.replay(ids)
            refused = flush(owned)
            if refused is not None:  # the next lease round gives the partition up
                log.warning("outbox replay partition=%s not confirmed: %s", partition, refused[1])
                continue
            outcome = {"requested": ids, "replayed": replayed, "at_ms": int(time.time() * 1000)}
            self.broker.requests.finish_outbox_replay(
                self.app.name, partition, raw, msgspec.json.encode(outcome)
            )
            log.info(
                "outbox replay partition=%s: %s of %s requested rows back to pending",
                partition,
                len(replayed),
                len(ids),
            )

    # -- step 7: publish ----------------------------------------------------------------------

    def _publish(self, result: CycleResult) -> None:
        """Publish what the owned partitions emitted, write their views (what was acknowledged)."""
        for owned in self.owned.values():
            if owned.views is not None:
                owned.views.send(self.broker.publishing.send_views)
            if owned.outbox.waiting or owned.outbox.counts[RowState.PUBLISHED]:
                self._relayed(owned, self.relay.step(owned.outbox), result)

    def _settle_sent(self, result: CycleResult) -> None:
        """Read the replies of what ``_publish`` sent at once.

        A cycle that read nothing has nothing to overlap them with, and a run until idle then
        sees them done in this cycle instead of polling again later.
        """
        for owned in self.owned.values():
            if owned.views is not None:
                owned.views.settle()
            if owned.outbox.sending is not None:
                self._relayed(owned, self.relay.settle(owned.outbox), result)

    def _relayed(self, owned: OwnedPartition, counts: tuple[int, int], result: CycleResult) -> None:
        """What a relay step (or settle) published and failed counted, the outbox's rows reported."""
        result.published += counts[0]
        result.publish_failed += counts[1]
        call_hook(self.hooks.on_outbox_rows, owned.partition, owned.outbox.counts)

    # -- steps 2-4: skip, decode, handle ------------------------------------------------------

    def _handle_in_id_order(
        self, batch: PartitionBatch, reads: list[Read], result: CycleResult
    ) -> list[StreamOutcome]:
        """A partition's entries in id order across its streams (``ordering.id_order_runs``).

        An entry that stops its stream to be retried stops the batch there: what comes after it
        in id order waits (``hold_runs``). One outcome per read, aligned with ``reads``.
        """
        runs = id_order_runs(reads, frozenset(self.app.tables))
        ordered = [(i, run) for i, run in runs if not run.due]
        outcomes: dict[int, StreamOutcome] = {}
        for index, (of_read, run) in enumerate(ordered):
            outcome = self._handle(batch, run, result)
            outcomes[of_read] = joined(outcomes.get(of_read), outcome)
            if outcome.retry_id is not None:
                hold_runs(ordered[index + 1 :], run.cursor)
                break
        for of_read, run in runs:
            if run.due:  # parked entries claimed again (deferred mode): they keep no order
                outcomes[of_read] = self._handle(batch, run, result)
        return [outcomes.get(i) or empty_outcome(read.cursor) for i, read in enumerate(reads)]

    def _handle(self, batch: PartitionBatch, read: Read, result: CycleResult) -> StreamOutcome:
        cursor = read.cursor
        screened = self.delivery.screen(batch.owned, read)
        todo = screened.todo
        result.skipped += screened.skipped
        result.lost_entries += screened.lost
        passed = self.time.clock(batch, cursor.topic, result)
        batch.prefetch(todo)
        attempted = self.attempts.run(batch, read, todo, passed)
        attempted.report(result, self.hooks, cursor.topic, cursor.partition)
        for id_b, _ in todo[attempted.ran :]:  # delivered, not attempted: it did not crash us
            cursor.unattempted[id_b] = cursor.unattempted.get(id_b, 0) + 1
        self.time.entries_done(batch, cursor.topic, todo[: attempted.ran], attempted.last_done)
        return attempted.outcome(read, screened.done_ids, screened.dead, screened.skipped)

    # -- step 6: acknowledge ------------------------------------------------------------------

    def _acknowledge(
        self, outcomes: list[tuple[PartitionBatch, list[StreamOutcome]]], result: CycleResult
    ) -> None:
        self._settled(self.durability.acknowledge(outcomes), result)
        if not self.delivery.reading_ahead:  # no next batch on its way to overlap the reply with
            self._settled(self.durability.settle(), result)

    def _settled(self, acked: Acknowledged, result: CycleResult) -> None:
        result.dead_lettered += acked.dead_lettered
        for stream, exc in acked.lost.values():
            self._lease_lost(stream, exc, result)

    def _given_up(self, refused: tuple[str, LeaseLost] | None, result: CycleResult) -> None:
        if refused is not None:
            self._lease_lost(*refused, result)

    def _lease_lost(self, stream: str, exc: LeaseLost, result: CycleResult) -> None:
        """Give the partition up, logged as what refused it (a lost lease, a backup that went back)."""
        cursor = self._by_stream.get(stream)
        if cursor is None:  # given up already (an acknowledgement read after its partition went)
            log.info("%s after the partition was given up stream=%s: %s", exc.what, stream, exc)
            return
        partition = cursor.partition
        log.warning("%s, giving the partition up stream=%s: %s", exc.what, stream, exc)
        if partition not in result.lost_partitions:
            result.lost_partitions.append(partition)


def _outcomes_lost(reads: list[Read]) -> None:
    """Count a failed commit's deliveries as unattempted: their outcomes were lost, not crashed on.

    A sink's database that is out writes nothing; reading the entries again, as often as it
    stays out, must make no entry look poison.
    """
    for read in reads:
        unattempted = read.cursor.unattempted
        for entry_id, _ in read.entries:
            unattempted[entry_id] = unattempted.get(entry_id, 0) + 1
