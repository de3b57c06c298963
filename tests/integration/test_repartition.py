"""Repartitioning a topic with two apps, one of them lagging: each handles exactly what it had not."""

from __future__ import annotations

import subprocess
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
from tests.conftest import Names, pspf_command, subprocess_env
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


def crash_points(topic: str, app: str) -> list[str]:
    return ["copy", f"copied {topic}", f"staged {app}", "switch", f"switched {topic} 0"]


@pytest.mark.parametrize("point", range(5))
def test_a_repartition_killed_at_any_step_is_resumed_to_the_same_exact_result(
    point: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, ahead, behind = make_topic(4), names.app(), names.app()
    service = Service(make_settings())
    settings = {app: make_settings(PSPF_STATE_DIR=str(tmp_path / app)) for app in (ahead, behind)}
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(500)])
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(500, 2000)])
    Worker(summing_app(ahead, topic), settings[ahead]).run(until_idle=True)

    command = pspf_command("topic", "repartition", topic, "--partitions", "6", "--yes", "--broker", redis_url)
    where = crash_points(topic, ahead)[point]
    killed = subprocess.run(command, env=subprocess_env(PSPF_REPARTITION_CRASH_AT=where), capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()
    again = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr
    resumed = subprocess.run(
        pspf_command("topic", "repartition", topic, "--resume", "--yes", "--broker", redis_url),
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed the repartition" in resumed.stdout
    assert len(service.describe_topic(topic).partitions) == 6

    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000, 2300)])
    assert every_entry_in_its_partition(rclient, topic, 6) == 2300
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
        assert state_of(service, app) == totals(0, 2300), app


def test_entries_with_the_same_id_in_two_old_partitions_are_merged_and_handled_once(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Two streams hand out the same ids; merged into one partition, the later copy gets the next id.

    The app handled partition 0's entries and only the first half of partition 1's: after the
    merge its handled and unhandled entries share ids, and it handles the unhandled ones alone.
    """
    topic, app = make_topic(2), names.app()
    keys_of = {
        p: [f"k{i}" for i in range(400) if partition_for(f"k{i}".encode(), 2) == p][:5] for p in (0, 1)
    }
    expected: dict[str, int] = {}

    def add(partition: int, numbers: range) -> None:
        for n in numbers:
            key = keys_of[partition][n % 5]
            value = 1000 * partition + n
            fields = {b"key": key.encode(), b"value": f'{{"n": {value}}}'.encode()}
            rclient.xadd(stream_key(topic, partition), fields, id=f"{1000 + n}-0")
            expected[key] = expected.get(key, 0) + value

    add(0, range(1, 201))
    add(1, range(1, 101))
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "s"), PSPF_BATCH_SIZE=30)
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 300
    add(1, range(101, 201))  # unhandled, with the ids of partition 0's handled entries

    broker = Broker(make_settings().redis)
    Repartition(broker, make_plan(broker, topic, 1)).run()
    merged = rclient.xrange(stream_key(topic, 0))
    ids = [tuple(map(int, entry_id.split(b"-"))) for entry_id, _ in merged]
    assert len(merged) == 400 and ids == sorted(ids) and len(set(ids)) == 400
    assert sum(b"pspf-moved-id" in f.get(b"headers", b"") for _, f in merged) == 200
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100
    service = Service(make_settings())
    assert {k: service.state_get(app, k)["total"] for k in expected} == expected
