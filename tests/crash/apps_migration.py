"""The apps the state migration crash tests run in worker subprocesses (``pspf run MODULE:v1`` ...).

One app name, two versions of its state, as an order-totals app that changes its money to cents:

- ``v1``: ``state_type=TotalsV1``; ``ctx.state["t"]`` holds the sum of the key's amounts;
- ``v2``: ``state_type=TotalsV2``; ``ctx.state["t"]`` holds the sum in cents and the count of the
  entries it handled, and ``@app.migrate_state(TotalsV1)`` turns a total into cents (x100). The
  migration is not idempotent: a key migrated twice would show its old total x10000;
- ``v2_unmigrated``: ``v2`` without the migration, which a worker must refuse to start over v1 state.

Configured by environment variables, read when the target is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from pspf import App, Context


class Order(msgspec.Struct):
    amount: int


class TotalsV1(msgspec.Struct):
    total: int


class TotalsV2(msgspec.Struct):
    total_cents: int
    orders: int = 0


def to_cents(old: dict[str, Any]) -> dict[str, Any]:
    """A key's v1 state as v2: each total in cents, no order counted yet."""
    return {name: TotalsV2(total_cents=value.total * 100) for name, value in old.items()}


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _work() -> float:
    return int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6


def v1() -> App:
    app = App(os.environ["PSPF_TEST_APP"], state_type=TotalsV1)
    work_s = _work()

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: Order, ctx: Context) -> None:
        old = ctx.state.get("t")
        ctx.state["t"] = TotalsV1(total=(0 if old is None else old.total) + order.amount)
        if work_s:
            _busy(work_s)

    return app


def v2_unmigrated() -> App:
    app = App(os.environ["PSPF_TEST_APP"], state_type=TotalsV2)
    work_s = _work()

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: Order, ctx: Context) -> None:
        old = ctx.state.get("t") or TotalsV2(total_cents=0)
        ctx.state["t"] = TotalsV2(total_cents=old.total_cents + order.amount * 100, orders=old.orders + 1)
        if work_s:
            _busy(work_s)

    return app


def v2() -> App:
    app = v2_unmigrated()
    app.migrate_state(TotalsV1)(to_cents)
    return app
