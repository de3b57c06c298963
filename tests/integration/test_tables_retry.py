"""A table lookup by an entry that failed and was tried again, or that waited behind one, sees
exactly the rows produced before it: in ordered and deferred retry mode, parked and redriven."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.keys import StreamId, dlq_key, partition_for, stream_key
from pspf.state_stores import open_store

pytestmark = pytest.mark.integration

PARTITIONS = 2


class Flaky(Exception):
    """Fails an order's first attempts."""


def xadd(rclient: redis.Redis, topic: str, key: str, value: Any, at_ms: int | None = None) -> StreamId:
    """An entry; ``at_ms`` gives it that id's milliseconds (else the server's clock: entries of
    different streams added within one millisecond may then have ids in another order)."""
    stream = stream_key(topic, partition_for(key.encode(), PARTITIONS))
    fields = {b"key": key.encode(), b"value": msgspec.json.encode(value)}
    return StreamId.parse(rclient.xadd(stream, fields, id="*" if at_ms is None else f"{at_ms}-0"))


def failing_app(name: str, orders: str, customers: str, policy: RetryPolicy, fails: dict[int, int]) -> App:
    """Each order records the tier its lookup saw; order n fails its first ``fails[n]`` attempts."""
    app = App(name)
    app.table(customers)
    attempts: Counter[int] = Counter()

    @app.handler(orders, retry=policy)
    def order(value: dict[str, Any], ctx: Context) -> None:
        n = value["n"]
        attempts[n] += 1
        if attempts[n] <= fails.get(n, 0):
            raise Flaky(f"order {n}, attempt {attempts[n]}")
        row = ctx.table(customers)
        ctx.state["seen"] = [*ctx.state.get("seen", []), [n, None if row is None else row["tier"]]]

    return app


def seen_by_key(settings: Settings, app: str) -> dict[str, list[list[Any]]]:
    seen: dict[str, list[list[Any]]] = {}
    for partition in range(PARTITIONS):
        with open_store("sqlite", settings.state.dir, app, partition, readonly=True) as store:
            for key, raw in store.items("state"):
                seen[key] = msgspec.msgpack.decode(raw)["seen"]
    return seen


POLICIES = {
    "ordered": RetryPolicy(mode="ordered", max_retries=3, base_delay_ms=30, factor=1.0, max_delay_ms=30),
    # long enough for the partition to go on past the parked entry, and its table with it
    "deferred": RetryPolicy(mode="deferred", max_retries=3, base_delay_ms=300, factor=1.0, max_delay_ms=300),
}


@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_the_issue_s_orders_behind_a_dead_lettered_one_see_tier_a_a_b(
    mode: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    """The reported run: a failing order, two orders, an update to tier B, one more order."""
    orders, customers = make_topic(PARTITIONS), make_topic(PARTITIONS)
    xadd(rclient, customers, "c1", {"tier": "A"}, 1000)
    xadd(rclient, orders, "c1", {"n": 0}, 1001)  # always fails: ends in the DLQ
    xadd(rclient, orders, "c1", {"n": 1}, 1002)
    xadd(rclient, orders, "c1", {"n": 2}, 1003)
    xadd(rclient, customers, "c1", {"tier": "B"}, 1004)
    xadd(rclient, orders, "c1", {"n": 3}, 1005)
    app = failing_app(names.app(), orders, customers, POLICIES[mode], {0: 99})
    settings = make_settings()
    summary = Worker(app, settings).run(until_idle=True)
    assert summary.dead_lettered == 1
    assert seen_by_key(settings, app.name) == {"c1": [[1, "A"], [2, "A"], [3, "B"]]}


@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_lookups_after_retries_and_behind_them_see_the_rows_current_at_their_entry(
    mode: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    """Random updates and orders; some orders fail once or twice, some always (the DLQ)."""
    orders, customers = make_topic(PARTITIONS), make_topic(PARTITIONS)
    rng = random.Random(11)
    users = [f"c{i}" for i in range(4)]
    fails: dict[int, int] = {}
    events: list[tuple[StreamId, int, str, Any]] = []
    for n in range(300):
        user = rng.choice(users)
        if rng.random() < 0.35:
            tier = rng.choice(["gold", "silver", None])
            entry_id = xadd(rclient, customers, user, None if tier is None else {"tier": tier})
            events.append((entry_id, 0, user, tier))
            continue
        if rng.random() < 0.06:
            fails[n] = rng.choice([1, 2, 99])
        events.append((xadd(rclient, orders, user, {"n": n}), 1, user, n))
    current: dict[str, str | None] = {}
    expected: dict[str, list[list[Any]]] = {}
    for _, kind, user, value in sorted(events, key=lambda e: e[:2]):
        if kind == 0:
            current[user] = value
        elif fails.get(value, 0) < 3:
            expected.setdefault(user, []).append([value, current.get(user)])
    app = failing_app(names.app(), orders, customers, POLICIES[mode], fails)
    settings = make_settings(PSPF_BATCH_SIZE=9)
    summary = Worker(app, settings).run(until_idle=True)
    doomed = sum(1 for n in fails.values() if n >= 3)
    assert summary.dead_lettered == doomed > 0
    seen = seen_by_key(settings, app.name)
    if mode == "deferred":  # parked entries are applied when due: per-key order is not kept
        seen = {user: sorted(rows) for user, rows in seen.items()}
    assert seen == expected


def test_a_redriven_entry_sees_the_rows_as_of_its_redrive(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    """A redrive adds the entry again at the end of its stream: it is a new entry there."""
    from pspf.service import Service

    orders, customers = make_topic(PARTITIONS), make_topic(PARTITIONS)
    xadd(rclient, customers, "c1", {"tier": "A"}, 1000)
    xadd(rclient, orders, "c1", {"n": 0}, 1001)
    xadd(rclient, customers, "c1", {"tier": "B"}, 1002)
    fails = {0: 3}  # dead after its three attempts, then succeeds when redriven
    app = failing_app(names.app(), orders, customers, POLICIES["ordered"], fails)
    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).dead_lettered == 1
    partition = partition_for(b"c1", PARTITIONS)
    assert rclient.xlen(dlq_key(orders, partition)) == 1
    xadd(rclient, customers, "c1", {"tier": "C"})
    service = Service(settings)
    try:
        assert service.dlq.dlq_redrive(orders, all_entries=True).changed == 1
    finally:
        service.close()
    assert Worker(app, settings).run(until_idle=True).handled >= 1
    assert seen_by_key(settings, app.name) == {"c1": [[0, "C"]]}
