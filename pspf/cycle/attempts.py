"""One attempt loop, for the worker and ``TestApp``: run a read's entries, settle each failure.

``Attempts.run`` runs the handler over the entries a stream needs handled (steps 3 and 4 of the
cycle), decides what each failure means (``failures.decide``: retry, park or dead-letter), and
records it in the batch (its failures and dead-letter bookkeeping commit with it). It returns what
the attempt came to and changes nothing else: the caller turns it into the stream's outcome,
counts and hooks. A store that failed under a handler is raised here, whatever the handler did
with its error: it stops the worker and is never an entry's failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from pspf.app import App, Handler
from pspf.broker import Fields
from pspf.contracts.registry import CheckedDecoder, TopicChecks
from pspf.cycle.execution import (
    KNOWN_KEYS_LIMIT,
    KNOWN_KEYS_MIN_SHARE,
    Entry,
    EntryMeta,
    run_async_into,
    run_sync,
)
from pspf.failures import DeadLetter, Failure, Outcome, RetryPolicy, decide
from pspf.hooks import CycleResult, ProcessorHooks, call_hook
from pspf.keys import StreamId, entry_name
from pspf.observability.tracing import Tracing
from pspf.outbox.emit import Emitter
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.owned import Read
from pspf.tables.lookups import check_lookup_names

log = logging.getLogger("pspf.attempts")


class Attempted(NamedTuple):
    """What one run over a read's entries came to."""

    #: entries attempted, in id order; the rest were delivered and not attempted
    ran: int
    #: the entries handled, in id order
    handled: list[bytes]
    #: the last entry the stream is done with (handled, parked or dead-lettered)
    last_done: bytes | None
    #: each failed attempt (id, outcome, bookkeeping), in id order
    failed: list[tuple[bytes, Outcome, Failure]]
    #: (id, DLQ fields) of the entries that failed for good
    dead: list[tuple[bytes, Fields]]
    #: the stream waits this long before the failed entry is tried again; None: no wait
    retry_in_s: float | None

    def outcome(
        self, read: Read, done: list[bytes], dead: list[tuple[bytes, Fields]], skipped: int
    ) -> StreamOutcome:
        """The stream's outcome: ``done``/``dead`` (screened out before the run) plus the run's.

        The checkpoint moves to the last entry done, never for a due read (parked entries claimed
        again) and never back (entries taken from other consumers, below the checkpoint).
        """
        cursor, last_done = read.cursor, self.last_done
        checkpoint = None if read.due or last_done is None else StreamId.parse(last_done)
        if checkpoint is not None and cursor.checkpoint is not None and checkpoint <= cursor.checkpoint:
            checkpoint = None
        handled = len(self.handled)
        retry_id = None if self.retry_in_s is None else self.failed[-1][0]
        return StreamOutcome(
            cursor,
            checkpoint,
            done + self.handled,
            dead + self.dead,
            self.retry_in_s,
            handled,
            skipped,
            retry_id,
        )

    def report(self, result: CycleResult, hooks: ProcessorHooks, topic: str, partition: int) -> None:
        """Count the attempt into the cycle's result and tell the hooks of each failure."""
        result.handled += len(self.handled)
        for id_b, outcome, failure in self.failed:
            result.failed += 1
            call_hook(hooks.on_failure, topic, partition, id_b.decode(), failure)
            if outcome is not Outcome.DEAD:
                call_hook(hooks.on_retry, topic, partition, id_b.decode(), failure)
            if outcome is Outcome.RETRY:
                result.retried += 1
            elif outcome is Outcome.PARKED:
                result.parked += 1


