"""Apps the outbox crash tests run in worker subprocesses (``pspf run tests.crash.apps_outbox:...``).

Two apps make a chain: ``enrich`` reads orders and emits one entry per order (``ctx.emit``) to
another topic, keyed by the order's user; ``total`` reads that topic and sums per user. Both keep
``{"count": entries, "total": sum of amounts}`` per key, the state ``tests.crash.support`` checks
(``assert_exact``); ``enrich`` keys its state by the order's key, ``total`` by the user.

Configured by environment variables, read when a factory is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_TARGET``: the topic ``enrich`` emits to;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream;
- ``PSPF_TEST_EVENTS``: a file to which every relay event of the process is appended as a JSON
  line (``pid``, ``event``: claimed / sent / settled, ``partition``, and ``rows``, ``stream`` and
  ``appended`` where the hook has them), so a test sees which relay published what;
- ``PSPF_TEST_CRASH``: a named crash point ``WHERE:N`` of the outbox relay, reached through the
  app's public processor hooks (``RelayCrashHooks``), once (``PSPF_TEST_MARKER`` names the marker
  file that says it happened; it holds a small JSON report). Steps count the relay steps of this
  process that claimed rows:

  A step claims rows and sends its publishing calls; the partition's next step reads their
  replies (``on_outbox_sent`` per call) and marks the rows (``on_outbox_settled``) before it
  claims again. Reports say which rows other partitions' steps have in flight then
  (``in_flight``: sent, in the target, not marked yet).

  - ``claimed:N``: SIGKILL in ``on_outbox_claimed`` of the N-th step: its rows are durably
    CLAIMED in the store, none is published;
  - ``sent-last:N``: SIGKILL in ``on_outbox_sent`` of the last publishing call of the N-th step:
    every row it claimed is in the target, none is marked PUBLISHED;
  - ``sent-first:N``: SIGKILL in ``on_outbox_sent`` of the first publishing call of the N-th step
    that needs several calls (to several target partitions, or more rows than
    ``pspf.outbox.relay.PUBLISH_CHUNK`` to one): mid-settle, one call's reply read, the others' not
    (``unread`` rows);
  - ``stop-claimed:N``: no crash: in ``on_outbox_claimed`` of the N-th step the process stops
    itself with SIGSTOP (the marker is written first) and publishes its claimed rows when the
    test sends SIGCONT: a zombie relay;
  - ``stop-settled:N``: no crash: in ``on_outbox_settled`` of the N-th step, SIGSTOP as above:
    the process goes on with the rest of its cycle when the test sends SIGCONT.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec

from pspf import App, Context
from pspf.hooks import ProcessorHooks
from pspf.outbox.rows import OutboxRow

CRASH_POINTS = ("claimed", "sent-last", "sent-first", "stop-claimed", "stop-settled")


class Order(msgspec.Struct):
    user: str
    amount: int
    n: int


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class RelayCrashHooks(ProcessorHooks):
    """Records the relay's events and kills (or stops) the process at a named relay step, once."""

    def __init__(self, crash: str | None, marker: Path | None, events: Path | None) -> None:
        self.where, self.nth = "", 0
        if crash:
            where, _, n = crash.partition(":")
            if where not in CRASH_POINTS:
                raise ValueError(f"unknown relay crash point {where!r}")
            self.where, self.nth = where, int(n)
        self.marker = marker
        self.events = events
        self.steps = 0  # steps that claimed rows
        self.several = 0  # steps whose rows needed several publishing calls
        #: per partition, its step whose calls are in flight: number, rows claimed, rows and calls read
        self.pending: dict[int, dict[str, int]] = {}
        self.settled = 0  # steps settled

    def _in_flight(self, partition: int) -> int:
        """Rows the other partitions' steps sent and have not read the replies of."""
        return sum(step["claimed"] for p, step in self.pending.items() if p != partition)

    def _record(self, **event: Any) -> None:
        if self.events is not None:
            line = json.dumps({"pid": os.getpid(), **event}) + "\n"
            with self.events.open("a") as out:  # one short append: whole lines, also across processes
                out.write(line)

    def _armed(self) -> bool:
        return self.marker is not None and not self.marker.exists()

    def _die(self, report: dict[str, Any]) -> None:
        assert self.marker is not None
        self.marker.write_text(json.dumps({"pid": os.getpid(), **report}))
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered before this returns

    def _stop(self, report: dict[str, Any]) -> None:
        assert self.marker is not None
        self.marker.write_text(json.dumps({"pid": os.getpid(), **report}))
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once the test sends SIGCONT
        self._record(event="resumed", partition=report["partition"])

    def on_outbox_claimed(self, partition: int, rows: int) -> None:
        self.steps += 1
        self.pending[partition] = {"step": self.steps, "claimed": rows, "sent": 0, "calls": 0}
        self._record(event="claimed", partition=partition, rows=rows)
        if self.steps != self.nth or not self._armed():
            return
        report = {
            "where": self.where,
            "partition": partition,
            "rows": rows,
            "in_flight": self._in_flight(partition),
        }
        if self.where == "claimed":
            self._die(report)
        if self.where == "stop-claimed":
            self._stop(report)

    def on_outbox_sent(self, partition: int, stream: str, rows: int, appended: int) -> None:
        step = self.pending[partition]
        step["calls"] += 1
        step["sent"] += rows
        self._record(event="sent", partition=partition, stream=stream, rows=rows, appended=appended)
        first_of_several = step["calls"] == 1 and step["sent"] < step["claimed"]
        if first_of_several:
            self.several += 1
        report = {
            "where": self.where,
            "partition": partition,
            "stream": stream,
            "claimed": step["claimed"],
            "rows": rows,
            "appended": appended,
            "unread": step["claimed"] - step["sent"],
            "in_flight": self._in_flight(partition),
        }
        last_of_nth = (
            self.where == "sent-last" and step["step"] == self.nth and step["sent"] == step["claimed"]
        )
        nth_several = self.where == "sent-first" and first_of_several and self.several == self.nth
        if (last_of_nth or nth_several) and self._armed():
            self._die(report)

    def on_outbox_settled(
        self, partition: int, published: list[tuple[int, int]], failed: list[OutboxRow]
    ) -> None:
        self.settled += 1
        self.pending.pop(partition, None)
        self._record(event="settled", partition=partition, published=len(published), failed=len(failed))
        if self.where == "stop-settled" and self.settled == self.nth and self._armed():
            self._stop(
                {
                    "where": self.where,
                    "partition": partition,
                    "published": len(published),
                    "failed": len(failed),
                }
            )


