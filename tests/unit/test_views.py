"""Views (``app.view``, ``ctx.view``, ``Stream.to_view``) through ``TestApp``: what they hold and refuse."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from pspf import App, Context, RetryPolicy
from pspf.errors import ConfigError
from pspf.outbox.views import PartitionViews, ViewWrite
from pspf.testing import TestApp


def _totals_app() -> App:
    app = App("views")
    app.view("shop:totals")
    app.view("board", kind="zset")

    @app.handler("orders")
    def add(order: dict[str, Any], ctx: Context) -> None:
        state = ctx.state
        state["total"] = state.get("total", 0) + order["amount"]
        ctx.view("shop:totals")[ctx.key] = state["total"]
        ctx.view("board").add(ctx.key, state["total"])
        if order.get("drop"):
            del ctx.view("shop:totals")[ctx.key]
            ctx.view("board").remove(ctx.key)
        if order["amount"] < 0:
            raise ValueError("a refund is not an order")

    return app


def test_a_view_holds_each_fields_last_value_and_a_failed_entrys_writes_are_dropped() -> None:
    t = TestApp(_totals_app())
    t.send("orders", {"amount": 3}, key="u1")
    t.send("orders", {"amount": 4}, key="u1")
    t.send("orders", {"amount": 5}, key="u2")
    t.send("orders", {"amount": -9}, key="u2")  # fails to the DLQ: its view writes never happen

    assert t.view("shop:totals") == {"u1": "7", "u2": "5"}
    assert t.view("board") == {"u1": 7.0, "u2": 5.0}
    assert len(t.dead_letters("orders")) == 1


def test_a_deleted_field_and_a_removed_member_are_gone() -> None:
    t = TestApp(_totals_app())
    t.send("orders", {"amount": 3}, key="u1")
    t.send("orders", {"amount": 1, "drop": True}, key="u1")
    t.send("orders", {"amount": 2}, key="u2")

    assert t.view("shop:totals") == {"u2": "2"}
    assert t.view("board") == {"u2": 2.0}


def test_values_are_text_as_given_and_json_otherwise() -> None:
    app = App("values")
    app.view("last")

    @app.handler("events")
    def keep(event: dict[str, Any], ctx: Context) -> None:
        ctx.view("last")[ctx.key] = event["v"]

    t = TestApp(app)
    for key, value in [("s", "plain text"), ("d", {"a": [1, 2]}), ("n", 2.5), ("b", True)]:
        t.send("events", {"v": value}, key=key)
    assert t.view("last") == {"s": "plain text", "d": '{"a":[1,2]}', "n": "2.5", "b": "true"}


def test_a_stream_writes_a_view_by_field_and_value_functions() -> None:
    app = App("flow-views")
    app.view("latest")
    app.view("scores", kind="zset")
    orders = app.stream("orders")
    orders.filter(lambda o: o["amount"] > 0).to_view("latest", field="user", value=lambda o: o["item"])
    orders.to_view("scores", field="user", value="amount")

    t = TestApp(app)
    t.send("orders", {"user": "u1", "item": "tea", "amount": 2}, key="k1")
    t.send("orders", {"user": "u2", "item": "jam", "amount": 0}, key="k2")
    t.send("orders", {"user": "u1", "item": "cake", "amount": 5}, key="k3")

    assert t.view("latest") == {"u1": "cake"}
    assert t.view("scores") == {"u1": 5.0, "u2": 0.0}


def test_a_stream_writing_an_undeclared_view_is_refused_when_compiled() -> None:
    app = App("undeclared")
    app.stream("orders").to_view("nowhere")
    with pytest.raises(ConfigError, match="writes view 'nowhere', which it does not declare"):
        app.compile()


def test_a_handler_writing_an_undeclared_view_fails_its_entry() -> None:
    app = App("typo")
    app.view("totals")

    @app.handler("orders")
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.view("total")[ctx.key] = 1

    t = TestApp(app)
    t.send("orders", {}, key="u1")
    (dead,) = t.dead_letters("orders")
    assert "no view 'total'" in dead.message


@pytest.mark.parametrize(
    ("name", "kind", "error"),
    [
        ("pspf:mine", "hash", "PSPF's own keys"),
        ("", "hash", "non-empty"),
        ("two\nlines", "hash", "non-empty line"),
        ("fine", "list", "kind must be 'hash' or 'zset'"),
    ],
)
def test_bad_view_names_and_kinds_are_refused(name: str, kind: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        App("bad").view(name, kind)


def test_bad_scores_and_fields_fail_the_entry_not_the_run() -> None:
    app = App("bad-writes")
    app.view("board", kind="zset")

    @app.handler("orders")
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.view("board").add(order["member"], order["score"])

    t = TestApp(app)
    t.send("orders", {"member": "m", "score": "high"}, key="a")
    t.send("orders", {"member": ["m"], "score": 1}, key="b")
    t.send("orders", {"member": "m", "score": 3}, key="c")
    assert [d.error_type for d in t.dead_letters("orders")] == ["TypeError", "TypeError"]
    assert t.view("board") == {"m": 3.0}


def _commit(views: PartitionViews, *writes: ViewWrite) -> dict[tuple[str, str], bytes | None]:
    found, updates = views.staged(list(writes))
    views.committed(found)
    return updates


def test_writes_go_out_once_acknowledged_even_when_each_batch_rewrites_the_same_fields() -> None:
    views = PartitionViews({"v": "hash"})
    first = _commit(views, ("v", "f", "1"), ("v", "g", "1"), ("v", "f", "0"))
    assert list(first) == [("__views", f"{1:020d}")]
    assert not views.ready  # committed, not yet acknowledged
    views.confirm()
    second = _commit(views, ("v", "f", "2"))  # the next batch rewrites f, unacknowledged
    assert views.ready
    upto, writes = views.take()  # commit 1's values (its last of f), not held back by commit 2
    assert (upto, writes) == (1, {"v": {"f": "0", "g": "1"}})
    assert not views.ready  # sent: not again
    views.written(upto)
    third = _commit(views, ("v", "h", "3"), ("v", "g", None))
    assert third[("__views", f"{1:020d}")] is None  # row 1 is done: deleted with commit 3
    views.confirm()
    assert views.take() == (3, {"v": {"f": "2", "h": "3", "g": None}})
    # A new owner applies the rows left in order: each field's latest value, every one to write.
    store = {**first, **second, **third}
    rows = sorted((name, raw) for (_, name), raw in store.items() if raw is not None)
    loaded = PartitionViews.load({"v": "hash"}, rows)
    assert loaded.ready
    assert loaded.take() == (3, {"v": {"f": "2", "h": "3", "g": None}})


def test_the_other_kinds_writes_fail_the_entry() -> None:
    app = App("kinds")
    app.view("h")
    app.view("z", kind="zset")

    @app.handler("orders")
    def add(order: dict[str, Any], ctx: Context) -> None:
        if order["wrong"] == "hash":
            ctx.view("h").add("m", 1)
        else:
            ctx.view("z")["f"] = 1

    t = TestApp(app)
    t.send("orders", {"wrong": "hash"}, key="a")
    t.send("orders", {"wrong": "zset"}, key="b")
    assert [d.message for d in t.dead_letters("orders")] == [
        "view 'h' is a hash: view[field] = value",
        "view 'z' is a sorted set: view.add(member, score)",
    ]


def test_a_scheduled_callback_that_fails_leaves_no_view_writes_and_one_that_returns_keeps_them() -> None:
    app = App("reminders")
    app.view("reminded")

    @app.handler("carts")
    def cart(value: dict[str, Any], ctx: Context) -> None:
        ctx.view("reminded")[f"{ctx.key}:seen"] = 1
        ctx.schedule(timedelta(minutes=30), "remind", {"fail": value.get("fail", False)})

    @app.on_schedule("remind")
    def remind(payload: dict[str, Any], ctx: Context) -> None:
        ctx.view("reminded")[ctx.key] = "yes"
        if payload["fail"]:
            raise RuntimeError("the mailer is down")

    with TestApp(app) as t:
        t.send("carts", {}, key="u1")
        t.send("carts", {"fail": True}, key="u2")
        t.advance(timedelta(minutes=31))
        t.send("carts", {}, key="u3")  # stream time passes both callbacks
        assert t.view("reminded") == {"u1:seen": "1", "u2:seen": "1", "u3:seen": "1", "u1": "yes"}


def test_an_app_whose_handlers_have_a_deadline_keeps_its_tables_and_views() -> None:
    """A deadline runs each entry on a source of its own: a table's updates still reach the batch."""
    app = App("deadline", retry=RetryPolicy(timeout_ms=5_000))
    app.table("customers")
    app.view("tiers")

    @app.handler("orders")
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.view("tiers")[ctx.key] = ctx.table("customers")["tier"]

    with TestApp(app) as t:
        t.send("customers", {"tier": "gold"}, key="u1")
        t.send("orders", {"amount": 1}, key="u1")
        assert t.table("customers", "u1") == {"tier": "gold"}
        assert t.view("tiers") == {"u1": "gold"}
        assert t.dead_letters() == []
