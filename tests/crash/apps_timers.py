"""Apps the timer and schedule crash tests run in worker subprocesses.

``pspf run tests.crash.apps_timers:ticking`` or ``...:reminders``, configured by environment
variables, read when a factory is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic the app reads and its name;
- ``PSPF_TEST_TARGET``: the topic it emits to;
- ``PSPF_TEST_PARTITIONS``: (``ticking``) the topic's partition count;
- ``PSPF_TEST_TICK``: (``ticking``) ``0``: no timer (a worker that only publishes what a
  stopped one left in the outbox);
- ``PSPF_TEST_CLOCK_SKEW_MS``: (``ticking``) the process's wall clock (``time.time``) is this many
  milliseconds off the real one: a host whose clock is behind (negative) or ahead;
- ``PSPF_TEST_WORK_US``: (``reminders``) microseconds of busy work per entry.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from pspf import App, Context
from pspf.codec import encode_text
from pspf.context import TimerContext
from pspf.keys import partition_for
from tests.reminders import reminder_app

TICK_MS = 100


def tick_keys(partitions: int) -> dict[int, tuple[str, str]]:
    """Per partition, two keys of it: the one whose state lists the ticks, the one that counts them."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    i = 0
    while any(len(names) < 2 for names in found.values()):
        key = f"k{i}"
        names = found[partition_for(encode_text("key", key), partitions)]
        if len(names) < 2:
            names.append(key)
        i += 1
    return {p: (names[0], names[1]) for p, names in found.items()}


def _skew_clock(skew_ms: int) -> None:
    real = time.time

    def skewed() -> float:
        return real() + skew_ms / 1000

    time.time = skewed


def ticking() -> App:
    """A timer every 100 ms: per partition, it appends its period to one key's list (``at``),
    increments another key's counter (``n``) and emits ``{"partition", "at", "n"}``."""
    topic, target = os.environ["PSPF_TEST_TOPIC"], os.environ["PSPF_TEST_TARGET"]
    skew_ms = int(os.environ.get("PSPF_TEST_CLOCK_SKEW_MS", "0"))
    if skew_ms:
        _skew_clock(skew_ms)
    keys = tick_keys(int(os.environ["PSPF_TEST_PARTITIONS"]))
    app = App(os.environ["PSPF_TEST_APP"])

    @app.handler(topic)
    def nothing(value: object, ctx: Context) -> None:
        """A timer's app needs a topic; nothing is written to it."""

    if os.environ.get("PSPF_TEST_TICK", "1") == "1":

        @app.timer(every=timedelta(milliseconds=TICK_MS))
        def tick(ctx: TimerContext) -> None:
            listed, counted = keys[ctx.partition]
            ticks = ctx.state(listed)
            ticks["at"] = [*ticks.get("at", []), ctx.time_ms]
            counter = ctx.state(counted)
            counter["n"] = counter.get("n", 0) + 1
            ctx.emit(target, {"partition": ctx.partition, "at": ctx.time_ms, "n": counter["n"]})

    return app


def reminders() -> App:
    """``tests.reminders.reminder_app`` reading ``PSPF_TEST_TOPIC``, emitting to ``PSPF_TEST_TARGET``."""
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6
    return reminder_app(
        os.environ["PSPF_TEST_APP"], os.environ["PSPF_TEST_TOPIC"], os.environ["PSPF_TEST_TARGET"], work_s
    )