class Attempts:
    """Runs the app's handlers for one consumer (a worker's, or ``TestApp``'s)."""

    def __init__(
        self,
        app: App,
        consumer: str,
        emitter: Emitter,
        policies: dict[str, RetryPolicy],
        tracing: Tracing | None = None,
    ) -> None:
        check_lookup_names(app.name, [*app.tables, *app.global_tables], app.functions())
        self.app = app
        self.consumer = consumer
        self.emitter = emitter
        self.policies = policies
        #: spans of the attempts; None: no tracer provider configured (``tracing.configured``)
        self.tracing = tracing
        self._loop: asyncio.AbstractEventLoop | None = None
        #: (topic, partition, partition count) -> the keys found to belong there
        self._known: dict[tuple[str, int, int], dict[bytes, str]] = {}
        #: the handlers of topics with a schema, their decoders checking it first (``check_schemas``)
        self._checked: dict[str, Handler] = {}

    def check_schemas(self, checks: dict[str, TopicChecks]) -> None:
        """Check each entry of these topics against its schema version before its handler runs."""
        for topic, found in checks.items():
            handler = self.app.handlers[topic]
            self._checked[topic] = msgspec.structs.replace(
                handler, decoder=CheckedDecoder(handler.decoder, found)
            )

    def run(
        self,
        batch: PartitionBatch,
        read: Read,
        todo: list[Entry],
        passed: Callable[[bytes], None] | None = None,
    ) -> Attempted:
        """Run the handler over ``todo`` (in id order) into ``batch``; stop at a failure to retry.

        ``passed(id)`` runs after each entry of a sync handler (time keeping's stream clock).
        """
        ran, errors, decisions = self._run(batch, read, todo, passed)
        topic = read.cursor.topic
        if not errors:  # the common case, kept free of per-entry bookkeeping
            handled = [id_b for id_b, _ in (todo if ran == len(todo) else todo[:ran])]
            if batch.owned.failures:
                for id_b in handled:
                    name = entry_name(topic, id_b)
                    if batch.failure(name) is not None:
                        batch.failures[name] = None
            return Attempted(ran, handled, handled[-1] if handled else None, [], [], None)
        return self._settle(batch, read, todo[:ran], errors, decisions)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _run(
        self,
        batch: PartitionBatch,
        read: Read,
        todo: list[Entry],
        passed: Callable[[bytes], None] | None,
    ) -> tuple[int, dict[int, BaseException], dict[int, tuple[Outcome, Failure]]]:
        """How many entries ran, their errors, and each failure's outcome."""
        cursor = read.cursor
        handler = self._checked.get(cursor.topic) or self.app.handlers[cursor.topic]
        policy = self.policies[cursor.topic]
        partitions = self.emitter.partitions(cursor.topic)
        meta = EntryMeta(
            cursor.topic,
            cursor.partition,
            read.counts,
            read.poison,
            policy.max_deliveries or 1,
            policy.timeout_ms,
            partitions,
            self._known.setdefault((cursor.topic, cursor.partition, partitions), {}),
            self.tracing,
            max(KNOWN_KEYS_MIN_SHARE, KNOWN_KEYS_LIMIT // len(self._known)),
        )
        decisions: dict[int, tuple[Outcome, Failure]] = {}
        tracing = self.tracing

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
            if tracing is not None:
                tracing.settle(cursor.topic, cursor.partition, todo[index], exc, outcome)
            return outcome is Outcome.RETRY

        if handler.is_async:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            ran, errors = run_async_into(self._loop, handler, meta, todo, batch, stop)
        else:
            ran, errors = run_sync(
                handler, meta, todo, batch.overlay, batch.emitted, batch.viewed, batch, stop, passed
            )
        if batch.broken is not None:
            raise batch.broken
        return ran, errors, decisions

    def _settle(
        self,
        batch: PartitionBatch,
        read: Read,
        ran: list[Entry],
        errors: dict[int, BaseException],
        decisions: dict[int, tuple[Outcome, Failure]],
    ) -> Attempted:
        """Each entry's outcome when some failed, recorded in the batch's bookkeeping."""
        cursor = read.cursor
        handled: list[bytes] = []
        failed: list[tuple[bytes, Outcome, Failure]] = []
        dead: list[tuple[bytes, Fields]] = []
        last_done: bytes | None = None
        for index, (id_b, fields) in enumerate(ran):
            name = entry_name(cursor.topic, id_b)
            if index not in errors:
                if batch.failure(name) is not None:
                    batch.failures[name] = None
                handled.append(id_b)
                last_done = id_b
                continue
            outcome, failure = decisions[index]
            failed.append((id_b, outcome, failure))
            if outcome is Outcome.RETRY:
                batch.failures[name] = failure
                retry_in_s = self.policies[cursor.topic].delay_s(failure.attempts)
                return Attempted(len(ran), handled, last_done, failed, dead, retry_in_s)
            if outcome is Outcome.PARKED:
                batch.failures[name] = failure
            else:
                record = DeadLetter.of(
                    cursor.topic, cursor.partition, id_b, self.app.name, self.consumer, fields, failure
                )
                dlq_fields = record.to_fields()
                batch.failures[name] = None
                batch.dead[name] = dlq_fields
                dead.append((id_b, dlq_fields))
            last_done = id_b
        return Attempted(len(ran), handled, last_done, failed, dead, None)
