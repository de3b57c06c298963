"""Tests of examples/enrich_orders.py with ``pspf.testing.TestApp``: tables filled by sending."""

from examples.enrich_orders import app
from pspf.testing import TestApp

TOPICS = {"products": 1, "enriched-orders": 4}


def test_an_order_is_enriched_with_the_rows_current_when_it_came() -> None:
    with TestApp(app, partitions=4, topics=TOPICS) as t:
        t.send("products", {"price": 30}, key="p1")
        t.send("customers", {"name": "Ada", "tier": "gold"}, key="c1")
        t.send("orders", {"product": "p1", "qty": 2}, key="c1")
        t.send("customers", None, key="c1")  # deleted: later orders see no customer
        t.send("orders", {"product": "p1", "qty": 1}, key="c1")
        assert t.state("c1") == {"revenue": 90}
        assert t.emitted("enriched-orders") == [
            {"customer": "c1", "tier": "gold", "revenue": 60},
            {"customer": "c1", "tier": None, "revenue": 30},
        ]


def test_an_order_of_an_unknown_product_goes_to_the_dlq() -> None:
    with TestApp(app, partitions=4, topics=TOPICS) as t:
        t.send("orders", {"product": "p9", "qty": 1}, key="c1")
        (dead,) = t.dead_letters("orders")
        assert dead.error_type == "LookupError" and "p9" in dead.message
