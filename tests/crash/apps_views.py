"""The app the views crash tests run in worker subprocesses (``pspf run tests.crash.apps_views:main``).

Per key it keeps ``{"count": entries, "total": sum of amounts}`` (the state ``tests.crash.support``
reads) and two views of it: a hash (``HASH``) whose field ``key`` holds the total as JSON, and a
sorted set (``ZSET``) whose member ``key`` scores the total. For the keys ``deletes`` picks, the
hash field is deleted when the count reaches a multiple of ``DELETE_EVERY`` and set again by the
key's next entry, so deletes go through the same path as writes.

Configured by environment variables, read when ``main`` is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_HASH``, ``PSPF_TEST_ZSET``: the two views' names (their Redis keys), unique per test;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream;
- ``PSPF_TEST_KILL_AT``: N: the process kills itself with SIGKILL in ``on_ack`` of the first
  acknowledgement whose reply says that N entries in all are acknowledged (counted from
  ``on_acknowledging``), so after the acknowledgement of its last batch and before the cycle's
  publish step writes that batch's views. Once: ``PSPF_TEST_MARKER`` names the marker file that
  says it happened; it holds the keys the handler saw in that acknowledgement's batches.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import msgspec

from pspf import App, Context
from pspf.hooks import ProcessorHooks

#: A picked key's hash field is absent while its count is a multiple of this.
DELETE_EVERY = 7


class Order(msgspec.Struct):
    amount: int


def deletes(key: str) -> bool:
    """Whether the app deletes ``key``'s hash field at every ``DELETE_EVERY``-th entry (half the keys)."""
    return int(key.lstrip("k")) % 2 == 0


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class KillAfterAck(ProcessorHooks):
    """SIGKILL in ``on_ack`` once ``kill_at`` entries are acknowledged, before their views are written.

    An acknowledgement's reply is read (``on_ack``) before the next one is built, so the keys the
    handler saw since the previous ``on_acknowledging`` are those of the batches ``on_ack`` confirms.
    """

    def __init__(self, kill_at: int, marker: Path) -> None:
        self.kill_at, self.marker = kill_at, marker
        self.requested = 0
        self.handled: list[str] = []  # keys handled since the last acknowledgement was built
        self.acking: list[str] = []  # keys of the batches the acknowledgement in flight carries

    def on_acknowledging(self, entries: dict[str, int]) -> None:
        self.requested += sum(entries.values())
        self.acking, self.handled = self.handled, []

    def on_ack(self, seconds: float) -> None:
        if self.requested >= self.kill_at and not self.marker.exists():
            report = {"pid": os.getpid(), "acknowledged": self.requested, "keys": sorted(set(self.acking))}
            self.marker.write_text(json.dumps(report))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is delivered before this returns


def main() -> App:
    hash_view, zset_view = os.environ["PSPF_TEST_HASH"], os.environ["PSPF_TEST_ZSET"]
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6
    kill_at = os.environ.get("PSPF_TEST_KILL_AT")
    hooks = KillAfterAck(int(kill_at), Path(os.environ["PSPF_TEST_MARKER"])) if kill_at else None
    app = App(os.environ["PSPF_TEST_APP"], hooks=hooks)
    app.view(hash_view)
    app.view(zset_view, kind="zset")

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: Order, ctx: Context) -> None:
        state = ctx.state
        count = state["count"] = state.get("count", 0) + 1
        total = state["total"] = state.get("total", 0) + order.amount
        key = ctx.key
        totals, board = ctx.view(hash_view), ctx.view(zset_view)
        if deletes(key) and count % DELETE_EVERY == 0:
            del totals[key]
        else:
            totals[key] = total  # a number: JSON text in the hash
        board.add(key, total)
        if work_s:
            _busy(work_s)
        if hooks is not None:
            hooks.handled.append(key)

    return app
