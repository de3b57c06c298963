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
3. decode and 4. handle (``execution``): the handler runs with a ``Context``; an entry's state
   writes join the batch only if its handler returns. A failure is retried (ordered mode: the
   stream waits), parked (deferred mode: the stream goes on) or dead-lettered (``failures``);
5. commit (``batch``): ONE store transaction per partition holds the state writes, the new
   checkpoints, the outbox rows of what the handlers emitted and the retry bookkeeping
   (attempts, parked entries, dead-letter decisions), and what time did in the batch
   (``timekeeping``: windows stream time closed, scheduled callbacks, expired state);
6. acknowledge (here, through ``Broker.ack``): ONE atomic call acknowledges every stream's batch,
   updates the partitions' state backups and moves dead entries to the DLQ, under the leases
   (a MULTI/EXEC with the leases WATCHed, or a Lua call per stream that checks its lease token);
   it happens only after step 5 returned;
7. publish (``relay``): the relay publishes the rows whose acknowledgement succeeded, each at
   most once on its target; acknowledging never waits for it.

After the cycle, ``timekeeping`` runs what the clock calls for (timers, windows of idle
partitions, expiry), each partition's committed and backed up like a batch of no entries.

Invariants kept here: nothing is acknowledged before the commit that holds its effects; a stream
is applied in id order by one owner, and an owner works through its own pending entries before it
reads new ones, so no entry at or below a checkpoint is ever still unapplied (parked and dead
entries at or below it are recorded in the store and stay pending until they are dealt with;
entries a foreign consumer took are marked in the store before they are claimed). A store that
fails stops the worker: it is never an entry's failure.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from pspf import keys
from pspf.app import App
from pspf.batch import PartitionBatch, StreamOutcome
from pspf.broker import AckRequest, Broker, Fields
from pspf.delivery import Delivery, Read, parked
from pspf.emit import Emitter
from pspf.errors import BackupDamaged, LeaseLost
from pspf.execution import Entry, EntryMeta, run_async_into, run_sync
from pspf.failures import DeadLetter, Failure, Outcome, RetryPolicy, decide
from pspf.hooks import CycleResult, ProcessorHooks, call_hook
from pspf.keys import StreamId, entry_name
from pspf.outbox import RowState
from pspf.partition import OwnedPartition, StreamCursor
from pspf.relay import Relay
from pspf.settings import OutboxSettings
from pspf.timekeeping import TimeKeeping

