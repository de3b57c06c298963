"""The app the crash tests run in worker subprocesses (``pspf run tests.crash.apps:main``).

Configured by environment variables, read when ``main`` is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream;
- ``PSPF_TEST_ASYNC``: when ``1``, the handler is ``async def`` (the concurrent per-key path);
- ``PSPF_TEST_WHO``: when set, each key's state counts the entries each worker handled, by this
  label (``state["by"][label]``);
- ``PSPF_TEST_CRASH``: a named crash point ``WHERE:N``, reached through the app's public
  processor hooks (``CrashHooks``), where the process kills itself with SIGKILL, once
  (``PSPF_TEST_MARKER`` names the marker file that says it happened; the file holds a small JSON
  report):

  - ``handler:N``: inside the handler of the N-th entry this process handles, after its state
    update (nothing of the batch in hand is committed);
  - ``commit:N``: right after the N-th partition commit of this process returned (other
    partitions of the same cycle are not committed yet, nothing of the cycle is acknowledged);
  - ``ack:N``: at the start of the N-th acknowledgement round that has something to acknowledge,
    after every partition of the cycle committed and before the ack is sent.

  ``stop:N`` is no crash: inside the handler of the N-th entry, after its state update, the
  process stops itself with SIGSTOP (once; the marker is written first) and goes on with the
  batch when the test sends SIGCONT: a zombie owner, frozen in the middle of a batch.

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
from pspf.hooks import ProcessorHooks


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


class CrashHooks(ProcessorHooks):
    """Kills the process with SIGKILL at a named step of its N-th batch, once (public hooks only)."""

    def __init__(self, where: str, nth: int, marker: Path) -> None:
        if where not in ("handler", "commit", "ack", "stop"):
            raise ValueError(f"unknown crash point {where!r}")
        self.where, self.nth, self.marker = where, nth, marker
        self.seen = 0

    def _reached(self) -> bool:
        self.seen += 1
        return self.seen == self.nth and not self.marker.exists()

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        # The app reads one topic: one stream per partition, so this is the partition's commit.
        if self.where == "commit" and handled and self._reached():
            _die(self.marker, {"where": "commit", "partition": partition, "applied": handled})

    def on_acknowledging(self, entries: dict[str, int]) -> None:
        if self.where == "ack" and self._reached():
            _die(self.marker, {"where": "ack", "unacked": entries})


def main() -> App:
    topic = os.environ["PSPF_TEST_TOPIC"]
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6
    who = os.environ.get("PSPF_TEST_WHO")
    crash = os.environ.get("PSPF_TEST_CRASH")
    where, nth, marker = "", 0, Path()
    if crash:
        where, _, n = crash.partition(":")
        nth = int(n)
        marker = Path(os.environ["PSPF_TEST_MARKER"])
    app = App(os.environ["PSPF_TEST_APP"], hooks=CrashHooks(where, nth, marker) if crash else None)
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
        if where == "stop" and handled == nth and not marker.exists():
            marker.write_text(json.dumps({"where": where, "id": ctx.id, "partition": ctx.partition}))
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once the test sends SIGCONT

    async def add_async(order: Order, ctx: Context) -> None:
        await asyncio.sleep(0)
        add(order, ctx)

    app.handler(topic)(add_async if os.environ.get("PSPF_TEST_ASYNC") == "1" else add)
    return app
