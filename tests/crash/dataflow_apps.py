"""The dataflow apps the dataflow crash tests run in worker subprocesses
(``pspf run tests.crash.dataflow_apps:spend``, and ``:pipelines`` of three pipelines in one app).

The spend pipeline of ``tests.integration.test_dataflow``' ``spend_app`` (the first pipeline of
the dataflow how-to), step for step: orders with a positive quantity, mapped to their amount,
re-keyed by customer through a managed topic, summed and counted per customer in tumbling
one-minute windows (event time: the order's ``ts``, a grace of ten minutes), each closed window's
result to the output topic. The filter also burns a little CPU per order, so kills land
mid-stream.

Configured by environment variables, read when ``spend`` (or ``pipelines``) is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the orders topic and the app (consumer group) name;
- ``PSPF_TEST_REKEY``: the re-keying topic (``group_by``; the app creates it);
- ``PSPF_TEST_TARGET``: the topic the window results go to;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per order;
- ``PSPF_TEST_CRASH`` and ``PSPF_TEST_MARKER``: a named crash point ``WHERE:N`` of the outbox
  relay (``claimed``, ``sent-first``, ``sent-last``) where the process SIGKILLs itself once, and
  the marker file that says it did (``tests.crash.apps_outbox.RelayCrashHooks``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from pspf import App, Stream, agg, windows
from tests.crash.apps_outbox import RelayCrashHooks


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _app() -> App:
    """The app of ``PSPF_TEST_APP``, with the relay's crash hooks if ``PSPF_TEST_CRASH`` is set."""
    crash = os.environ.get("PSPF_TEST_CRASH")
    hooks = RelayCrashHooks(crash, Path(os.environ["PSPF_TEST_MARKER"]), None) if crash else None
    return App(os.environ["PSPF_TEST_APP"], hooks=hooks)


def _spend(orders: Stream) -> None:
    """The spend pipeline over ``orders``, to ``PSPF_TEST_TARGET`` (the module's docstring)."""
    env = os.environ
    work_s = int(env.get("PSPF_TEST_WORK_US", "0")) / 1e6

    def positive(order: dict[str, Any]) -> bool:
        if work_s:
            _busy(work_s)
        return bool(order["qty"] > 0)

    (
        orders.filter(positive)
        .map(lambda o: {"customer": o["customer"], "amount": o["qty"] * o["price"], "ts": o["ts"]})
        .group_by(lambda v: v["customer"], topic=env["PSPF_TEST_REKEY"])
        .window(windows.tumbling(timedelta(minutes=1)), timestamp="ts", grace=timedelta(minutes=10))
        .agg(total=agg.Sum("amount"), n=agg.Count())
        .to(env["PSPF_TEST_TARGET"])
    )


def spend() -> App:
    app = _app()
    _spend(app.stream(os.environ["PSPF_TEST_TOPIC"]))
    return app


def pipelines() -> App:
    """The three pipelines of the dataflow how-to in one app (``tests.crash.test_dataflow_pipelines_crash``).

    Orders keyed by customer feed three chains: the spend pipeline of ``spend`` (filtered, mapped,
    re-keyed by customer through the managed topic, summed and counted in tumbling one-minute
    windows with a grace of ten minutes, each closed window's result to ``PSPF_TEST_TARGET``);
    an interval join with the payments (``PSPF_TEST_PAYMENTS``) within five minutes, each pair
    ``{"oid", "pid"}`` to ``PSPF_TEST_PAIRS``; and an as-of join with the versioned table of the
    customers' tiers (``PSPF_TEST_CUSTOMERS``, event time ``ts``), each order's
    ``{"oid", "tier"}`` to ``PSPF_TEST_TIERS``. The other variables are those of ``spend``.
    """
    env = os.environ
    app = _app()
    orders = app.stream(env["PSPF_TEST_TOPIC"])  # the app's first topic: it holds the backups
    payments = app.stream(env["PSPF_TEST_PAYMENTS"])
    customers = app.table(env["PSPF_TEST_CUSTOMERS"], versioned=timedelta(days=7), timestamp="ts")
    _spend(orders)
    (
        orders.join_interval(
            payments,
            within=timedelta(minutes=5),
            timestamp="ts",
            merge=lambda order, payment: {"oid": order["oid"], "pid": payment["pid"]},
        ).to(env["PSPF_TEST_PAIRS"])
    )
    (
        orders.join_asof(
            customers,
            timestamp="ts",
            merge=lambda order, customer: {"oid": order["oid"], "tier": customer and customer["tier"]},
        ).to(env["PSPF_TEST_TIERS"])
    )
    return app
