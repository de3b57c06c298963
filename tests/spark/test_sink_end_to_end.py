"""End to end: Spark writes orders with the sink, a PSPF app consumes them, its state is exact."""

from __future__ import annotations

import shutil
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

from pyspark.sql import SparkSession

from pspf import App, Context, Settings, Worker
from pspf.service import Service
from tests.conftest import Names

pytestmark = [pytest.mark.integration, pytest.mark.spark]

ORDERS = 30_000
USERS = 300


def order(i: int) -> tuple[str, int]:
    """The (user, amount) of order ``i``, as the DataFrame below computes it."""
    return f"u{i * 7919 % USERS}", i * 31 % 997 + 1


def test_spark_writes_orders_and_a_pspf_app_totals_them_exactly(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
) -> None:
    topic = make_topic(4)
    df = spark.range(0, ORDERS, numPartitions=3).selectExpr(
        "id as order_id",
        f"concat('u', cast(id * 7919 % {USERS} as string)) as user",
        "id * 31 % 997 + 1 as amount",
    )
    # The key column is also kept in the value (columns=...), as the handler checks it.
    (
        df.write.format("pspf")
        .option("broker", redis_url)
        .option("topic", topic)
        .option("key", "user")
        .option("columns", "order_id,user,amount")
        .option("idempotency_key", "orders-e2e")
        .mode("append")
        .save()
    )

    app = App(names.app())

    @app.handler(topic)
    def add(value: dict[str, Any], ctx: Context) -> None:
        assert ctx.key == value["user"]
        ctx.state["total"] = ctx.state.get("total", 0) + value["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        ctx.state["orders"] = ctx.state.get("orders", 0) ^ value["order_id"]

    settings = make_settings()
    summary = Worker(app, settings).run(until_idle=True)

    assert summary.handled == ORDERS
    expected: dict[str, dict[str, int]] = defaultdict(lambda: {"total": 0, "count": 0, "orders": 0})
    for i in range(ORDERS):
        user, amount = order(i)
        expected[user]["total"] += amount
        expected[user]["count"] += 1
        expected[user]["orders"] ^= i
    assert len(expected) == USERS
    service = Service(settings)
    try:
        state = {user: service.state_get(app.name, user) for user in expected}
    finally:
        service.close()
    assert state == expected
