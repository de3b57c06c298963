"""Tables through ``TestApp``: rows, tombstones, typed rows, lookups' rules, declarations."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import msgspec
import pytest

from pspf import App, Context, windows
from pspf.errors import ConfigError
from pspf.keys import partition_for
from pspf.tables.table import TableError
from pspf.testing import TestApp


class Customer(msgspec.Struct):
    tier: str


def enrich_app() -> App:
    app = App("shop")
    app.table("customers", value_type=Customer)
    app.global_table("products")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        customer = ctx.table("customers")
        product = ctx.table("products", key=value["product"])
        seen = [None if customer is None else customer.tier, None if product is None else product["price"]]
        ctx.state["seen"] = [*ctx.state.get("seen", []), seen]

    return app


def test_rows_typed_updated_and_deleted_as_their_topic_says() -> None:
    with TestApp(enrich_app(), partitions=2, topics={"products": 3}) as t:
        t.send("orders", {"product": "p1"}, key="c1")
        t.send("customers", {"tier": "gold"}, key="c1")
        t.send("products", {"price": 5}, key="p1")
        t.send("orders", {"product": "p1"}, key="c1")
        t.send("customers", {"tier": "silver"}, key="c1")
        t.send("orders", {"product": "p1"}, key="c1")
        t.send("customers", None, key="c1")  # a tombstone
        t.send("orders", {"product": "p2"}, key="c1")
        assert t.state("c1")["seen"] == [[None, None], ["gold", 5], ["silver", 5], [None, None]]
        assert t.table("customers", "c1") is None
        assert t.table("products", "p1") == {"price": 5}
        assert t.table("customers", "c2") is None


def test_a_row_that_does_not_decode_goes_to_the_dlq_at_once_and_keeps_the_old_row() -> None:
    with TestApp(enrich_app(), partitions=1) as t:
        t.send("customers", {"tier": "gold"}, key="c1")
        t.send("customers", {"rank": 3}, key="c1")
        assert t.table("customers", "c1") == Customer("gold")
        [dead] = t.dead_letters("customers")
        assert dead.attempts == 1 and "tier" in dead.message


def test_a_key_of_another_partition_and_an_undeclared_table_fail_their_entry_clearly() -> None:
    app = App("shop")
    app.table("customers")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.table(value["table"], key=value.get("key"))

    other = next(
        k for k in (f"k{i}" for i in range(50)) if partition_for(k.encode(), 4) != partition_for(b"c1", 4)
    )
    with TestApp(app, partitions=4, settings=None) as t:
        t.send("orders", {"table": "customers", "key": other}, key="c1")
        t.send("orders", {"table": "nope"}, key="c1")
        first, second = t.dead_letters("orders")
    assert first.error_type == "TableError"
    assert f"is in partition {partition_for(other.encode(), 4)}" in first.message
    assert f"this entry's partition is {partition_for(b'c1', 4)}" in first.message
    assert second.error_type == "TableError" and "no table 'nope'" in second.message


def test_timers_look_rows_up_by_key_of_their_partition() -> None:
    app = App("shop")
    app.table("customers")

    @app.timer(timedelta(seconds=10))
    def tally(ctx: Any) -> None:
        row = ctx.table("customers", "c1")
        if row is not None:
            ctx.state("c1")["tier"] = row["tier"]

    with TestApp(app, partitions=1) as t:
        t.send("customers", {"tier": "gold"}, key="c1")
        t.advance(timedelta(seconds=11))
        assert t.state("c1") == {"tier": "gold"}


def test_a_table_update_moves_no_windows_stream_time() -> None:
    """Its id is the time it was added, not an event time: it must close no window."""
    app = App("shop")
    app.table("customers")

    @app.window("orders", windows.tumbling(timedelta(minutes=1)), timestamp="ts", emit_to="counts")
    def per_minute(count: int | None, order: dict[str, Any]) -> int:
        return (count or 0) + 1

    with TestApp(app, partitions=1) as t:
        t.send("orders", {"ts": 1000}, key="c1")
        t.send("customers", {"tier": "gold"}, key="c1")
        t.send("orders", {"ts": 2000}, key="c1")
        assert t.counts.late == 0 and t.emitted("counts") == []


def test_declarations_that_clash_are_refused_in_one_line() -> None:
    app = App("shop")
    app.table("customers")
    with pytest.raises(ConfigError, match="'customers' is already read by a table"):
        app.global_table("customers")

    @app.handler("orders")
    def order(value: Any, ctx: Context) -> None: ...

    with pytest.raises(ConfigError, match="'orders' is already read by a handler"):
        app.table("orders")
    with pytest.raises(ConfigError, match="cannot decode its rows"):
        app.table("other", value_type=object())
    assert issubclass(TableError, ConfigError)


def test_a_scheduled_callback_sees_the_latest_row() -> None:
    app = App("shop")
    app.table("customers")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.schedule(timedelta(seconds=5), "remind")

    @app.on_schedule("remind")
    def remind(payload: Any, ctx: Context) -> None:
        row = ctx.table("customers")
        ctx.state["reminded_tier"] = None if row is None else row["tier"]

    with TestApp(app, partitions=1) as t:
        t.send("orders", {}, key="c1")
        t.send("customers", {"tier": "gold"}, key="c1")  # added after the order, before the call
        t.advance(timedelta(seconds=6))
        t.send("orders", {}, key="c2")  # moves stream time past the schedule
        assert t.state("c1") == {"reminded_tier": "gold"}


def test_an_undeclared_table_and_a_global_table_without_a_key_fail_at_once_without_retries() -> None:
    """A configuration mistake: trying the entry again cannot help, so its first failure is its last."""
    app = App("shop")
    app.global_table("products")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.table(value["table"])  # a name only known at run time: checked when looked up

    with TestApp(app, partitions=1) as t:
        t.send("orders", {"table": "nope"}, key="c1")
        t.send("orders", {"table": "products"}, key="c1")
        undeclared, keyless = t.dead_letters("orders")
    assert (undeclared.error_type, undeclared.attempts) == ("TableError", 1)
    assert "no table 'nope'" in undeclared.message
    assert (keyless.error_type, keyless.attempts) == ("TableError", 1)
    assert "'products' is a global table" in keyless.message and "key=" in keyless.message


def test_a_handler_naming_an_undeclared_table_literally_is_refused_before_any_entry() -> None:
    app = App("shop")
    app.table("customers")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["tier"] = ctx.table("customer")  # a typo

    with pytest.raises(ConfigError) as refused:
        TestApp(app, partitions=1)
    message = str(refused.value)
    assert "\n" not in message
    assert "looks up table 'customer', which app 'shop' does not declare" in message
    assert "(its tables: 'customers')" in message
    assert f"test_tables.py:{order.__code__.co_firstlineno + 2}" in message


def test_literal_names_of_declared_tables_and_other_calls_named_table_pass() -> None:
    app = App("shop")
    app.table("customers")
    app.global_table("products")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.table("customers")
        ctx.table("products", key="p1")
        value.get("table", "not a lookup")

    @app.on_schedule("remind")
    def remind(payload: Any, ctx: Context) -> None:
        ctx.table("customers")

    with TestApp(app, partitions=1) as t:
        t.send("orders", {}, key="c1")
        assert t.dead_letters("orders") == []


@pytest.mark.parametrize("overlapped", [True, False], ids=["one-server", "cluster"])
def test_global_tables_are_looked_at_every_cycle_while_updates_come_then_less_often(
    monkeypatch: pytest.MonkeyPatch, overlapped: bool
) -> None:
    """A look is a round trip: a quiet table is looked at every QUIET_LOOK_S, not every cycle.

    On one server a look is sent in one cycle and applied in the next (its round trip overlaps
    the batch); on a cluster it is read at once.
    """
    from types import SimpleNamespace

    from pspf.state_stores.memory import MemoryStore
    from pspf.tables import global_tables
    from pspf.tables.global_tables import QUIET_LOOK_S, GlobalTables
    from pspf.tables.table import Table

    clock = [100.0]
    monkeypatch.setattr(global_tables.time, "monotonic", lambda: clock[0])
    pending = [[(b"1-0", {b"key": b"a", b"value": b"1"})], [(b"2-0", {b"key": b"b", b"value": b"2"})]]
    looks: list[float] = []

    def read_after(positions: dict[str, Any], count: int) -> list[tuple[str, list[Any]]]:
        looks.append(clock[0])
        return [(stream, pending.pop(0)) for stream in positions] if pending else []

    def send_read_after(positions: dict[str, Any], count: int) -> Any:
        if not overlapped:
            return None
        found = read_after(positions, count)
        return SimpleNamespace(take=lambda: found)

    reading = SimpleNamespace(read_after=read_after, send_read_after=send_read_after)
    broker: Any = SimpleNamespace(reading=reading)
    tables = GlobalTables([Table("rates", Any, True)], MemoryStore(), broker, {"rates": 1})
    applied = [tables.follow_between() for _ in range(4)]
    assert applied == ([0, 1, 1, 0] if overlapped else [1, 1, 0, 0])  # the 4th only waits
    assert len(looks) == 3
    assert tables.row("rates", "b") is not None
    clock[0] += QUIET_LOOK_S / 2
    assert tables.follow_between() == 0
    assert len(looks) == 3
    clock[0] += QUIET_LOOK_S
    tables.follow_between()
    assert len(looks) == 4


def test_a_handler_that_changes_a_looked_up_row_changes_only_its_own_copy() -> None:
    """A looked-up row is the handler's own: a change to it (a value, a list inside) reaches no later one."""
    app = App("copies")
    app.table("customers")
    app.global_table("products")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        customer = ctx.table("customers")
        product = ctx.table("products", key=value["product"])
        ctx.state["seen"] = [*ctx.state.get("seen", []), copy.deepcopy([customer, product])]
        customer["tier"] = "changed"  # a plain row
        product["tags"].append("changed")  # a row holding a list
        product["price"] = -1

    with TestApp(app, partitions=1) as t:
        t.send("customers", {"tier": "gold", "since": 2020}, key="c1")
        t.send("products", {"price": 5, "tags": ["new"]}, key="p1")
        for _ in range(3):
            t.send("orders", {"product": "p1"}, key="c1")
        t.send("customers", {"tier": "silver", "since": 2020}, key="c1")
        t.send("orders", {"product": "p1"}, key="c1")
        gold = {"tier": "gold", "since": 2020}
        product = {"price": 5, "tags": ["new"]}
        assert t.state("c1")["seen"] == [
            [gold, product],
            [gold, product],
            [gold, product],
            [{"tier": "silver", "since": 2020}, product],
        ]
        assert t.table("customers", "c1") == {"tier": "silver", "since": 2020}


def test_rows_looked_up_often_show_each_update_of_their_table_and_global_table() -> None:
    """A row looked up again and again is kept decoded in memory: an update of it still shows at once."""
    app = App("updates")
    app.table("customers")
    app.global_table("products")

    @app.handler("orders")
    def order(value: dict[str, Any], ctx: Context) -> None:
        customer, product = ctx.table("customers"), ctx.table("products", key="p1")
        seen = [None if customer is None else customer["tier"], None if product is None else product["price"]]
        ctx.state["seen"] = [*ctx.state.get("seen", []), seen]

    with TestApp(app, partitions=1) as t:
        t.send("customers", {"tier": "gold"}, key="c1")
        t.send("products", {"price": 5}, key="p1")
        for _ in range(3):
            t.send("orders", {}, key="c1")
        t.send("products", {"price": 7}, key="p1")
        t.send("orders", {}, key="c1")
        t.send("customers", {"tier": "silver"}, key="c1")
        t.send("products", None, key="p1")
        t.send("orders", {}, key="c1")
        assert t.state("c1")["seen"] == [["gold", 5], ["gold", 5], ["gold", 5], ["gold", 7], ["silver", None]]
