"""TestApp gives what a real worker gives: the same state, emits and dead letters for the same entries."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.codec import decode_headers
from pspf.keys import stream_key
from pspf.service import Service
from pspf.testing import TestApp

pytestmark = pytest.mark.integration


class Order(msgspec.Struct):
    amount: int


def shop(orders: str, vip: str) -> App:
    app = App("harness-shop", retry=RetryPolicy(max_retries=4, base_delay_ms=1, max_delay_ms=2))

    @app.handler(orders)
    def add(order: Order, ctx: Context) -> None:
        if order.amount < 0:
            raise ValueError(f"negative amount {order.amount}")
        total = ctx.state["total"] = ctx.state.get("total", 0) + order.amount
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        if total >= 500 and not ctx.state.get("vip"):
            ctx.state["vip"] = True
            ctx.emit(vip, {"user": ctx.key, "total": total}, key=ctx.key, headers={"tier": "gold"})

    return app


def entries(seed: int) -> list[tuple[str, Any]]:
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = []
    for _ in range(400):
        key = f"u{rng.randrange(12)}"
        roll = rng.random()
        if roll < 0.05:
            out.append((key, {"amount": -rng.randrange(1, 9)}))
        elif roll < 0.08:
            out.append((key, {"amount": "lots"}))
        else:
            out.append((key, {"amount": rng.randrange(1, 60)}))
    return out


def test_testapp_and_a_worker_agree_on_state_emits_and_dead_letters(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
) -> None:
    orders, vip = make_topic(4), make_topic(2)
    records = entries(seed=7)
    app = shop(orders, vip)
    produce(orders, records)
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)

    service = Service(settings, local_state=True)
    users = sorted({key for key, _ in records})
    worker_state = {user: service.state_get(app.name, user) for user in users}
    worker_emits = Counter()
    for partition in range(2):
        for _, fields in rclient.xrange(stream_key(vip, partition)):
            headers = decode_headers(fields.get(b"headers"))
            worker_emits[(fields[b"key"].decode(), fields[b"value"], headers["tier"], partition)] += 1
    worker_dead = Counter((d.key, d.error_type, d.attempts) for d in service.dlq.dlq_list(orders, limit=1000))
    service.close()

    with TestApp(app, partitions=4, topics={vip: 2}) as t:
        for key, value in records:
            t.send(orders, value, key=key)
        assert {user: t.state(user) for user in users} == worker_state
        harness_emits = Counter(
            (e.key, msgspec.json.encode(e.value), e.headers["tier"], e.partition)
            for e in t.emitted_entries(vip)
        )
        assert harness_emits == worker_emits
        harness_dead = Counter((d.key, d.error_type, d.attempts) for d in t.dead_letters(orders))
        assert harness_dead == worker_dead
    # The records hold both kinds of failure, and some users became VIPs.
    assert {error for _, error, _ in worker_dead} == {"ValueError", "DecodeError"}
    assert {attempts for _, error, attempts in worker_dead if error == "ValueError"} == {4}
    assert len(worker_emits) >= 3
