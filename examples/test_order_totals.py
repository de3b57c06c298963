"""Tests of the quick-start app (examples/order_totals.py): how to test a PSPF app.

The first test needs no server: ``pspf.testing.TestApp`` runs the app's handler in-process on the
entries it is sent. The second is an integration test: ``pspf_settings``, a fixture PSPF's pytest
plugin gives, points at an embedded server, and a real worker runs the app over it.
"""

from examples.order_totals import app
from pspf import Producer, Settings, Worker
from pspf.service import Service
from pspf.testing import TestApp


def test_totals_per_user() -> None:
    with TestApp(app, partitions=4) as t:
        for user, amount in [("u1", 3), ("u2", 10), ("u1", 4)]:
            t.send("orders", {"amount": amount}, key=user)
        assert t.state("u1") == {"total": 7, "count": 2}
        assert t.state("u2") == {"total": 10, "count": 1}


def test_a_bad_order_goes_to_the_dlq() -> None:
    with TestApp(app) as t:
        t.send("orders", {"price": 3}, key="u1")  # no "amount": the handler raises KeyError
        (dead,) = t.dead_letters("orders")
        assert dead.error_type == "KeyError" and dead.key == "u1"
        assert t.state("u1") == {}


def test_a_worker_against_a_real_server(pspf_settings: Settings) -> None:
    service = Service(pspf_settings, local_state=True)
    service.create_topic("orders", 4)
    with Producer(settings=pspf_settings) as producer:
        for i in range(1, 101):
            producer.send("orders", {"amount": i}, key=f"u{i % 2}")
    Worker(app, pspf_settings).run(until_idle=True)
    assert service.state_get("order-totals", "u1") == {"total": 2500, "count": 50}
    service.close()
