"""The reminder app of the schedule tests, and its exact reference (shared by the integration
tests and the crash tests, whose workers run it in subprocesses)."""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from datetime import timedelta
from typing import Any

from pspf import App, Context

#: (entry time in ms, key, delay in ms): what the reminder app's entries say, in id order.
Entries = list[tuple[int, str, int]]


def reminder_app(name: str, source: str, target: str, work_s: float = 0.0) -> App:
    """Each entry counts and asks to be reminded ``delay`` ms after it; a reminder of the same
    key replaces the one before. The reminder notes the count it was made at, and emits it.

    ``work_s``: seconds of busy work per entry, so that a kill lands in the middle of a batch.
    """
    app = App(name)

    @app.handler(source)
    def count(value: dict[str, Any], ctx: Context) -> None:
        n = ctx.state["n"] = ctx.state.get("n", 0) + 1
        ctx.schedule(timedelta(milliseconds=value["delay"]), "remind", {"n": n})
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass

    @app.on_schedule("remind")
    def remind(payload: dict[str, int], ctx: Context) -> None:
        ctx.state["reminded"] = [*ctx.state.get("reminded", []), [payload["n"], ctx.state["n"]]]
        ctx.emit(target, {"key": ctx.key, "n": payload["n"]}, key=ctx.key)

    return app


def simulate(
    entries: Entries, partitions: int
) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[int, int]]]:
    """What the reminder app must reach: entries (ms, key, delay) in id order per partition;
    after each, the reminders stream time reached run, in (time, key) order.

    Returns the state of each key, and the reminders still scheduled at the end (key -> (at, n)).
    """
    states: dict[str, dict[str, Any]] = defaultdict(dict)
    by_partition: dict[int, Entries] = defaultdict(list)
    for ms, key, delay in entries:
        by_partition[zlib.crc32(key.encode()) % partitions].append((ms, key, delay))
    left: dict[str, tuple[int, int]] = {}
    for todo in by_partition.values():
        pending: dict[str, tuple[int, int]] = {}  # key -> (at, n)
        for ms, key, delay in todo:
            state = states[key]
            state["n"] = state.get("n", 0) + 1
            pending[key] = (ms + delay, state["n"])
            for _, due_key in sorted((at, k) for k, (at, _) in pending.items() if at <= ms):
                n = pending.pop(due_key)[1]
                due = states[due_key]
                due["reminded"] = [*due.get("reminded", []), [n, due["n"]]]
        left.update(pending)
    return dict(states), left


def reference(entries: Entries, partitions: int) -> dict[str, dict[str, Any]]:
    """The state of each key once the reminder app applied ``entries`` (see ``simulate``)."""
    return simulate(entries, partitions)[0]
