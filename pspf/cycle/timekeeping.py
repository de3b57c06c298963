"""The batch cycle's work with time: windows, callbacks, timers and state expiry.

Stream-time work joins the batch in hand: after each entry of a sync handler the callbacks stream
time made due run (``clock``), and before the commit the windows it closed give their results and
expired state goes (``advance``), so all of it commits with the batch (step 5). Clock work
(``passes``) runs after each cycle: it returns a batch of no entries per partition, which the
caller makes durable (``batch.Durability.commit_alone``) before anything it emitted is published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pspf import codec
from pspf.context import Context, TimerContext
from pspf.cycle.execution import UNCHANGED, Entry, state_result
from pspf.errors import ConfigError
from pspf.hooks import CycleResult, ProcessorHooks, call_hook
from pspf.keys import StreamId
from pspf.outbox.emit import Emitter
from pspf.partition.batch import PartitionBatch
from pspf.partition.owned import OwnedPartition
from pspf.tables.lookups import Lookups
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import CALLBACK_STEP, PartitionTimers, Timer

if TYPE_CHECKING:
    from pspf.app import App

log = logging.getLogger("pspf.timekeeping")


class Clock:
    """The time timers, expiry and idle windows go by; ``pspf.testing`` moves its own by hand."""

    def wall_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        return time.monotonic()


class LateLog:
    """Says in the log that windows dropped late entries: a line at most every ``every_s``.

    Each line sums, per window, what came since the previous one, so a stream of stragglers
    costs a line every few seconds rather than one per batch.
    """

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._counts: dict[str, int] = {}
        self._last: float | None = None

    def add(self, late: dict[str, int], now: float) -> None:
        """Count ``late`` (entries by window name) and log them if a line is due (``now``: monotonic)."""
        counts = self._counts
        for name, entries in late.items():
            counts[name] = counts.get(name, 0) + entries
        self.flush(now)

    def flush(self, now: float) -> None:
        """Log what was counted since the last line, unless that line is less than ``every_s`` old."""
        if not self._counts or (self._last is not None and now - self._last < self.every_s):
            return
        counts, self._counts, self._last = self._counts, {}, now
        log.warning(
            "late entries dropped (all their windows had closed) since the last such line, by window: %s",
            " ".join(f"{name}={entries}" for name, entries in sorted(counts.items())),
        )


class TimeKeeping:
    """Windows, scheduled callbacks, timers and state expiry of the app's owned partitions."""

    def __init__(
        self,
        app: App,
        emitter: Emitter,
        hooks: ProcessorHooks,
        idle_close_s: float,
        clock: Clock | None = None,
    ) -> None:
        self.app = app
        self._clock = clock or Clock()
        self.emitter = emitter
        self.hooks = hooks
        self.idle_close_s = idle_close_s
        self.ttl = app.state_ttl_ms is not None or any(h.state_ttl_ms for h in app.handlers.values())
        self.active = bool(app.windows or app.callbacks or app.timers or self.ttl)
        #: the app's tables, for timers and scheduled callbacks (``BatchProcessor.start_tables``)
        self.lookups: Lookups | None = None
        self.late_log = LateLog()

    def load(self, owned: OwnedPartition) -> None:
        """Load a partition's windows, schedules, timer periods and expiry from its store."""
        app = self.app
        if app.windows or app.callbacks:
            owned.windows = PartitionWindows.load(owned.store, app.windows)
            owned.windows.last_entry_at = self._clock.monotonic()
        if app.callbacks or app.timers or self.ttl:
            owned.timers = PartitionTimers.load(owned.store, frozenset(app.callbacks), self.ttl)
            owned.timers.since_ms = self._clock.wall_ms()

    # -- stream time, within a batch ------------------------------------------------------------

    def clock(self, batch: PartitionBatch, topic: str, result: CycleResult) -> Callable[[bytes], None] | None:
        """What runs after each entry of a sync handler: the callbacks stream time made due.

        So an entry after a callback's time sees what the callback did, however the entries are
        batched. (Async handlers run concurrently: their callbacks run after the batch's entries.)
        """
        windows, timers = batch.owned.windows, batch.owned.timers
        if not self.app.callbacks or windows is None or timers is None or self.app.handlers[topic].is_async:
            return None
        # a plain handler's entry moves stream time as it is applied; a table's update is no event
        plain = not self.app.windows_of(topic) and topic not in self.app.tables

        def passed(entry_id: bytes) -> None:
            if plain:
                windows.advance(int(entry_id.split(b"-", 1)[0]), (topic, entry_id))
            due = timers.due
            if due and windows.stream_ms is not None and due[0][0] <= windows.stream_ms:
                self._run_callbacks(batch, timers, windows.stream_ms, result)

        return passed

    def entries_done(
        self, batch: PartitionBatch, topic: str, ran: list[Entry], last_done: bytes | None
    ) -> None:
        """Move stream time past a plain handler's entries; note its ``state_ttl`` for its keys.

        A plain handler's entry counts at the time Redis appended it (a table's update is no
        event: it moves no time); its keys expire after its own ``state_ttl`` where that is not
        the app's.
        """
        windows = batch.owned.windows
        if (windows is None and not self.ttl) or topic in self.app.tables:
            return
        if windows is not None and last_done is not None and not self.app.windows_of(topic):
            windows.advance(StreamId.parse(last_done).ms, (topic, last_done))
        ttl_ms = self.app.handlers[topic].state_ttl_ms
        if self.ttl and ttl_ms != self.app.state_ttl_ms:
            for _, fields in ran:
                key = fields.get(codec.KEY, b"").decode(errors="replace")
                if key in batch.overlay:
                    batch.ttl_ms[key] = ttl_ms

    def advance(self, batch: PartitionBatch, result: CycleResult) -> None:
        """Add to the batch (step 5 commits it) what its stream time and the clock now call for.

        The results of the windows stream time closed, the callbacks it made due, and the state
        that expired.
        """
        windows, timers = batch.owned.windows, batch.owned.timers
        if windows is not None:
            windows.last_entry_at = now = self._clock.monotonic()  # once per batch, not per entry
            late = windows.take_late()
            if late:
                self._count_late(late, batch.owned.partition, result, now)
            closed = windows.close(self.emitter, batch.owned.partition)
            if closed:
                batch.emitted += closed
                result.windows_closed += len(closed)
        if timers is not None:
            if timers.calls and windows is not None:
                self._run_callbacks(batch, timers, windows.stream_ms, result)
            if timers.ttl:
                self._expire(batch, timers)

    def _count_late(self, late: dict[str, int], partition: int, result: CycleResult, now: float) -> None:
        """Late entries (by window name) into the cycle's counts, the hooks and the log."""
        for name, entries in late.items():
            result.late += entries
            result.late_windows[name] = result.late_windows.get(name, 0) + entries
            call_hook(self.hooks.on_late, name, self.app.windows[name].topic, partition, entries)
        self.late_log.add(late, now)

    def _run_callbacks(
        self, batch: PartitionBatch, timers: PartitionTimers, stream_ms: int | None, result: CycleResult
    ) -> None:
        """Run the scheduled callbacks due at ``stream_ms``: each joins the batch, or fails alone.

        A callback that raises is logged and dropped with its writes (it is not tried again).
        """
        for _ in range(CALLBACK_STEP):
            call = timers.take_due(stream_ms)
            if call is None:
                return
            callback = self.app.callbacks.get(call.name)
            topic, entry_id = call.source
            ctx = Context(topic, batch.owned.partition, entry_id, call.key, 1, None, batch)
            ctx.due_ms = call.at_ms
            start = len(batch.viewed)  # where its view writes start: cut there if it fails
            try:
                if callback is None:
                    raise ConfigError(f"the app has no @app.on_schedule({call.name!r}) any more")
                callback.func(callback.payload.decode(call.payload), ctx)
                new = state_result(ctx)
            except Exception as exc:
                if batch.broken is not None:
                    raise batch.broken from exc
                del batch.viewed[start:]
                result.callbacks_failed += 1
                log.error(
                    "scheduled callback %s for key %r failed, dropped: %r",
                    call.name,
                    call.key,
                    exc,
                    exc_info=exc,
                )
                continue
            result.callbacks_run += 1
            if new is not UNCHANGED:
                batch.overlay[call.key] = new
            if ctx.emitted:
                batch.emitted += ctx.emitted
            if ctx.schedules:
                timers.schedule(ctx.schedules)

    def _expire(self, batch: PartitionBatch, timers: PartitionTimers) -> None:
        """Keep the expiry of the keys this batch wrote, and delete a step of expired state."""
        now_ms = self._clock.wall_ms()
        for key, value in batch.overlay.items():
            ttl_ms = batch.ttl_ms.get(key, self.app.state_ttl_ms)
            timers.written(key, None if value is None or ttl_ms is None else now_ms + ttl_ms)
        for key in timers.expired(now_ms):
            batch.overlay[key] = None

    # -- the clock, after a cycle -----------------------------------------------------------------

    def passes(
        self, owned_partitions: list[OwnedPartition], handled: set[int], result: CycleResult
    ) -> list[PartitionBatch]:
        """What wall-clock time calls for in the owned partitions: a batch of no entries each.

        Timers whose period came; on an idle cycle, the windows of partitions idle for
        ``idle_close_s``; expired state of partitions without a batch (``handled``) this cycle.
        """
        if not (self.app.timers or self.app.windows or self.ttl):
            return []
        batches = []
        now_ms, now = self._clock.wall_ms(), self._clock.monotonic()
        self.late_log.flush(now)
        for owned in owned_partitions:
            windows, timers = owned.windows, owned.timers
            batch = PartitionBatch(owned, self.app.state_decoder, self.emitter, self.lookups)
            acted = False
            if timers is not None:
                for timer in self.app.timers:
                    for period in timers.periods_due(timer, now_ms):
                        self._run_timer(batch, timers, timer, period, result)
                        acted = True
                if timers.ttl and owned.partition not in handled and timers.expiry_due(now_ms):
                    for key in timers.expired(now_ms):
                        batch.overlay[key] = None
                    acted = True
            if result.read == 0 and windows is not None and windows.idle_close_due(self.idle_close_s, now):
                windows.advance_to_close_all()
                log.info("partition=%s idle: open windows closed", owned.partition)
                self.advance(batch, result)
                acted = True
            if acted:  # a batch of nothing would cost a commit's wait for the acknowledgement in flight
                batches.append(batch)
        return batches

    def _run_timer(
        self, batch: PartitionBatch, timers: PartitionTimers, timer: Timer, period: int, result: CycleResult
    ) -> None:
        """One period of a timer: its writes and emits join the batch if it returns; ran either way."""
        partition = batch.owned.partition
        ctx = TimerContext(timer.name, partition, period, self.emitter.partitions(self.app.topics[0]), batch)
        try:
            timer.func(ctx)
            states = {key: state_result(context) for key, context in ctx.attempts.items()}
        except Exception as exc:
            if batch.broken is not None:
                raise batch.broken from exc
            result.timers_failed += 1
            log.error("timer %s partition=%s failed: %r", timer.name, partition, exc, exc_info=exc)
        else:
            result.timers_run += 1
            batch.overlay.update((key, new) for key, new in states.items() if new is not UNCHANGED)
            batch.emitted += ctx.emitted
        timers.ran(timer, period)
