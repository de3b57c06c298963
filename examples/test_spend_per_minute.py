"""The spend-per-minute stream app on TestApp: one result per customer and minute, exact."""

from __future__ import annotations

from datetime import timedelta

from examples.spend_per_minute import main
from pspf.testing import TestApp

START = 1_704_067_200_000  # TestApp's clock: 2024-01-01T00:00:00Z


def order(oid: str, customer: str, qty: int, price: float, after_ms: int) -> dict[str, object]:
    return {"oid": oid, "customer": customer, "qty": qty, "price": price, "ts": START + after_ms}


def test_each_customer_gets_one_total_per_minute() -> None:
    with TestApp(main, partitions=2) as t:
        t.send("orders", order("1", "ann", 2, 2.5, 1_000), key="1")
        t.send("orders", order("2", "ann", 0, 9.0, 2_000), key="2")  # no quantity: filtered out
        t.send("orders", order("3", "bob", 1, 4.0, 3_000), key="3")
        t.send("orders", order("4", "ann", 1, 1.0, 40_000), key="4")
        assert t.emitted("spend-per-minute") == []  # the minute is open (and its grace)
        t.advance(timedelta(minutes=5))  # idle partitions close their windows
        results = sorted(t.emitted("spend-per-minute"), key=lambda r: r["key"])
    assert results == [
        {"key": "ann", "start": START, "end": START + 60_000, "total": 6.0, "n": 2},
        {"key": "bob", "start": START, "end": START + 60_000, "total": 4.0, "n": 1},
    ]
