"""The app the crash tests run in worker subprocesses (``pspf run tests.crash.apps:main``).

Configured by environment variables, read when ``main`` is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream;
- ``PSPF_TEST_ASYNC``: when ``1``, the handler is ``async def`` (the concurrent per-key path);
- ``PSPF_TEST_WHO``: when set, each key's state counts the entries each worker handled, by this
  label (``state["by"][label]``);
- ``PSPF_TEST_CRASH``: a named crash point ``WHERE:N``, where the process kills itself with
  SIGKILL, once (``PSPF_TEST_MARKER`` names the marker file that says it happened; the file holds
  a small JSON report):

  - ``handler:N``: inside the handler of the N-th entry this process handles, after its state
    update (nothing of the batch in hand is committed);
  - ``commit:N``: right after the N-th partition commit of this process returned (other
    partitions of the same cycle are not committed yet, nothing of the cycle is acknowledged);
  - ``ack:N``: at the start of the N-th acknowledgement round that has something to acknowledge,
    after every partition of the cycle committed and before the ack is sent.

The state of a key is ``{"count": entries, "total": sum of amounts}`` (plus ``by``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from pspf import App, Context
from pspf.processor import BatchProcessor


class Order(msgspec.Struct):
    amount: int


def _die(marker: Path, report: dict[str, Any]) -> None:
    marker.write_text(json.dumps(report))
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered before this returns


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _install_crash_point(where: str, nth: int, marker: Path) -> None:
    """Wrap a BatchProcessor step so the process SIGKILLs itself at its N-th call."""
    if where == "commit":
        original_commit = BatchProcessor._commit
        commits = 0

        def commit(self: BatchProcessor, batch: Any, outcomes: Any) -> None:
            nonlocal commits
            original_commit(self, batch, outcomes)
            if any(o.handled for o in outcomes):
                commits += 1
                if commits == nth and not marker.exists():
                    applied = sum(o.handled for o in outcomes)
                    _die(marker, {"where": where, "partition": batch.owned.partition, "applied": applied})

        BatchProcessor._commit = commit  # type: ignore[method-assign]
    elif where == "ack":
        original_ack = BatchProcessor._acknowledge
        rounds = 0

        def acknowledge(self: BatchProcessor, outcomes: Any, result: Any) -> None:
            nonlocal rounds
            unacked = {o.cursor.stream: len(o.ack_ids) for _, stream in outcomes for o in stream if o.ack_ids}
            if unacked:
                rounds += 1
                if rounds == nth and not marker.exists():
                    _die(marker, {"where": where, "unacked": unacked})
            original_ack(self, outcomes, result)

        BatchProcessor._acknowledge = acknowledge  # type: ignore[method-assign]
    elif where != "handler":
        raise ValueError(f"unknown crash point {where!r}")


def main() -> App:
    topic = os.environ["PSPF_TEST_TOPIC"]
    app = App(os.environ["PSPF_TEST_APP"])
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6
    who = os.environ.get("PSPF_TEST_WHO")
    crash = os.environ.get("PSPF_TEST_CRASH")
    where, nth, marker = "", 0, Path()
    if crash:
        where, _, n = crash.partition(":")
        nth = int(n)
        marker = Path(os.environ["PSPF_TEST_MARKER"])
        _install_crash_point(where, nth, marker)
    handled = 0

    def add(order: Order, ctx: Context) -> None:
        nonlocal handled
        state = ctx.state
        state["count"] = state.get("count", 0) + 1
        state["total"] = state.get("total", 0) + order.amount
        if who:
            by = state.setdefault("by", {})
            by[who] = by.get(who, 0) + 1
        if work_s:
            _busy(work_s)
        handled += 1
        if where == "handler" and handled == nth and not marker.exists():
            _die(marker, {"where": where, "id": ctx.id, "key": ctx.key, "partition": ctx.partition})

    async def add_async(order: Order, ctx: Context) -> None:
        await asyncio.sleep(0)
        add(order, ctx)

    app.handler(topic)(add_async if os.environ.get("PSPF_TEST_ASYNC") == "1" else add)
    return app
