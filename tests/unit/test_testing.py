"""pspf.testing.TestApp: an app's handlers, emits, failures and time, in-process with no server."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from pspf import App, ConfigError, Context, NonRetryableError, NotFound, RetryPolicy, TimerContext, windows
from pspf.cycle.timekeeping import Clock
from pspf.keys import partition_for
from pspf.testing import EmittedEntry, TestApp

START = 1_704_067_200_000  # 2024-01-01T00:00:00Z, TestApp's default clock


class Order(msgspec.Struct):
    amount: int


class Total(msgspec.Struct):
    amount: int = 0


def totals_app() -> App:
    app = App("totals")

    @app.handler("orders")
    def add(order: dict, ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        if ctx.state["total"] >= 100 and not ctx.state.get("vip"):
            ctx.state["vip"] = True
            ctx.emit("vip-customers", {"user": ctx.key, "total": ctx.state["total"]}, key=ctx.key)

    return app


def test_state_and_emits_of_sent_entries() -> None:
    with TestApp(totals_app(), partitions=4, topics={"vip-customers": 2}) as t:
        ids = [
            t.send("orders", {"amount": a}, key=k) for k, a in [("u1", 60), ("u2", 5), ("u1", 50), ("u1", 1)]
        ]
        assert t.state("u1") == {"total": 111, "vip": True}
        assert t.state("u2") == {"total": 5}
        assert t.state("nobody") == {}
        assert t.keys() == ["u1", "u2"]
        assert t.emitted("vip-customers") == [{"user": "u1", "total": 110}]
        (entry,) = t.emitted_entries("vip-customers")
        assert entry.key == "u1" and entry.partition == partition_for(b"u1", 2)
        assert t.counts.handled == 4 and t.counts.failed == 0
    # Ids as Redis gives them: the clock's milliseconds, a sequence within one millisecond.
    assert ids[0] == f"{START}-0"
    assert t.dead_letters() == []


def test_an_undeclared_output_topic_fails_the_entry_as_a_worker_would() -> None:
    with TestApp(totals_app(), settings=None) as t:
        t.send("orders", {"amount": 500}, key="u1")
        (dead,) = t.dead_letters("orders")
    assert dead.error_type == "EmitError"
    assert "'vip-customers' does not exist" in dead.message
    assert t.state("u1") == {}  # the failed attempts' writes are dropped
    with pytest.raises(NotFound, match="does not exist"):
        t.emitted("vip-customers")


def flaky_app(failures: int, retry: RetryPolicy | None = None) -> tuple[App, list[int]]:
    app = App("flaky", retry=retry, non_retryable=(KeyError,))
    calls: list[int] = []

    @app.handler("in")
    def handle(value: dict, ctx: Context) -> None:
        calls.append(ctx.delivery_count)
        ctx.state["seen"] = ctx.state.get("seen", 0) + 1
        ctx.emit("out", value)
        if value.get("missing"):
            raise KeyError("missing")
        if len(calls) <= failures:
            raise RuntimeError(f"attempt {len(calls)} fails")

    return app, calls


def test_a_failed_attempt_is_retried_and_its_writes_and_emits_are_dropped() -> None:
    app, calls = flaky_app(failures=2)
    with TestApp(app, topics={"out": 1}) as t:
        t.send("in", {"n": 1}, key="k")
        assert calls == [1, 2, 3]  # the delivery count the handler sees grows with each attempt
        assert t.state("k") == {"seen": 1}
        assert t.emitted("out") == [{"n": 1}]
        assert t.counts.retried == 2 and t.counts.handled == 1 and t.dead_letters() == []


def test_retries_end_in_the_dlq_with_the_policy_attempts_and_the_traceback() -> None:
    app, calls = flaky_app(failures=100, retry=RetryPolicy(max_retries=4))
    with TestApp(app, topics={"out": 1}) as t:
        entry_id = t.send("in", {"n": 1}, key="k")
        (dead,) = t.dead_letters()
    assert len(calls) == 4
    assert (dead.attempts, dead.error_type, dead.source_id, dead.key) == (4, "RuntimeError", entry_id, "k")
    assert "attempt 4 fails" in dead.message and "raise RuntimeError" in dead.traceback
    assert dead.app == "flaky" and msgspec.json.decode(dead.original[b"value"]) == {"n": 1}
    assert t.state("k") == {} and t.emitted("out") == []


def test_a_parked_entry_is_retried_as_due_until_it_is_handled_as_a_worker_counts_it() -> None:
    app, calls = flaky_app(failures=2, retry=RetryPolicy(mode="deferred", max_retries=5))
    with TestApp(app, topics={"out": 1}) as t:
        t.send("in", {"n": 1}, key="k")
        second = t.send("in", {"n": 2}, key="k")
        assert calls == [1, 2, 3, 1]
        assert t.state("k") == {"seen": 2}
        assert t.counts.parked == 2 and t.counts.retried == 0 and t.counts.handled == 2
        assert t.emitted("out") == [{"n": 1}, {"n": 2}]
        assert second.endswith("-1")


def test_non_retryable_errors_and_undecodable_values_go_to_the_dlq_at_once() -> None:
    app, calls = flaky_app(failures=0)

    @app.handler("typed")
    def typed(order: Order, ctx: Context) -> None:
        ctx.state["amount"] = order.amount

    with TestApp(app, topics={"out": 1}) as t:
        t.send("in", {"missing": True}, key="a")
        t.send("typed", {"amount": "lots"}, key="b")
        t.send("typed", b"not json", key="c")
        t.send("typed", {"amount": 3}, key="d")
        assert [(d.error_type, d.attempts) for d in t.dead_letters()] == [
            ("KeyError", 1),
            ("DecodeError", 1),
            ("DecodeError", 1),
        ]
        assert len(calls) == 1 and t.state("d") == {"amount": 3}
        with pytest.raises(ConfigError, match="no handler for topic 'nope'"):
            t.send("nope", {})


def test_nonretryable_error_class_and_raw_fields_from_other_producers() -> None:
    app = App("raw")

    @app.handler("in")
    def handle(value: dict, ctx: Context) -> None:
        if value["user"] == "bad":
            raise NonRetryableError("refused")
        ctx.state["amount"] = value["amount"]

    with TestApp(app, partitions=3) as t:
        # A flat record, as `XADD stream * key u1 user u1 amount 3` writes it.
        t.send_fields("in", {b"key": b"u1", b"user": b"u1", b"amount": b"3"})
        t.send("in", {"user": "bad"}, key="u2")
        assert t.state("u1") == {"amount": "3"}
        assert [d.error_type for d in t.dead_letters()] == ["NonRetryableError"]


def test_an_app_reading_what_it_emits_handles_it_in_turn() -> None:
    app = App("chain")

    @app.handler("words")
    def split(line: str, ctx: Context) -> None:
        for word in line.split():
            ctx.emit("counts", word, key=word)

    @app.handler("counts")
    def count(word: str, ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    with TestApp(app, partitions=2) as t:
        t.send("words", "a b a", key="line1")
        t.send("words", "b a", key="line2")
        assert {k: t.state(k) for k in ("a", "b")} == {"a": {"n": 3}, "b": {"n": 2}}
        assert t.emitted("counts") == ["a", "b", "a", "b", "a"]


def test_async_handlers_and_typed_state() -> None:
    app = App("typed", state_type=Total)

    @app.handler("orders")
    async def add(order: dict, ctx: Context) -> None:
        await asyncio.sleep(0)
        ctx.state["t"] = Total(ctx.state.get("t", Total()).amount + order["amount"])

    with TestApp(app) as t:
        for amount in (1, 2, 3):
            t.send("orders", {"amount": amount}, key="u")
        assert t.state("u") == {"t": Total(6)}


def test_tumbling_windows_close_on_stream_time_and_when_the_partition_is_idle() -> None:
    app = App("clicks")

    @app.window("clicks", windows.tumbling(timedelta(minutes=1)), timestamp="at", emit_to="per-minute")
    def count(acc: int, click: dict) -> int:
        return (acc or 0) + 1

    minute = 60_000
    with TestApp(app) as t:
        for at in (START + 1, START + 2, START + minute + 5):
            t.send("clicks", {"at": at}, key="page")
        # The entry of the second minute closed the first.
        assert t.emitted("per-minute") == [{"key": "page", "start": START, "end": START + minute, "value": 2}]
        t.send("clicks", {"at": START + 10}, key="page")  # its window closed: late, not applied
        assert t.counts.late == 1
        t.advance(timedelta(seconds=29))
        assert len(t.emitted("per-minute")) == 1
        t.advance(timedelta(seconds=1))  # PSPF_WINDOW_IDLE_CLOSE_MS (30 s) with no entry
        assert t.emitted("per-minute")[1] == {
            "key": "page",
            "start": START + minute,
            "end": START + 2 * minute,
            "value": 1,
        }


def test_timers_run_once_per_partition_and_period_as_the_clock_moves() -> None:
    app = App("ticks")
    runs: list[tuple[int, int]] = []

    @app.handler("in")
    def handle(value: int, ctx: Context) -> None:
        ctx.state["v"] = value

    @app.timer(every=timedelta(seconds=10))
    def tick(ctx: TimerContext) -> None:
        runs.append((ctx.partition, ctx.time_ms))
        for key in ("k1", "k2"):
            if partition_for(key.encode(), 2) == ctx.partition:
                ctx.state(key)["ticks"] = ctx.state(key).get("ticks", 0) + 1
                ctx.emit("ticks", {"key": key, "at": ctx.time_ms}, key=key)

    with TestApp(app, partitions=2, topics={"ticks": 1}) as t:
        t.advance(timedelta(seconds=9))  # the period the partitions were taken in
        assert sorted(runs) == [(0, START), (1, START)]
        t.advance(timedelta(seconds=31))
        periods = [START + s * 1000 for s in (0, 10, 20, 30, 40)]
        assert sorted(runs) == sorted((p, at) for p in (0, 1) for at in periods)
        assert t.state("k1") == {"ticks": 5} and t.state("k2") == {"ticks": 5}
        assert len(t.emitted("ticks")) == 10
        t.advance(to=datetime(2024, 1, 1, 0, 1, tzinfo=UTC))  # periods 50 s and 60 s
        assert t.state("k1") == {"ticks": 7} and len(runs) == 14
        with pytest.raises(ConfigError, match="only moves forward"):
            t.advance(to=START)


def test_scheduled_callbacks_run_when_stream_time_reaches_them() -> None:
    app = App("reminders")
    fired: list[tuple[str, str]] = []

    @app.handler("carts")
    def cart(value: dict, ctx: Context) -> None:
        ctx.state["items"] = ctx.state.get("items", 0) + 1
        ctx.schedule(timedelta(minutes=30), "abandoned", {"items": ctx.state["items"]})

    @app.on_schedule("abandoned")
    def abandoned(payload: dict, ctx: Context) -> None:
        fired.append((ctx.key, str(payload["items"])))
        ctx.emit("reminders", {"user": ctx.key, "items": payload["items"]}, key=ctx.key)

    with TestApp(app, topics={"reminders": 1}) as t:
        t.send("carts", {}, key="u1")
        t.advance(timedelta(minutes=10))
        t.send("carts", {}, key="u1")  # replaces the schedule: due 30 min after this entry
        t.advance(timedelta(minutes=25))
        t.send("carts", {}, key="u2")  # stream time: 35 min; u1's callback is due at 40
        assert fired == []
        t.advance(timedelta(minutes=6))
        t.send("carts", {}, key="u3")
        assert fired == [("u1", "2")]
        assert t.emitted("reminders") == [{"user": "u1", "items": 2}]


def test_state_ttl_expires_keys_on_the_test_clock() -> None:
    app = App("sessions", state_ttl=timedelta(hours=1))

    @app.handler("events")
    def seen(value: dict, ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    with TestApp(app) as t:
        t.send("events", {}, key="old")
        t.advance(timedelta(minutes=50))
        t.send("events", {}, key="fresh")
        t.advance(timedelta(minutes=20))
        assert t.state("old") == {} and t.state("fresh") == {"n": 1}


def test_the_harness_moves_only_its_own_clock_and_refuses_bad_arguments() -> None:
    app = totals_app()
    with pytest.raises(ConfigError, match="no time zone"):
        TestApp(app, start=datetime(2024, 1, 1))
    with pytest.raises(ConfigError, match="partitions must be at least 1"):
        TestApp(app, partitions=0)
    t = TestApp(app, start=datetime(2030, 5, 1, tzinfo=UTC))
    assert t.now_ms == int(datetime(2030, 5, 1, tzinfo=UTC).timestamp() * 1000)
    with pytest.raises(ConfigError, match="either by= or to="):
        t.advance()
    assert abs(Clock().wall_ms() - datetime.now(UTC).timestamp() * 1000) < 60_000
    assert isinstance(EmittedEntry("t", 0, None, 1, {}), EmittedEntry)


def test_keyless_entries_go_to_the_partitions_in_turn() -> None:
    app = App("keyless")

    @app.handler("in")
    def echo(value: int, ctx: Context) -> None:
        ctx.emit("out", {"n": value, "from": ctx.partition})  # no key: this entry's partition

    with TestApp(app, partitions=3, topics={"out": 3}) as t:
        for n in range(6):
            t.send("in", n)
        assert [e["from"] for e in t.emitted("out")] == [0, 1, 2, 0, 1, 2]
        assert [e.partition for e in t.emitted_entries("out")] == [0, 1, 2, 0, 1, 2]


def test_headers_that_are_not_a_json_object_of_strings_go_to_the_dlq_unread() -> None:
    """Checked when the entry is decoded, as the worker does, not when a handler reads them."""
    app = App("headers")

    @app.handler("in")
    def handle(value: dict, ctx: Context) -> None:
        ctx.state["n"] = value["n"]

    with TestApp(app) as t:
        for key, headers in (
            ("a", b"not json"),
            ("b", b'["a list"]'),
            ("c", b'{"n": 1}'),
            ("d", b'{"ok": "1"}'),
        ):
            t.send_fields("in", {b"key": key.encode(), b"value": b'{"n": 1}', b"headers": headers})
        dead = t.dead_letters()
        assert [(d.key, d.error_type, d.attempts) for d in dead] == [(k, "DecodeError", 1) for k in "abc"]
        assert all(d.message.startswith("cannot decode headers") for d in dead), [d.message for d in dead]
        assert [t.state(k) for k in "abcd"] == [{}, {}, {}, {"n": 1}]
