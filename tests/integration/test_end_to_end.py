"""End to end against a real server: produce, run until idle, check state exactly."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.keys import STATE_NAMESPACE, StreamId, stream_key
from pspf.service import Service
from pspf.state_stores import open_store, stored_partitions
from pspf.worker.process import GC_THRESHOLDS
from tests.conftest import Names
from tests.support.fixtures import MakeAppOnTopic

pytestmark = pytest.mark.integration

ENGINES = ["sqlite", "rocksdb"]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """Every test of this module runs once per state store engine."""
    return str(request.param)


@pytest.fixture
def make_settings(make_settings: Callable[..., Settings], engine: str) -> Callable[..., Settings]:
    """The shared factory, with ``PSPF_STORE`` set to the engine under test."""

    def make(**overrides: Any) -> Settings:
        return make_settings(**{"PSPF_STORE": engine, **overrides})

    return make


class Order(msgspec.Struct):
    user: str
    amount: int


def expected_totals(records: list[tuple[str | None, Any]]) -> dict[str, tuple[int, int]]:
    sums: dict[str, int] = defaultdict(int)
    counts: Counter[str] = Counter()
    for key, value in records:
        assert key is not None
        sums[key] += value["amount"]
        counts[key] += 1
    return {k: (sums[k], counts[k]) for k in sums}


def order_records(n: int, keys: int, seed: int = 7) -> list[tuple[str | None, Any]]:
    rng = random.Random(seed)
    out: list[tuple[str | None, Any]] = []
    for _ in range(n):
        user = f"u{rng.randrange(keys)}"
        out.append((user, {"user": user, "amount": rng.randrange(1, 1000)}))
    return out


def typed_totals_app(name: str, topic: str) -> App:
    app = App(name)

    @app.handler(topic)
    def add(order: Order, ctx: Context) -> None:
        assert ctx.key == order.user
        ctx.state["total"] = ctx.state.get("total", 0) + order.amount
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


def all_state(settings: Settings, app: str, partitions: int) -> dict[str, dict[str, Any]]:
    """The state of every key, read with the engine ``settings`` name (each store must exist)."""
    found: dict[str, dict[str, Any]] = {}
    for p in range(partitions):
        with open_store(settings.state.engine, settings.state.dir, app, p, readonly=True) as store:
            for key, raw in store.items(STATE_NAMESPACE):
                found[key] = msgspec.msgpack.decode(raw)
    return found


def test_typed_handler_exact_state_pending_empty_checkpoint_last_id(
    engine: str,
    app_on_topic: MakeAppOnTopic,
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
) -> None:
    records = order_records(20_000, 500)
    case = app_on_topic(4, records, build=typed_totals_app)
    assert case.produced == 20_000
    topic, app = case.topic, case.app
    settings = make_settings()

    summary = Worker(app, settings).run(until_idle=True)

    assert summary.handled == 20_000
    assert stored_partitions(engine, settings.state.dir, app.name) == [0, 1, 2, 3]
    state = all_state(settings, app.name, 4)
    want = expected_totals(records)
    assert {k: (v["total"], v["count"]) for k, v in state.items()} == want
    for p in range(4):
        stream = stream_key(topic, p)
        assert rclient.xpending(stream, app.name)["pending"] == 0
        last_id = StreamId.parse(rclient.xinfo_stream(stream)["last-generated-id"])
        with open_store(settings.state.engine, settings.state.dir, app.name, p, readonly=True) as store:
            assert store.checkpoints()[topic] == last_id
            assert store.integrity_check() == "ok"
    # The service reads the same state by app name and key.
    key = records[0][0]
    assert key is not None
    got = Service(settings).state_get(app.name, key)
    assert (got["total"], got["count"]) == want[key]


def test_second_run_skips_nothing_and_changes_nothing(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings]
) -> None:
    app = app_on_topic(2, order_records(2_000, 50), build=typed_totals_app).app
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    before = all_state(settings, app.name, 2)

    again = Worker(app, settings).run(until_idle=True)

    assert again.handled == 0
    assert all_state(settings, app.name, 2) == before


def test_the_collector_scans_less_often_while_workers_run_and_as_before_once_the_last_stops(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings]
) -> None:
    """Two workers of one process, the second stopping first: the thresholds stay until both stop."""
    seen: dict[str, set[tuple[int, int, int]]] = {"first": set(), "second": set()}
    second_done = threading.Event()

    def build(name: str, topic: str) -> App:
        app = App(name)

        @app.handler(topic)
        def note(order: dict[str, Any], ctx: Context) -> None:
            seen[name.rsplit("-", 1)[-1]].add(gc.get_threshold())
            if name.endswith("first"):
                assert second_done.wait(30)  # the second worker stops while this one runs
                seen["first"].add(gc.get_threshold())

        return app

    first = app_on_topic(1, order_records(3, 3), build=lambda n, t: build(f"{n}-first", t)).app
    second = app_on_topic(1, order_records(3, 3), build=lambda n, t: build(f"{n}-second", t)).app
    gc.set_threshold(700, 10, 10)
    thread = threading.Thread(target=Worker(first, make_settings()).run, kwargs={"until_idle": True})
    thread.start()
    try:
        Worker(second, make_settings()).run(until_idle=True)
    finally:
        second_done.set()
        thread.join(60)

    assert seen == {"first": {GC_THRESHOLDS}, "second": {GC_THRESHOLDS}}
    assert gc.get_threshold() == (700, 10, 10)


def test_async_handlers_keep_per_key_order_and_exact_state(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings]
) -> None:
    rng = random.Random(3)
    records: list[tuple[str | None, Any]] = [
        (f"k{rng.randrange(20)}", {"seq": i, "amount": 1}) for i in range(3_000)
    ]
    case = app_on_topic(2, records)
    topic, app = case.topic, case.app

    @app.handler(topic)
    async def add(value: dict[str, int], ctx: Context) -> None:
        await asyncio.sleep(0)
        seen = ctx.state.setdefault("seq", [])
        assert not seen or seen[-1] < value["seq"], "per-key order broken"
        seen.append(value["seq"])
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    settings = make_settings()
    Worker(app, settings).run(until_idle=True)

    state = all_state(settings, app.name, 2)
    by_key: dict[str, list[int]] = defaultdict(list)
    for key, value in records:
        assert key is not None
        by_key[key].append(value["seq"])
    assert {k: v["seq"] for k, v in state.items()} == by_key
    assert all(v["count"] == len(by_key[k]) for k, v in state.items())


def test_flat_records_from_any_redis_client(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    for amount in (3, 4, 5):
        rclient.xadd(stream_key(topic, 0), {"key": "u1", "user": "u1", "amount": str(amount)})
    app = App(names.app())

    @app.handler(topic)
    def add(order: Order, ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order.amount

    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    assert Service(settings).state_get(app.name, "u1") == {"total": 12}


def test_start_from_latest_reads_only_new_entries(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings]
) -> None:
    case = app_on_topic(2, order_records(100, 10, seed=1), build=typed_totals_app)
    app = case.app
    settings = make_settings(PSPF_START_FROM="latest")

    assert Worker(app, settings).run(until_idle=True).handled == 0
    later = order_records(30, 10, seed=2)
    case.produce(later)
    assert Worker(app, settings).run(until_idle=True).handled == 30

    state = all_state(settings, app.name, 2)
    assert {k: (v["total"], v["count"]) for k, v in state.items()} == expected_totals(later)


def test_handler_failure_stops_only_its_partition_until_it_succeeds(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    case = app_on_topic(1, [(f"k{i % 3}", {"seq": i}) for i in range(20)])
    topic, app = case.topic, case.app
    attempts: Counter[int] = Counter()

    @app.handler(topic)
    def record(value: dict[str, int], ctx: Context) -> None:
        ctx.state.setdefault("seq", []).append(value["seq"])
        attempts[value["seq"]] += 1
        if value["seq"] == 7 and attempts[7] < 3:
            raise RuntimeError("flaky downstream")

    Worker(app, make_settings(PSPF_RETRY_BASE_MS=10)).run(until_idle=True)

    assert attempts[7] == 3  # retried until it succeeded
    assert all(attempts[i] == 1 for i in range(20) if i != 7)  # the others ran exactly once
    state = all_state(make_settings(), app.name, 1)
    # The failed attempts' writes were dropped; order per key is kept.
    assert state == {f"k{k}": {"seq": [i for i in range(20) if i % 3 == k]} for k in range(3)}
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0


def test_logs_show_checkpoints_as_redis_ids(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = make_topic(1)
    produce(topic, [("u1", {"amount": 1}), ("u2", {"amount": 2})])
    app = App(f"logs-{topic}")

    @app.handler(topic)
    def add(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).handled == 2
    [(last_id, _)] = rclient.xrevrange(stream_key(topic, 0), count=1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pspf"):
        Worker(app, settings).run(until_idle=True)
    assigned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("partition assigned")]
    assert assigned == [
        f"partition assigned app={app.name} partition=0 checkpoints={{{topic!r}: {last_id.decode()}}}"
    ]
    assert "StreamId(" not in caplog.text
