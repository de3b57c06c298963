"""What wall-clock time asks of a cycle (``TimeKeeping.passes``): a batch only where something is due.

A batch of nothing would still be committed alone, and its commit waits for the acknowledgement
in flight: every cycle of an app with windows, timers or a state TTL would lose the overlap of
that acknowledgement with the next batch.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from pspf import App, windows
from pspf.cycle.timekeeping import Clock, TimeKeeping
from pspf.hooks import CycleResult, ProcessorHooks
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import PartitionTimers


class HandClock(Clock):
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def wall_ms(self) -> int:
        return self.now_ms

    def monotonic(self) -> float:
        return self.now_ms / 1000


def keeping(app: App, clock: HandClock) -> TimeKeeping:
    emitter: Any = SimpleNamespace(result=lambda *args: None, partitions=lambda topic: 1)
    return TimeKeeping(app, emitter, ProcessorHooks(), idle_close_s=5.0, clock=clock)


def owned(app: App, clock: HandClock, ttl: bool = False) -> Any:
    found: Any = SimpleNamespace(partition=0, windows=None, timers=None, views=None)
    if app.windows:
        found.windows = PartitionWindows(app.windows)
        found.windows.last_entry_at = clock.monotonic()
    if app.timers or ttl:
        found.timers = PartitionTimers(frozenset(), ttl=ttl)
        found.timers.since_ms = clock.wall_ms()
    return found


def test_windows_with_nothing_due_ask_for_no_batch_and_an_idle_partition_for_one() -> None:
    app = App("passes")

    @app.window("clicks", windows.tumbling(timedelta(minutes=1)), emit_to="out")
    def count(total: int | None, value: dict[str, Any]) -> int:
        return (total or 0) + 1

    clock = HandClock()
    time, partition = keeping(app, clock), owned(app, clock)
    open_windows = partition.windows.open["count"]
    open_windows.accs[("k", 0, 60_000)] = b"\x01"
    open_windows.closing.append((open_windows.close_at(0, 60_000), "k", 0, 60_000))
    assert time.passes([partition], {0}, CycleResult(read=10)) == []
    assert time.passes([partition], set(), CycleResult()) == []  # idle, but not for 5 s yet
    clock.now_ms += 5_000
    (batch,) = time.passes([partition], set(), CycleResult())
    assert batch.owned is partition
    assert partition.windows.stream_ms == open_windows.close_at(0, 60_000)  # closes every open window
    assert open_windows.accs == {}


def test_a_timer_asks_for_a_batch_only_when_a_period_starts() -> None:
    app = App("passes")
    ran: list[int] = []

    @app.handler("clicks")
    def handle(value: dict[str, Any], ctx: Any) -> None:
        pass

    @app.timer(timedelta(seconds=1))
    def tick(ctx: Any) -> None:
        ran.append(ctx.time_ms)

    clock = HandClock()
    time, partition = keeping(app, clock), owned(app, clock)
    assert len(time.passes([partition], set(), CycleResult())) == 1  # the period it was taken in
    assert time.passes([partition], set(), CycleResult()) == []
    clock.now_ms += 400
    assert time.passes([partition], set(), CycleResult()) == []
    clock.now_ms += 600
    assert len(time.passes([partition], set(), CycleResult())) == 1
    assert len(ran) == 2
