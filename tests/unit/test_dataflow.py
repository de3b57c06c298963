"""The dataflow API (``app.stream``) on ``TestApp``: each step, the aggregations, windows, re-keying."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
import pytest

from pspf import App, ConfigError, Context, agg, windows
from pspf.testing import TestApp

START = 1_704_067_200_000  # TestApp's clock: 2024-01-01T00:00:00Z
MINUTE = 60_000


class Order(msgspec.Struct):
    oid: str
    customer: str
    qty: int
    price: float
    ts: int


def order(oid: str, customer: str, qty: int, price: float, ts: int) -> dict[str, Any]:
    return {"oid": oid, "customer": customer, "qty": qty, "price": price, "ts": ts}


def test_stateless_steps_run_in_order_and_each_branch_gets_every_value() -> None:
    app = App("steps")
    seen: list[Any] = []
    nums = app.stream("nums")
    doubled = nums.filter(lambda v: v["n"] > 0).map(lambda v: v["n"] * 2)
    doubled.update(seen.append).to("doubled")
    doubled.flat_map(lambda n: [n, n + 1]).to("spread")
    nums.map(lambda v, ctx: f"{ctx.key}:{v['n']}").to("labelled")
    with TestApp(app) as t:
        for n in (1, -1, 3):
            t.send("nums", {"n": n}, key=f"k{n}")
        assert t.emitted("doubled") == [2, 6]
        assert seen == [2, 6]
        assert t.emitted("spread") == [2, 3, 6, 7]
        assert t.emitted("labelled") == ["k1:1", "k-1:-1", "k3:3"]
        assert [e.key for e in t.emitted_entries("doubled")] == ["k1", "k3"]


def test_to_with_a_key_function_or_field_re_keys_the_output() -> None:
    app = App("tokeys")
    s = app.stream("in")
    s.to("by-fn", key=lambda v: v["user"].upper())
    s.to("by-field", key="user")
    with TestApp(app) as t:
        t.send("in", {"user": "ann"}, key="x")
        assert [e.key for e in t.emitted_entries("by-fn")] == ["ANN"]
        assert [e.key for e in t.emitted_entries("by-field")] == ["ann"]


def test_apply_keeps_the_keys_state_with_the_entry() -> None:
    app = App("running")

    def running(value: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        state["sum"] = state.get("sum", 0) + value["n"]
        return {"n": value["n"], "sum": state["sum"]}

    app.stream("nums").apply(running).to("sums")
    with TestApp(app) as t:
        for n in (1, 2, 3):
            t.send("nums", {"n": n}, key="a")
        t.send("nums", {"n": 10}, key="b")
        assert [v["sum"] for v in t.emitted("sums")] == [1, 3, 6, 10]
        assert t.state("a") == {"sum": 6}


def test_a_failing_step_fails_the_entry_and_nothing_of_it_is_kept() -> None:
    app = App("failing")

    def boom(value: dict[str, Any]) -> dict[str, Any]:
        if value["n"] == 2:
            raise ValueError("two")
        return value

    def count(value: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        state["n"] = state.get("n", 0) + 1
        return value

    app.stream("nums").apply(count).map(boom).to("out")
    with TestApp(app) as t:
        for n in (1, 2, 3):
            t.send("nums", {"n": n}, key="a")
        assert t.emitted("out") == [{"n": 1}, {"n": 3}]
        assert t.state("a") == {"n": 2}  # the entry that failed counted nothing
        [dead] = t.dead_letters("nums")
        assert "two" in dead.message


def test_group_by_re_keys_through_the_managed_topic_and_later_steps_see_the_new_key() -> None:
    app = App("rekey")

    def per_customer(value: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        state["orders"] = state.get("orders", 0) + 1
        return value

    (
        app.stream("orders", value_type=Order)
        .map(lambda o: {"customer": o.customer, "oid": o.oid})
        .group_by(lambda v: v["customer"], topic="by-customer")
        .apply(per_customer)
        .map(lambda v, ctx: {"key": ctx.key, "oid": v["oid"]})
        .to("seen")
    )
    assert app.managed_topics == ["by-customer"]
    assert set(app.topics) == {"orders", "by-customer"}
    with TestApp(app, partitions=3) as t:
        for i, customer in enumerate(["c1", "c2", "c1", "c3", "c1"]):
            t.send("orders", order(f"o{i}", customer, 1, 1.0, START), key=f"o{i}")
        assert sorted(t.emitted("seen"), key=lambda v: v["oid"]) == [
            {"key": c, "oid": f"o{i}"} for i, c in enumerate(["c1", "c2", "c1", "c3", "c1"])
        ]
        assert t.state("c1") == {"orders": 3}
        assert t.state("c3") == {"orders": 1}
        assert {e.key for e in t.emitted_entries("by-customer")} == {"c1", "c2", "c3"}


def test_the_first_pipeline_totals_each_customer_per_minute_once_per_window() -> None:
    app = App("shop")
    (
        app.stream("orders", value_type=Order)
        .filter(lambda o: o.qty > 0)
        .map(lambda o: {"customer": o.customer, "amount": o.qty * o.price, "ts": o.ts})
        .group_by(lambda v: v["customer"], topic="shop-by-customer")
        .window(windows.tumbling(timedelta(minutes=1)), timestamp="ts")
        .agg(total=agg.Sum("amount"), n=agg.Count())
        .to("spend-per-minute")
    )
    with TestApp(app, partitions=2) as t:
        t.send("orders", order("1", "c1", 2, 1.5, START + 1_000), key="1")
        t.send("orders", order("2", "c1", 0, 9.0, START + 2_000), key="2")  # filtered out
        t.send("orders", order("3", "c1", 1, 4.0, START + 59_999), key="3")
        t.send("orders", order("4", "c1", 1, 1.0, START + MINUTE), key="4")  # closes c1's first
        results = t.emitted("spend-per-minute")
        assert results == [{"key": "c1", "start": START, "end": START + MINUTE, "total": 7.0, "n": 2}]
        t.advance(timedelta(minutes=5))  # the idle partition's windows close
        assert t.emitted("spend-per-minute")[1:] == [
            {"key": "c1", "start": START + MINUTE, "end": START + 2 * MINUTE, "total": 1.0, "n": 1}
        ]


def test_every_aggregation_gives_its_exact_value() -> None:
    app = App("aggs")
    (
        app.stream("m")
        .window(windows.tumbling(timedelta(seconds=10)), timestamp="ts")
        .agg(
            total=agg.Sum("x"),
            n=agg.Count(),
            with_y=agg.Count("y"),
            mean=agg.Mean("x"),
            low=agg.Min("x"),
            high=agg.Max("x"),
            xs=agg.Collect("x"),
            last=agg.Latest("x"),
            product=agg.Reduce(1, lambda acc, x: acc * x, field="x"),
        )
        .to("out")
    )
    with TestApp(app) as t:
        for ts, x, y in ((1, 4, None), (2, 2, 1), (3, 5, 2), (10_000, 0, None)):
            t.send("m", {"ts": START + ts, "x": x, "y": y}, key="k")
        [result] = t.emitted("out")
    assert result == {
        "key": "k",
        "start": START,
        "end": START + 10_000,
        "total": 11,
        "n": 3,
        "with_y": 2,
        "mean": 11 / 3,
        "low": 2,
        "high": 5,
        "xs": [4, 2, 5],
        "last": 5,
        "product": 40,
    }


def test_emit_update_gives_the_windows_result_after_every_value_and_nothing_at_close() -> None:
    app = App("updates")
    (
        app.stream("m")
        .window(windows.hopping(timedelta(seconds=20), timedelta(seconds=10)), timestamp="ts")
        .agg(emit="update", total=agg.Sum("x"))
        .to("out")
    )
    with TestApp(app) as t:
        t.send("m", {"ts": START + 15_000, "x": 1}, key="k")
        t.send("m", {"ts": START + 16_000, "x": 2}, key="k")
        t.send("m", {"ts": START + 95_000, "x": 4}, key="k")  # closes both earlier windows
        got = [(r["start"] - START, r["total"]) for r in t.emitted("out")]
    assert got == [(10_000, 1), (0, 1), (10_000, 3), (0, 3), (90_000, 4), (80_000, 4)]


def test_a_flat_map_giving_one_window_several_values_of_one_entry_folds_them_all() -> None:
    app = App("items")
    (
        app.stream("baskets")
        .flat_map(lambda b: [{"ts": b["ts"], "price": p} for p in b["prices"]])
        .window(windows.tumbling(timedelta(seconds=10)), timestamp="ts")
        .agg(total=agg.Sum("price"), n=agg.Count())
        .to("out")
    )
    with TestApp(app) as t:
        t.send("baskets", {"ts": START + 1, "prices": [1, 2, 3]}, key="u")
        t.send("baskets", {"ts": START + 2, "prices": [10]}, key="u")
        t.send("baskets", {"ts": START + 20_000, "prices": []}, key="u")  # no value: time stays
        t.send("baskets", {"ts": START + 20_000, "prices": [0]}, key="u")
        assert [(r["total"], r["n"]) for r in t.emitted("out")] == [(16, 4)]


def test_a_chains_window_keeps_its_own_stream_time_so_a_re_keyed_entry_is_not_late() -> None:
    """The partition's stream time runs ahead (a plain window on another topic); the chain's does not."""
    app = App("own-time")

    @app.window("clicks", windows.tumbling(timedelta(seconds=10)), emit_to="click-counts")
    def clicks(acc: int | None, value: dict[str, Any]) -> int:
        return (acc or 0) + 1

    (
        app.stream("orders")
        .group_by(lambda v: v["customer"], topic="own-time-by-customer")
        .window(windows.tumbling(timedelta(seconds=10)), timestamp="ts")
        .agg(n=agg.Count())
        .to("counts")
    )
    with TestApp(app) as t:
        t.send("clicks", {"c": 1}, key="c1")
        t.advance(timedelta(hours=1))
        t.send("clicks", {"c": 2}, key="c1")  # the partition's stream time is now an hour on
        t.send("orders", {"customer": "a", "ts": START + 1}, key="o1")
        t.send("orders", {"customer": "a", "ts": START + 10_001}, key="o2")
        assert t.counts.late == 0
        assert t.emitted("counts") == [{"key": "a", "start": START, "end": START + 10_000, "n": 1}]


def test_late_values_are_dropped_and_counted_or_dead_lettered() -> None:
    for late, dead in (("drop", 0), ("dlq", 1)):
        app = App(f"late-{late}")
        (
            app.stream("m")
            .window(windows.tumbling(timedelta(seconds=10)), timestamp="ts", late=late)  # type: ignore[arg-type]
            .agg(n=agg.Count())
            .to("out")
        )
        with TestApp(app) as t:
            t.send("m", {"ts": START + 20_000}, key="k")
            t.send("m", {"ts": START + 1}, key="k")  # its window closed at START + 10,000
            assert t.counts.late == 1 - dead
            assert len(t.dead_letters("m")) == dead


def test_branching_and_concat_merge_two_streams_of_one_app() -> None:
    app = App("merge")
    a = app.stream("a").map(lambda v: {"from": "a", **v})
    b = app.stream("b").map(lambda v: {"from": "b", **v})
    a.concat(b).to("both")
    a.to("only-a")
    with TestApp(app) as t:
        t.send("a", {"n": 1}, key="k")
        t.send("b", {"n": 2}, key="k")
        t.send("a", {"n": 3}, key="k")
        assert t.emitted("both") == [{"from": "a", "n": 1}, {"from": "b", "n": 2}, {"from": "a", "n": 3}]
        assert t.emitted("only-a") == [{"from": "a", "n": 1}, {"from": "a", "n": 3}]


def test_a_stream_runs_beside_the_topics_handler_in_one_attempt() -> None:
    app = App("beside")

    @app.handler("m")
    def handle(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["handled"] = ctx.state.get("handled", 0) + 1

    app.stream("m").filter(lambda v: v["ok"]).to("out")
    with TestApp(app) as t:
        t.send("m", {"ok": True}, key="k")
        t.send("m", {"ok": False}, key="k")
        assert t.state("k") == {"handled": 2}
        assert t.emitted("out") == [{"ok": True}]


def test_bad_values_for_steps_go_to_the_dlq_without_retries() -> None:
    app = App("bad")
    app.stream("m").group_by(lambda v: v.get("k"), topic="bad-by-k").to("out")
    second = windows.tumbling(timedelta(seconds=1))
    app.stream("w").window(second, timestamp="ts").agg(s=agg.Sum("x")).to("o2")
    with TestApp(app) as t:
        t.send("m", {"k": 1.5}, key="a")  # not a str or int
        t.send("w", {"ts": START, "x": "a string"}, key="a")
        t.send("w", {"ts": START}, key="a")  # no field x
        dead = t.dead_letters()
        assert sorted(d.attempts for d in dead) == [1, 1, 1]
        assert any("must be a str or an int" in d.message for d in dead)
        assert any("is not a number" in d.message for d in dead)
        assert any("has no field 'x'" in d.message for d in dead)


@pytest.mark.parametrize(
    ("declare", "message"),
    [
        (lambda s: s.window(windows.tumbling(timedelta(seconds=1))).agg(), "at least one aggregation"),
        (lambda s: s.window(windows.tumbling(timedelta(seconds=1))).agg(key=agg.Count()), "field of every"),
        (lambda s: s.window(windows.tumbling(timedelta(seconds=1))).agg(n=len), "from pspf.agg"),
        (
            lambda s: s.window(windows.session(timedelta(seconds=1))).agg(r=agg.Reduce(0, max)),
            "needs merge=",
        ),
        (lambda s: s.window(windows.tumbling(timedelta(seconds=1))).agg(emit="often", n=agg.Count()), "emit"),
        (lambda s: s.map(lambda a, b, c: a), "must take (value) or (value, ctx)"),
        (lambda s: s.apply(lambda v: v), "must take (value, state)"),
        (lambda s: s.filter(3), "expected a function"),
        (lambda s: s.group_by(lambda v: v, topic="bad name!"), "topic"),
        (lambda s: s.window("tumbling"), "must come from pspf.windows"),
    ],
)
def test_declarations_a_stream_cannot_run_are_refused_at_once(declare: Any, message: str) -> None:
    app = App("refused")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        declare(app.stream("m"))


def test_steps_after_a_final_result_take_no_ctx_and_keep_no_state() -> None:
    for after in (
        lambda s: s.map(lambda v, ctx: v).to("out"),
        lambda s: s.apply(lambda v, state: v).to("out"),
        lambda s: s.window(windows.tumbling(timedelta(seconds=1))).agg(n=agg.Count()).to("out"),
    ):
        app = App("after-final")
        results = app.stream("m").window(windows.tumbling(timedelta(seconds=1))).agg(n=agg.Count())
        after(results)
        with pytest.raises(ConfigError, match="after a final window result"):
            TestApp(app)


def test_one_stream_per_topic_and_window_names_are_unique() -> None:
    app = App("names")
    assert app.stream("m")._node is app.stream("m")._node
    app.stream("m", value_type=Order)
    with pytest.raises(ConfigError, match="one stream per topic"):
        app.stream("m", value_type=dict)
    spec = windows.tumbling(timedelta(seconds=1))
    app.stream("m").window(spec, name="w").agg(n=agg.Count())
    with pytest.raises(ConfigError, match="already has a window named 'w'"):
        app.stream("m").window(spec, name="w").agg(n=agg.Count())
    app.stream("m").window(spec).agg(n=agg.Count())
    assert sorted(app.windows) == ["m.window-2", "w"]
    app.table("t")
    with pytest.raises(ConfigError, match="already read by a table"):
        app.stream("t")


def test_pspf_describe_prints_the_topology_and_refuses_a_chain_that_cannot_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from pspf.cli import cli

    shown = CliRunner().invoke(cli, ["describe", "examples.spend_per_minute:main"])
    assert shown.exit_code == 0, shown.output
    assert "stream orders (Order)" in shown.output
    assert "group_by(topic='spend-by-customer', key=<lambda>)" in shown.output
    assert "total=agg.Sum('amount'), n=agg.Count()" in shown.output
    assert "re-keying topics: spend-by-customer" in shown.output
    as_json = CliRunner().invoke(cli, ["describe", "examples.spend_per_minute:main", "--json"])
    described = msgspec.json.decode(as_json.output)
    assert described["managed_topics"] == ["spend-by-customer"]
    assert described["outputs"] == ["spend-per-minute"]
    (tmp_path / "bad_chain.py").write_text(
        "from datetime import timedelta\n"
        "from pspf import App, agg, windows\n"
        "main = App('bad')\n"
        "(main.stream('m').window(windows.tumbling(timedelta(seconds=1))).agg(n=agg.Count())\n"
        " .map(lambda v, ctx: v).to('out'))\n"
    )
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(cli, ["describe", "bad_chain:main"])
    assert refused.exit_code == 2
    assert "after a final window result" in refused.output
    assert "Traceback" not in refused.output


def count_app(spec: Any, emit: str = "final") -> App:
    app = App("counts")
    (
        app.stream("m")
        .window(spec, timestamp="ts")
        .agg(emit=emit, xs=agg.Collect("x"))  # type: ignore[arg-type]
        .to("out")
    )
    return app


def test_tumbling_count_windows_close_when_full_with_their_first_and_last_entrys_times() -> None:
    with TestApp(count_app(windows.tumbling_count(3)), partitions=2) as t:
        for i in range(8):
            for key in ("a", "b"):
                t.send("m", {"ts": START + 1_000 * i + (key == "b"), "x": i}, key=key)
        t.advance(timedelta(hours=1))  # a window that is not full stays open
        got = sorted((r["key"], r["start"] - START, r["end"] - START, r["xs"]) for r in t.emitted("out"))
    assert got == [
        ("a", 0, 2_000, [0, 1, 2]),
        ("a", 3_000, 5_000, [3, 4, 5]),
        ("b", 1, 2_001, [0, 1, 2]),
        ("b", 3_001, 5_001, [3, 4, 5]),
    ]


def test_hopping_count_windows_start_every_step_entries_and_emit_update_gives_each_change() -> None:
    with TestApp(count_app(windows.hopping_count(3, 2))) as t:
        for i in range(7):
            t.send("m", {"ts": START + i, "x": i}, key="k")
        assert [r["xs"] for r in t.emitted("out")] == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    with TestApp(count_app(windows.tumbling_count(2), emit="update")) as t:
        for i in range(3):
            t.send("m", {"ts": START + i, "x": i}, key="k")
        assert [r["xs"] for r in t.emitted("out")] == [[0], [0, 1], [2]]


def test_count_windows_survive_a_reload_of_the_partitions_store() -> None:
    from pspf.state_stores.memory import MemoryStore
    from pspf.windows.aggregation import PartitionWindows

    app = count_app(windows.tumbling_count(3))
    [window] = app.windows.values()
    store = MemoryStore()
    found: list[Any] = []

    class Out:
        def result(self, topic: str, key: str, value: Any, source: Any, partition: int) -> Any:
            found.append(value)
            return value

    app.compile()
    state = PartitionWindows.load(store, {window.name: window})
    for i in range(5):
        if i in (2, 4):  # a restart: everything comes back from the store
            state = PartitionWindows.load(store, {window.name: window})
        state.apply([state.change(window, "k", START + i, {"x": i}, f"{i}-1".encode())])
        state.close(Out(), 0)  # type: ignore[arg-type]
        store.write(state.writes(), {})
        state.committed()
    assert [v["xs"] for v in found] == [[0, 1, 2]]
    assert state.open[window.name].counts == {"k": 5}  # type: ignore[attr-defined]


def test_count_windows_are_a_stream_step_and_take_one_value_per_entry() -> None:
    app = App("refused-count")
    with pytest.raises(ConfigError, match="count windows are a step of a stream"):
        app.window("m", windows.tumbling_count(2), emit_to="out")(lambda acc, v: v)
    with pytest.raises(ConfigError, match="step 3 is larger than n 2"):
        windows.hopping_count(2, 3)
    with pytest.raises(ConfigError, match="whole number of entries"):
        windows.tumbling_count(0)
    app.stream("m").flat_map(lambda v: [v, v]).window(windows.tumbling_count(4)).agg(n=agg.Count()).to("o")
    with TestApp(app) as t:
        t.send("m", {"x": 1}, key="k")
        [dead] = t.dead_letters("m")
        assert "takes one value per entry" in dead.message and dead.attempts == 1


def interval_pairs(
    lefts: list[tuple[str, int, int]], rights: list[tuple[str, int, int]], within: int
) -> set[tuple[int, int]]:
    """(left n, right n) of every left and right of one key at most ``within`` apart."""
    return {(ln, rn) for lk, lt, ln in lefts for rk, rt, rn in rights if lk == rk and abs(lt - rt) <= within}


def test_join_interval_emits_every_pair_within_once_whichever_side_comes_second() -> None:
    import random

    rng = random.Random(5)
    app = App("joins")
    orders, payments = app.stream("orders"), app.stream("payments")
    orders.join_interval(payments, within=timedelta(seconds=30), timestamp="ts").to("pairs")
    orders.join_interval(
        payments, within=timedelta(seconds=30), timestamp="ts", merge=lambda o, p: [o["n"], p["n"]], name="m"
    ).to("merged")
    lefts: list[tuple[str, int, int]] = []
    rights: list[tuple[str, int, int]] = []
    with TestApp(app, partitions=2) as t:
        for n in range(300):  # in event time order: none late
            key, ts = f"k{rng.randrange(4)}", START + n * 1_000
            if rng.random() < 0.5:
                lefts.append((key, ts, n))
                t.send("orders", {"n": n, "ts": ts}, key=key)
            else:
                rights.append((key, ts, n))
                t.send("payments", {"n": n, "ts": ts}, key=key)
        pairs = [(p["left"]["n"], p["right"]["n"]) for p in t.emitted("pairs")]
        merged = [tuple(m) for m in t.emitted("merged")]
        assert t.counts.late == 0
    assert len(pairs) == len(set(pairs))
    assert set(pairs) == interval_pairs(lefts, rights, 30_000) == set(merged)
    assert len(pairs) > 100


def test_a_join_value_whose_interval_closed_is_late_and_joins_nothing() -> None:
    app = App("late-join")
    app.stream("a").join_interval(app.stream("b"), within=timedelta(seconds=10), timestamp="ts").to("out")
    with TestApp(app) as t:
        t.send("a", {"ts": START + 100_000}, key="k")
        t.send("b", {"ts": START + 95_000}, key="k")  # on time: 95 s + 10 s >= 100 s
        t.send("b", {"ts": START + 50_000}, key="k")  # late: its interval closed at 60 s
        t.send("a", {"ts": START + 55_000}, key="k")  # late too (it would meet the 50 s one)
        assert [(p["left"]["ts"], p["right"]["ts"]) for p in t.emitted("out")] == [
            (START + 100_000, START + 95_000)
        ]
        assert t.counts.late == 2


def test_join_sides_are_kept_in_the_store_and_forgotten_once_nothing_on_time_can_meet_them() -> None:
    from pspf.state_stores.memory import MemoryStore
    from pspf.windows.aggregation import PartitionWindows

    app = App("kept")
    app.stream("a").join_interval(app.stream("b"), within=timedelta(seconds=10), timestamp="ts").to("out")
    app.compile()
    left, right = app.windows["a.join-1.left"], app.windows["a.join-1.right"]
    windows = {w.name: w for w in (left, right)}
    store = MemoryStore()
    state = PartitionWindows.load(store, windows)
    state.apply([state.change(left, "k", 1_000, {"x": 1}, b"1-0")])
    store.write(state.writes(), {})
    state.committed()
    again = PartitionWindows.load(store, windows)  # a restart
    assert [kept[:2] for kept in again.open[left.name].entries["k"]] == [(1_000, b"1-0")]  # type: ignore[attr-defined]
    again.apply([again.change(right, "k", 21_001, {"y": 1}, b"2-0")])  # 1 s + 2 x 10 s + 1 ms later
    again.close(None, 0)  # type: ignore[arg-type]
    store.write(again.writes(), {})
    again.committed()
    assert "k" not in again.open[left.name].entries  # type: ignore[attr-defined]
    assert [k for ns, k in store._values if ns == "__windows" and "/e/" in k and k.startswith("a:")] == []


def tier_app() -> App:
    """The third pipeline: orders enriched with the customer's tier as of the order's time."""
    app = App("tiers")
    customers = app.table("customers", versioned=timedelta(days=7), timestamp="ts")
    (
        app.stream("orders")
        .join_asof(
            customers,
            timestamp="ts",
            merge=lambda order, customer: {"oid": order["oid"], "tier": customer and customer["tier"]},
        )
        .to("orders-with-tier")
    )
    return app


def test_join_asof_gives_each_order_the_row_current_at_its_time_among_updates_before_it() -> None:
    day = 86_400_000
    with TestApp(tier_app(), partitions=2) as t:
        t.send("orders", {"oid": "o0", "ts": START}, key="c1")  # no row yet
        t.send("customers", {"tier": "silver", "ts": START - day}, key="c1")
        t.send("customers", {"tier": "gold", "ts": START + 2 * day}, key="c1")
        t.send("orders", {"oid": "o1", "ts": START}, key="c1")  # silver then
        t.send("orders", {"oid": "o2", "ts": START + 3 * day}, key="c1")  # gold
        t.send("customers", {"tier": "bronze", "ts": START + day}, key="c1")  # a late update
        t.send("orders", {"oid": "o3", "ts": START + day + 1}, key="c1")  # sees the late update
        t.send("orders", {"oid": "o4", "ts": START - 2 * day}, key="c1")  # before any row
        t.send("customers", None, key="c1")  # deleted at its entry's time (the test clock)
        t.send("orders", {"oid": "o5", "ts": START + 2 * day}, key="c1")
        t.send("orders", {"oid": "o6", "ts": START - day}, key="c2")
        got = [(r["oid"], r["tier"]) for r in t.emitted("orders-with-tier")]
        assert t.table("customers", "c1") is None
    assert got == [
        ("o0", None),
        ("o1", "silver"),
        ("o2", "gold"),
        ("o3", "bronze"),
        ("o4", None),
        ("o5", "gold"),  # the delete took the entry's id time, at START, before this order's time
        ("o6", None),
    ]


def test_versions_keep_the_retention_and_the_row_current_at_its_start() -> None:
    from pspf.tables import versions

    kept = versions.merged(None, [(0, 1, 0, b"a"), (50, 2, 0, b"b"), (60, 3, 0, None)], retention_ms=100)
    kept = versions.merged(kept, [(200, 4, 0, b"c")], retention_ms=100)
    assert versions.decode(kept) == [(200, 4, 0, b"c")]  # at 100 (the cutoff) there was no row
    kept = versions.merged(kept, [(150, 5, 0, b"d"), (90, 6, 0, b"e")], retention_ms=100)
    assert [v[0] for v in versions.decode(kept)] == [90, 150, 200]
    found = versions.decode(kept)
    assert versions.as_of(found, 149, None) == b"e"
    assert versions.as_of(found, 160, None) == b"d"
    assert versions.as_of(found, 160, before=versions.StreamId(5, 0)) == b"d"  # by entry 5-0: seen
    assert versions.as_of(found, 160, before=versions.StreamId(4, 9)) is None  # 90 and 150 came later
    assert versions.as_of(found, 200, before=versions.StreamId(4, 9)) == b"c"
    assert versions.as_of(found, 89, None) is None


def test_lookups_as_of_a_time_need_a_versioned_table_of_the_app() -> None:
    app = App("asof-refused")
    plain = app.table("plain")
    with pytest.raises(ConfigError, match="is not a versioned table"):
        app.stream("orders").join_asof(plain)
    with pytest.raises(ConfigError, match="timestamp= is for a versioned table"):
        app.table("other", timestamp="ts")
    elsewhere = App("elsewhere").table("customers", versioned=timedelta(days=1))
    app.stream("orders").join_asof(elsewhere).to("out")
    with pytest.raises(ConfigError, match="joins table 'customers', which it does not declare"):
        TestApp(app)
    looked = App("at-plain")
    looked.table("plain")

    @looked.handler("orders")
    def handle(value: dict[str, Any], ctx: Context) -> None:
        ctx.table("plain", at=1)

    with TestApp(looked) as t:
        t.send("orders", {}, key="k")
        [dead] = t.dead_letters("orders")
        assert "table 'plain' is not versioned" in dead.message


def test_a_typed_sides_kept_values_come_back_as_its_type() -> None:
    app = App("typed-join")
    orders = app.stream("orders", value_type=Order)
    orders.join_interval(
        app.stream("payments"),
        within=timedelta(minutes=5),
        timestamp="ts",
        merge=lambda order, payment: {"oid": order.oid, "paid": payment["amount"]},
    ).to("paid")
    with TestApp(app) as t:
        t.send("orders", order("o1", "c1", 1, 2.0, START), key="c1")  # kept, then read back as Order
        t.send("payments", {"amount": 2.0, "ts": START + 1_000}, key="c1")
        t.send("payments", {"amount": 3.0, "ts": START + 2_000}, key="c1")
        t.send("orders", order("o2", "c1", 1, 2.0, START + 3_000), key="c1")
        assert t.emitted("paid") == [
            {"oid": "o1", "paid": 2.0},
            {"oid": "o1", "paid": 3.0},
            {"oid": "o2", "paid": 2.0},
            {"oid": "o2", "paid": 3.0},
        ]
