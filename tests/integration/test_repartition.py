"""Repartitioning a topic with two apps, one of them lagging: each handles exactly what it had not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import Settings, Worker
from pspf.broker import Broker
from pspf.codec import KEY
from pspf.keys import partition_for, stream_key
from pspf.repartition import Repartition, make_plan
from pspf.service import Service
from tests.conftest import Names
from tests.integration.failures_support import summing_app

pytestmark = pytest.mark.integration

KEYS = 37


def totals(n_from: int, n_to: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for n in range(n_from, n_to):
        found[f"k{n % KEYS}"] = found.get(f"k{n % KEYS}", 0) + n
    return found


def state_of(service: Service, app: str) -> dict[str, int]:
    return {f"k{k}": service.state_get(app, f"k{k}")["total"] for k in range(KEYS)}


def every_entry_in_its_partition(rclient: redis.Redis, topic: str, count: int) -> int:
    seen = 0
    for partition in range(count):
        for _, fields in rclient.xrange(stream_key(topic, partition)):
            assert partition_for(fields[KEY], count) == partition
            seen += 1
    return seen


@pytest.mark.parametrize(("before", "after"), [(4, 8), (8, 3)])
def test_two_apps_one_lagging_each_handle_exactly_what_they_had_not(
    before: int,
    after: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, ahead, behind = make_topic(before), names.app(), names.app()
    service = Service(make_settings())
    settings = {app: make_settings(PSPF_STATE_DIR=str(tmp_path / app)) for app in (ahead, behind)}
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000)])
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000, 4000)])
    Worker(summing_app(ahead, topic), settings[ahead]).run(until_idle=True)
    assert state_of(service, behind) == totals(0, 1000)  # lags by 3,000 entries

    broker = Broker(make_settings().redis)
    plan = make_plan(broker, topic, after)
    assert plan.topics == [topic] and sorted(plan.apps) == sorted([ahead, behind])
    Repartition(broker, plan).run()
    assert len(service.describe_topic(topic).partitions) == after
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(4000, 5000)])
    assert every_entry_in_its_partition(rclient, topic, after) == 5000

    handled = {
        app: Worker(summing_app(app, topic), settings[app]).run(until_idle=True).handled
        for app in (ahead, behind)
    }
    assert handled == {ahead: 1000, behind: 4000}
    for app in (ahead, behind):
        assert state_of(service, app) == totals(0, 5000), app
