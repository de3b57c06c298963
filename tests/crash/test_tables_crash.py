"""SIGKILL workers of an enrichment app at random on two state dirs: every order enriched once,
with the row that was current at its entry, and a window beside the handler counts exactly."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf.keys import StreamId, partition_for, stream_key
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import held_by, no_leases
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ORDERS = 6000
UPDATES = 1500
PRODUCTS = 50
KILLS = 6
LEASE_TTL_MS = 1000
WORK_US = 300
TARGET = "tests.crash.apps_tables:main"


def _add(pipe: Any, topic: str, partitions: int, key: str, value: Any) -> None:
    stream = stream_key(topic, partition_for(key.encode(), partitions))
    pipe.xadd(stream, {b"key": key.encode(), b"value": msgspec.json.encode(value)})


def test_random_sigkills_on_two_state_dirs_enrich_every_order_once_with_its_current_rows(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    orders, customers, target = make_topic(PARTITIONS), make_topic(PARTITIONS), make_topic(PARTITIONS)
    counts = make_topic(PARTITIONS)
    products, app = make_topic(3), names.app()
    prices = {f"p{i}": rng.randrange(1, 100) for i in range(PRODUCTS)}
    pipe = rclient.pipeline(transaction=False)
    for product, price in prices.items():
        _add(pipe, products, 3, product, {"price": price})
    pipe.execute()
    # Orders and customer updates (tombstones among them) interleaved; ids give the order.
    users = [f"c{i}" for i in range(40)]
    kinds = ["order"] * ORDERS + ["update"] * UPDATES
    rng.shuffle(kinds)
    sent: list[tuple[str, str, Any]] = []
    pipe = rclient.pipeline(transaction=True)  # one MULTI per chunk: ids in the order of the calls
    for n, kind in enumerate(kinds):
        user = rng.choice(users)
        if kind == "order":
            product = rng.choice(list(prices))
            value: Any = {"n": n, "product": product, "qty": rng.randrange(1, 5), "ts": n * 1000}
            _add(pipe, orders, PARTITIONS, user, value)
        else:
            value = None if rng.random() < 0.25 else {"tier": rng.choice(["gold", "silver", "bronze"])}
            _add(pipe, customers, PARTITIONS, user, value)
        sent.append((kind, user, value))
        if len(pipe) >= 500:
            ids = pipe.execute()
            _stamp(sent, ids)
    _stamp(sent, pipe.execute())
    expected = _expected(sent, prices)

    env = {
        "PSPF_TEST_CUSTOMERS": customers,
        "PSPF_TEST_PRODUCTS": products,
        "PSPF_TEST_TARGET": target,
        "PSPF_TEST_COUNTS": counts,
        "PSPF_TEST_WORK_US": str(WORK_US),
    }
    options = ["--batch-size", "50", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
    options += ["--broker", spawn.redis_url]
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]

    def published() -> int:
        return sum(rclient.xlen(stream_key(target, partition)) for partition in range(PARTITIONS))

    mid_stream = []  # per kill: whether orders were still left to enrich when it landed
    for life in range(KILLS):
        if published() >= ORDERS * 0.7:
            break  # leave work for the final run: it must pick up where the kills left off
        where = ["--state-dir", str(dirs[life % 2])]
        worker = spawn(
            f"life{life}", orders, app, *options, *where, env=env, cli_settings=False, target=TARGET
        )
        wait_until(
            lambda w=worker: held_by(rclient, orders, app, PARTITIONS, w.pid) or not w.alive(),
            timeout=LEASE_TTL_MS / 1000 + 15,
            what="the worker to take every partition",
        )
        time.sleep(rng.uniform(0.1, 0.8))
        assert worker.alive(), f"worker exited by itself\n{worker.tail()}"
        assert worker.kill9() == -9
        mid_stream.append(published() < ORDERS)
    assert any(mid_stream), "the kills should land mid-stream"
    wait_until(lambda: no_leases(rclient, orders, app, PARTITIONS), 10, "the dead worker's leases to expire")
    final = spawn(
        "final",
        orders,
        app,
        *options,
        "--state-dir",
        str(dirs[2]),
        "--until-idle",
        env=env,
        cli_settings=False,
        target=TARGET,
    )
    assert final.wait(timeout=120) == 0, final.tail()
    handled, _, failures = final.summary()
    assert failures == 0
    assert handled < ORDERS + UPDATES, "the killed workers should have handled some entries"

    # Every order emitted exactly once, with the tier and price current at its entry.
    emitted: Counter[int] = Counter()
    seen: dict[int, tuple[str | None, int]] = {}
    for partition in range(PARTITIONS):
        for _, fields in rclient.xrange(stream_key(target, partition)):
            value = msgspec.json.decode(fields[b"value"])
            emitted[value["n"]] += 1
            seen[value["n"]] = (value["tier"], value["price"])
    assert [n for n, count in emitted.items() if count != 1] == []
    assert seen == expected["seen"]
    # Revenue per customer exact, in the state backup the last owner left (kept under the app's
    # first topic: not a table's).
    revenue = _backup_revenue(rclient, orders, app)
    assert revenue == expected["revenue"]
    # Every window that stream time closed emitted its count exactly once.
    results: Counter[tuple[str, int]] = Counter()
    found: dict[tuple[str, int], int] = {}
    for partition in range(PARTITIONS):
        for _, fields in rclient.xrange(stream_key(counts, partition)):
            value = msgspec.json.decode(fields[b"value"])
            results[(value["key"], value["start"])] += 1
            found[(value["key"], value["start"])] = value["value"]
    assert [w for w, n in results.items() if n != 1] == []
    assert found == expected["windows"]


def _stamp(sent: list[tuple[str, str, Any]], ids: list[Any]) -> None:
    """Give the last len(ids) entries sent their stream ids (a MULTI reply: ids in call order)."""
    start = len(sent) - len(ids)
    for i, entry_id in enumerate(ids):
        kind, user, value = sent[start + i][:3]
        sent[start + i] = (kind, user, value, StreamId.parse(entry_id))  # type: ignore[assignment]


def _expected(sent: list[Any], prices: dict[str, int]) -> dict[str, Any]:
    """What each order saw, by id order across the topics (an update first on equal ids)."""
    current: dict[str, str | None] = {}
    seen: dict[int, tuple[str | None, int]] = {}
    revenue: Counter[str] = Counter()
    per_minute: Counter[tuple[str, int]] = Counter()
    stream_ms: dict[int, int] = {}
    for kind, user, value, _ in sorted(sent, key=lambda e: (e[3], e[0] != "update")):
        if kind == "update":
            current[user] = None if value is None else value["tier"]
        else:
            seen[value["n"]] = (current.get(user), prices[value["product"]])
            revenue[user] += value["qty"] * prices[value["product"]]
            per_minute[(user, value["ts"] - value["ts"] % 60_000)] += 1
            partition = partition_for(user.encode(), PARTITIONS)
            stream_ms[partition] = max(stream_ms.get(partition, 0), value["ts"])
    # A window closes once its partition's stream time reaches its end (no grace).
    closed = {
        window: count
        for window, count in per_minute.items()
        if window[1] + 60_000 <= stream_ms[partition_for(window[0].encode(), PARTITIONS)]
    }
    return {"seen": seen, "revenue": dict(revenue), "windows": closed}


def _backup_revenue(rclient: redis.Redis, topic: str, app: str) -> dict[str, int]:
    from tests.crash.support import backup_state

    revenue: dict[str, int] = {}
    for partition in range(PARTITIONS):
        for key, state in backup_state(rclient, topic, app, partition).items():
            revenue[key] = state["revenue"]
    return revenue