def _hooks() -> RelayCrashHooks | None:
    crash = os.environ.get("PSPF_TEST_CRASH")
    events = os.environ.get("PSPF_TEST_EVENTS")
    if not crash and not events:
        return None
    marker = Path(os.environ["PSPF_TEST_MARKER"]) if crash else None
    return RelayCrashHooks(crash, marker, Path(events) if events else None)


def _count(state: dict[str, Any], amount: int) -> None:
    state["count"] = state.get("count", 0) + 1
    state["total"] = state.get("total", 0) + amount


def enrich() -> App:
    """Counts and sums orders per order key, and emits each order to the target, keyed by user."""
    app = App(os.environ["PSPF_TEST_APP"], hooks=_hooks())
    target = os.environ["PSPF_TEST_TARGET"]
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def handle(order: Order, ctx: Context) -> None:
        _count(ctx.state, order.amount)
        ctx.emit(target, {"user": order.user, "amount": order.amount, "n": order.n}, key=order.user)
        if work_s:
            _busy(work_s)

    return app


def total() -> App:
    """Counts and sums the enriched orders per user (the entry's key)."""
    app = App(os.environ["PSPF_TEST_APP"], hooks=_hooks())
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def handle(order: Order, ctx: Context) -> None:
        _count(ctx.state, order.amount)
        if work_s:
            _busy(work_s)

    return app