log = logging.getLogger(__name__)


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
    ) -> None:
        self.app = app
        self.broker = broker
        self.consumer = consumer
        self.policies = policies
        self.hooks = hooks or ProcessorHooks()
        self.emitter = Emitter(broker, app.name)
        self.relay = Relay(broker, consumer, outbox or OutboxSettings(), self.hooks)
        self.owned: dict[int, OwnedPartition] = {}
        self._by_stream: dict[str, StreamCursor] = {}
        if app.timers:  # a read waits no longer than a timer period (one it overruns runs late)
            block_ms = max(1, min([block_ms, *(t.every_ms for t in app.timers)]))
        self.delivery = Delivery(
            broker, app.name, consumer, batch_size, block_ms, policies, self.owned, self._by_stream
        )
        self.time = TimeKeeping(app, self.emitter, self.hooks, idle_close_s, self._commit, self._lease_lost)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- ownership bookkeeping (called by the worker) -----------------------------------------

    def add(self, owned: OwnedPartition) -> None:
        """Process a partition taken on (``ownership.Partitions.take``) from the next cycle on."""
        self.time.load(owned)
        self.owned[owned.partition] = owned
        for cursor in owned.streams.values():
            self._by_stream[cursor.stream] = cursor

    def remove(self, partition: int) -> OwnedPartition:
        owned = self.owned.pop(partition)
        self.relay.finish(owned.outbox)
        for cursor in owned.streams.values():
            self._by_stream.pop(cursor.stream, None)
        return owned

    def cursors(self) -> list[StreamCursor]:
        return list(self._by_stream.values())

    def rewind_all(self) -> None:
        """After a lost connection nothing read is trusted: re-read every own pending entry."""
        self.delivery.close()
        for owned in self.owned.values():
            if owned.outbox.sending is not None:
                owned.outbox.sending.sent.abandon()
        for cursor in self._by_stream.values():
            cursor.rewind()

    def close(self) -> None:
        self.delivery.close()
        for owned in self.owned.values():
            self.relay.finish(owned.outbox)
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -- the cycle ------------------------------------------------------------------------------

    def run_once(self, block: bool = True) -> CycleResult:
        """One cycle: read, skip done, decode, handle, commit, acknowledge.

        With ``block`` the read waits up to ``block_ms`` for new entries; without, it only looks.
        """
        result = CycleResult()
        reads, lost = self.delivery.read(block)
        for stream in lost:
            self._lease_lost(stream, LeaseLost("the read found the lease taken"), result)
        if not any(read.alone for read in reads):
            reads = self.delivery.read_due() + reads
        by_partition: dict[int, list[Read]] = {}
        for read in reads:
            by_partition.setdefault(read.cursor.partition, []).append(read)
            result.read += len(read.entries)
        if result.read:
            call_hook(self.hooks.on_read, result.read)
        outcomes: list[tuple[PartitionBatch, list[StreamOutcome]]] = []
        for partition, partition_reads in by_partition.items():
            batch = PartitionBatch(self.owned[partition], self.app.state_decoder, self.emitter)
            stream_outcomes = [self._handle(batch, read, result) for read in partition_reads]
            if batch.owned.windows is not None or batch.owned.timers is not None:
                self.time.advance(batch, result)
            self._commit(batch, stream_outcomes)
            outcomes.append((batch, stream_outcomes))
        self._acknowledge(outcomes, result)
        self._publish(result)
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
            and all(c.pending_after is None and c.retry_at == 0.0 for c in self._by_stream.values())
            and not any(parked(f) for owned in self.owned.values() for f in owned.failures.values())
            and not any(owned.outbox.waiting for owned in self.owned.values())
        )
        self.time.passes(list(self.owned.values()), set(by_partition), result)
        if result.read == 0:  # no acknowledgement carries the relay's writes to the backups
            for owned in self.owned.values():
                if owned.backup is not None:
                    try:
                        owned.backup.flush()
                    except LeaseLost as exc:
                        self._lease_lost(owned.backup.stream, exc, result)
        return result

    def apply_outbox_replays(self) -> None:
        """Apply operators' outbox replay requests for the owned partitions (``pspf outbox replay``)."""
        requests = self.broker.outbox_replay_requests(self.app.name, sorted(self.owned))
        for partition, raw in requests.items():
            owned = self.owned[partition]
            try:
                ids = msgspec.json.decode(raw, type=list[int])
            except msgspec.DecodeError:
                log.error("unreadable outbox replay request dropped partition=%s: %r", partition, raw[:100])
                ids = []
            replayed = owned.outbox.replay(ids)
            if owned.backup is not None:
                try:
                    owned.backup.flush()
                except LeaseLost as exc:  # the next lease round gives the partition up
                    log.warning("outbox replay partition=%s not confirmed: %s", partition, exc)
                    continue
            owned.outbox.confirm()
            outcome = {"requested": ids, "replayed": replayed, "at_ms": int(time.time() * 1000)}
            self.broker.finish_outbox_replay(self.app.name, partition, raw, msgspec.json.encode(outcome))
            log.info(
                "outbox replay partition=%s: %s of %s requested rows back to pending",
                partition,
                len(replayed),
                len(ids),
            )

    # -- step 7: publish ----------------------------------------------------------------------

    def _publish(self, result: CycleResult) -> None:
        """Publish what the owned partitions emitted (and the backup or the lease confirmed)."""
        for owned in self.owned.values():
            if owned.outbox.waiting or owned.outbox.counts[RowState.PUBLISHED]:
                published, failed = self.relay.step(owned.outbox)
                result.published += published
                result.publish_failed += failed
                call_hook(self.hooks.on_outbox_rows, owned.partition, owned.outbox.counts)

    # -- steps 2-4: skip, decode, handle ------------------------------------------------------

    def _handle(self, batch: PartitionBatch, read: Read, result: CycleResult) -> StreamOutcome:
        cursor = read.cursor
        screened = self.delivery.screen(batch.owned, read)
        todo, done_ids, dead = screened.todo, screened.done_ids, screened.dead
        result.skipped += screened.skipped
        result.lost_entries += screened.lost
        decisions: dict[int, tuple[Outcome, Failure]] = {}
        ran, errors = self._run(batch, read, todo, decisions, result)
        owned = batch.owned
        retry_in_s = None
        if not errors:  # the common case, kept free of per-entry bookkeeping
            ids = [id_b for id_b, _ in (todo if ran == len(todo) else todo[:ran])]
            done_ids += ids
            handled = ran
            last_done = ids[-1] if ids else None
            if owned.failures:
                for id_b in ids:
                    name = entry_name(cursor.topic, id_b)
                    if batch.failure(name) is not None:
                        batch.failures[name] = None
        else:
            handled, last_done, retry_in_s = self._settle(
                batch, read, todo[:ran], errors, decisions, dead, done_ids, result
            )
        for id_b, _ in todo[ran:]:  # delivered, not attempted: it did not crash us
            cursor.unattempted[id_b] = cursor.unattempted.get(id_b, 0) + 1
        if owned.windows is not None or self.time.ttl:
            self.time.entries_done(batch, cursor.topic, todo[:ran], last_done)
        result.handled += handled
        checkpoint = None if read.due or last_done is None else StreamId.parse(last_done)
        if checkpoint is not None and cursor.checkpoint is not None and checkpoint <= cursor.checkpoint:
            checkpoint = None  # only entries taken from other consumers, below the checkpoint
        return StreamOutcome(cursor, checkpoint, done_ids, dead, retry_in_s, handled, screened.skipped)

    def _run(
        self,
        batch: PartitionBatch,
        read: Read,
        todo: list[Entry],
        decisions: dict[int, tuple[Outcome, Failure]],
        result: CycleResult,
    ) -> tuple[int, dict[int, BaseException]]:
        """Run the handler over ``todo``; how many ran, their errors, and each failure's outcome.

        A store that failed under a handler stops here, whatever the handler did with its error.
        """
        cursor = read.cursor
        handler = self.app.handlers[cursor.topic]
        policy = self.policies[cursor.topic]
        meta = EntryMeta(
            cursor.topic,
            cursor.partition,
            read.counts,
            read.poison,
            policy.max_deliveries or 1,
            policy.timeout_ms,
            self.emitter.partitions(cursor.topic),
        )

        def stop(index: int, exc: BaseException) -> bool:
            if batch.broken is not None:
                raise batch.broken
            id_b = todo[index][0]
            outcome, failure = decide(
                exc, batch.failure(entry_name(cursor.topic, id_b)), policy, handler.non_retryable, read.due
            )
            log.warning(
                "entry failed topic=%s partition=%s id=%s attempt=%s error=%s: %s",
                cursor.topic,
                cursor.partition,
                id_b.decode(),
                failure.attempts,
                failure.error_type,
                failure.message,
            )
            decisions[index] = (outcome, failure)
            return outcome is Outcome.RETRY

        if handler.is_async:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            ran, errors = run_async_into(self._loop, handler, meta, todo, batch, stop)
        else:
            passed = self.time.clock(batch, cursor.topic, result)
            ran, errors = run_sync(handler, meta, todo, batch.overlay, batch.emitted, batch, stop, passed)
        if batch.broken is not None:
            raise batch.broken
        return ran, errors

    def _settle(
        self,
        batch: PartitionBatch,
        read: Read,
        ran: list[Entry],
        errors: dict[int, BaseException],
        decisions: dict[int, tuple[Outcome, Failure]],
        dead: list[tuple[bytes, Fields]],
        done_ids: list[bytes],
        result: CycleResult,
    ) -> tuple[int, bytes | None, float | None]:
        """Apply each entry's outcome when some failed; (handled, last done id, retry delay)."""
        cursor = read.cursor
        handled = 0
        last_done: bytes | None = None
        for index, (id_b, fields) in enumerate(ran):
            name = entry_name(cursor.topic, id_b)
            if index not in errors:
                if batch.failure(name) is not None:
                    batch.failures[name] = None
                done_ids.append(id_b)
                handled += 1
                last_done = id_b
                continue
            outcome, failure = decisions[index]
            result.failed += 1
            call_hook(self.hooks.on_failure, cursor.topic, cursor.partition, id_b.decode(), failure)
            if outcome is not Outcome.DEAD:
                batch.failures[name] = failure
                call_hook(self.hooks.on_retry, cursor.topic, cursor.partition, id_b.decode(), failure)
            if outcome is Outcome.RETRY:
                result.retried += 1
                return handled, last_done, self.policies[cursor.topic].delay_s(failure.attempts)
            if outcome is Outcome.PARKED:
                result.parked += 1
            else:
                record = DeadLetter.of(
                    cursor.topic, cursor.partition, id_b, self.app.name, self.consumer, fields, failure
                )
                dlq_fields = record.to_fields()
                batch.failures[name] = None
                batch.dead[name] = dlq_fields
                dead.append((id_b, dlq_fields))
            last_done = id_b
        return handled, last_done, None

    # -- step 5: commit -----------------------------------------------------------------------

    def _commit(self, batch: PartitionBatch, outcomes: list[StreamOutcome]) -> float | None:
        """Step 5 for one partition; the seconds it took, None when there was nothing to write."""
        took = batch.commit(outcomes)
        if took is not None:
            call_hook(self.hooks.on_commit, batch.owned.partition, took)
        for o in outcomes:  # with nothing to write, the entries done are reported all the same
            if took is not None or o.handled or o.skipped:
                c = o.cursor
                call_hook(self.hooks.on_batch_committed, c.topic, c.partition, o.handled, o.skipped)
        return took

    # -- step 6: acknowledge ------------------------------------------------------------------

    def _acknowledge(
        self, outcomes: list[tuple[PartitionBatch, list[StreamOutcome]]], result: CycleResult
    ) -> None:
        """Acknowledge the cycle's batches; the state backup's update travels with the first call.

        Per partition, the call of the backup's stream carries the backup update (also with
        nothing to acknowledge). Where an app reads several topics, the other topics' calls go in
        a second round trip, only for the partitions whose backup call succeeded.
        """
        merged: dict[str, tuple[list[bytes], list[tuple[bytes, Fields]]]] = {}
        for _, stream_outcomes in outcomes:
            for o in stream_outcomes:
                ids, dead = merged.setdefault(o.cursor.stream, ([], []))
                ids += o.ack_ids
                dead += o.dead
        first: list[AckRequest] = []
        then: list[AckRequest] = []
        for batch, _ in outcomes:
            backup = batch.owned.backup
            for c in batch.owned.streams.values():
                ids, dead = merged.get(c.stream, ([], []))
                if backup is not None and c.stream == backup.stream:
                    request = backup.request(ids, c.dlq, dead)
                elif ids or dead:
                    request = AckRequest(
                        c.stream, self.app.name, c.lease_key, c.lease_value, ids, c.dlq, dead
                    )
                else:
                    continue
                (then if backup is not None and c.stream != backup.stream else first).append(request)
        first = [r for r in first if r.ids or r.dead or r.backup is not None]
        if not first and not then:
            return
        call_hook(self.hooks.on_acknowledging, {r.stream: len(r.ids) + len(r.dead) for r in [*first, *then]})
        started = time.perf_counter()
        lost = self._send_acks(first, result, backups=True)
        for batch, _ in outcomes:
            if batch.owned.partition not in lost:  # its rows are in the backup, under the lease
                batch.owned.outbox.confirm()
        self._send_acks([r for r in then if self._by_stream[r.stream].partition not in lost], result)
        call_hook(self.hooks.on_ack, time.perf_counter() - started)

    def _send_acks(self, requests: list[AckRequest], result: CycleResult, backups: bool = False) -> set[int]:
        """One pipelined round trip of acknowledging calls; the partitions whose lease was lost."""
        if not requests:
            return set()
        try:
            replies = self.broker.ack(requests)
        except BaseException:
            if backups:  # the calls may not have run: their backup writes go again next time
                for request in requests:
                    owned = self.owned[self._by_stream[request.stream].partition]
                    if request.backup is not None and owned.backup is not None:
                        owned.backup.not_sent()
            raise
        lost = set()
        for request, reply in zip(requests, replies, strict=True):
            partition = self._by_stream[request.stream].partition
            backup = self.owned[partition].backup
            if isinstance(reply, BackupDamaged) and backup is not None:
                reply = backup.repaired(request)
            if isinstance(reply, LeaseLost):
                self._lease_lost(request.stream, reply, result)
                lost.add(partition)
                continue
            if request.backup is not None and backup is not None:
                backup.sent()
            if request.dead:
                result.dead_lettered += reply[1]
                self._forget_dead(self.owned[partition], request)
        return lost

    def _forget_dead(self, owned: OwnedPartition, request: AckRequest) -> None:
        """The DLQ moves are confirmed: drop their records (a crash first only repeats a no-op)."""
        topic = self._by_stream[request.stream].topic
        with owned.store.transaction() as tx:
            for entry_id, fields in request.dead:
                tx.delete(keys.DEAD_NAMESPACE, entry_name(topic, entry_id))
                owned.dead.pop(entry_name(topic, entry_id), None)
                log.error(
                    "entry moved to the DLQ topic=%s partition=%s id=%s error=%s",
                    topic,
                    owned.partition,
                    entry_id.decode(),
                    fields.get(b"error_type", b"").decode(),
                )
                call_hook(self.hooks.on_dead_letter, DeadLetter.from_fields(fields))

    def _lease_lost(self, stream: str, exc: LeaseLost, result: CycleResult) -> None:
        """Give the partition up, logged as what refused it (a lost lease, a backup that went back)."""
        partition = self._by_stream[stream].partition
        log.warning("%s, giving the partition up stream=%s: %s", exc.what, stream, exc)
        if partition not in result.lost_partitions:
            result.lost_partitions.append(partition)
