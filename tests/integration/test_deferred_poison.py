"""A parked entry that crashes the worker on every retry still reaches the DLQ as poison."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.failures import DeadLetter
from pspf.keys import dlq_key, stream_key
from tests.conftest import Names

pytestmark = pytest.mark.integration


class Crash(BaseException):
    """Stands in for a crash: not an Exception, so nothing is committed and the worker stops."""


def test_parked_killers_become_poison_and_the_rest_is_applied(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    produce(topic, [(f"k{i}", {"i": i, "kill": i in (3, 11)}) for i in range(20)])
    app = App(names.app())
    calls: Counter[int] = Counter()

    @app.handler(topic, retry=RetryPolicy(mode="deferred", base_delay_ms=1, max_retries=10, max_deliveries=3))
    def handle(value: dict[str, Any], ctx: Context) -> None:
        calls[value["i"]] += 1
        if value["kill"]:
            if calls[value["i"]] == 1:
                raise RuntimeError("first failure: parked")
            raise Crash
        ctx.state["seen"] = True

    settings = make_settings(PSPF_LEASE_TTL_MS=1000)
    lives = 0
    while lives < 30:
        lives += 1
        try:
            Worker(app, settings).run(until_idle=True)
            break
        except Crash:
            pass  # the worker's shutdown released its leases; a new one takes over
    assert lives < 30
    dead = [DeadLetter.from_fields(f) for _, f in rclient.xrange(dlq_key(topic, 0))]
    assert sorted(int(d.original[b"key"][1:]) for d in dead) == [3, 11]
    assert {d.error_type for d in dead} == {"PoisonEntry"}
    assert all(calls[i] == 1 for i in range(20) if i not in (3, 11))
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
