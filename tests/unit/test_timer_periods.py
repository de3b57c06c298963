"""Which periods of an ``@app.timer`` a cycle runs (``PartitionTimers.periods_due``)."""

from __future__ import annotations

from pspf.windows.timers import CATCH_UP, PartitionTimers, Timer


def timers(since_ms: int) -> PartitionTimers:
    found = PartitionTimers(frozenset(), ttl=False)
    found.since_ms = since_ms
    return found


TICK = Timer("tick", 100, lambda ctx: None)


def test_the_period_the_partition_was_taken_in_runs_first_then_each_once() -> None:
    t = timers(since_ms=10_050)
    assert list(t.periods_due(TICK, 10_080)) == [10_000]
    t.ran(TICK, 10_000)
    assert list(t.periods_due(TICK, 10_099)) == []
    assert list(t.periods_due(TICK, 10_100)) == [10_100]


def test_periods_whose_start_passed_while_the_partition_was_owned_run_late_in_order() -> None:
    t = timers(since_ms=10_000)
    t.ran(TICK, 10_000)
    # A read that blocked past two period starts: both run, oldest first.
    assert list(t.periods_due(TICK, 10_250)) == [10_100, 10_200]


def test_no_period_before_the_takeover_and_none_after_the_last_run_by_a_clock_behind() -> None:
    t = timers(since_ms=50_000)
    assert list(t.periods_due(TICK, 50_020)) == [50_000]  # nothing ran: none before the takeover
    t.ticks["tick"] = 60_000  # the backup says a host whose clock is ahead ran up to 60_000
    assert list(t.periods_due(TICK, 59_990)) == []
    assert list(t.periods_due(TICK, 60_110)) == [60_100]


def test_a_last_period_of_another_length_and_a_long_stall() -> None:
    t = timers(since_ms=0)
    t.ticks["tick"] = 1_050  # a period of a timer that ran every 50 ms before
    assert list(t.periods_due(TICK, 1_150)) == [1_100]
    t.ran(TICK, 1_100)
    stalled = list(t.periods_due(TICK, 1_000_000))
    assert len(stalled) == CATCH_UP and stalled[-1] == 1_000_000 and stalled[0] > 1_100
