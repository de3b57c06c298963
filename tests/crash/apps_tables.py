"""The enrichment app the tables crash test runs in worker subprocesses
(``pspf run tests.crash.apps_tables:main``).

Orders (keyed by customer) are enriched with the customer's row of the ``customers`` table and the
product's row of the ``products`` global table: each order adds ``qty * price`` to its customer's
revenue, and is emitted to the output topic with the tier and price its lookups saw. A tumbling
one-minute window beside the handler counts each customer's orders (event time: the order's
``ts``) and emits each closed window's count.

Configured by environment variables, read when ``main`` is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the orders topic and the app (consumer group) name;
- ``PSPF_TEST_CUSTOMERS``, ``PSPF_TEST_PRODUCTS``, ``PSPF_TEST_TARGET``, ``PSPF_TEST_COUNTS``:
  the table's topic, the global table's topic, the topic the enriched orders go to and the one
  the window's counts go to;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per order, so kills land mid-stream.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import msgspec

from pspf import App, Context, windows


class Customer(msgspec.Struct):
    tier: str


class Product(msgspec.Struct):
    price: int


class Order(msgspec.Struct):
    n: int
    product: str
    qty: int
    ts: int


def main() -> App:
    env = os.environ
    app = App(env["PSPF_TEST_APP"])
    customers, products = env["PSPF_TEST_CUSTOMERS"], env["PSPF_TEST_PRODUCTS"]
    target = env["PSPF_TEST_TARGET"]
    work_s = int(env.get("PSPF_TEST_WORK_US", "0")) / 1e6
    app.table(customers, value_type=Customer)
    app.global_table(products, value_type=Product)

    @app.handler(env["PSPF_TEST_TOPIC"])
    def enrich(order: Order, ctx: Context) -> None:
        customer: Customer | None = ctx.table(customers)
        product: Product | None = ctx.table(products, key=order.product)
        price = -1 if product is None else product.price
        state: dict[str, Any] = ctx.state
        state["revenue"] = state.get("revenue", 0) + order.qty * price
        state["count"] = state.get("count", 0) + 1
        tier = None if customer is None else customer.tier
        ctx.emit(target, {"n": order.n, "tier": tier, "price": price}, key=ctx.key)
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass

    @app.window(
        env["PSPF_TEST_TOPIC"],
        windows.tumbling(timedelta(minutes=1)),
        timestamp="ts",
        emit_to=env["PSPF_TEST_COUNTS"],
    )
    def per_minute(count: int | None, order: Order) -> int:
        return (count or 0) + 1

    return app


class Flaky(Exception):
    """An order's planned failure."""


def retrying() -> App:
    """Orders looked up in a table while some of them fail (``pspf run tests.crash.apps_tables:retrying``).

    Each order appends ``[n, tier]`` (the tier its lookup saw) to its customer's state. An order
    whose value has ``fail: k`` fails its first ``k`` attempts, counted in Redis
    (``PSPF_TEST_COUNTER_URL``, key ``PSPF_TEST_APP:attempts:n``) so that they add up across
    processes. ``PSPF_TEST_RETRY_MODE``: ``ordered`` or ``deferred``.
    """
    import redis

    from pspf import RetryPolicy

    env = os.environ
    app = App(env["PSPF_TEST_APP"])
    customers = env["PSPF_TEST_CUSTOMERS"]
    app.table(customers, value_type=Customer)
    counter = redis.Redis.from_url(env["PSPF_TEST_COUNTER_URL"])
    prefix = f"{env['PSPF_TEST_APP']}:attempts:"
    work_s = int(env.get("PSPF_TEST_WORK_US", "0")) / 1e6
    delay_ms = 40 if env["PSPF_TEST_RETRY_MODE"] == "ordered" else 400
    policy = RetryPolicy(
        mode=env["PSPF_TEST_RETRY_MODE"],  # type: ignore[arg-type]
        max_retries=3,
        base_delay_ms=delay_ms,
        factor=1.0,
        max_delay_ms=delay_ms,
    )

    @app.handler(env["PSPF_TEST_TOPIC"], retry=policy)
    def enrich(order: dict[str, Any], ctx: Context) -> None:
        if order.get("fail") and int(counter.incr(f"{prefix}{order['n']}")) <= order["fail"]:
            raise Flaky(f"order {order['n']}")
        customer: Customer | None = ctx.table(customers)
        state: dict[str, Any] = ctx.state
        state["seen"] = [*state.get("seen", []), [order["n"], None if customer is None else customer.tier]]
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass

    return app
