"""Repartitions that meet each other, or the server's memory limit: one claim per topic, and a way back."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

from pspf import Settings, Worker
from pspf.codec import KEY, VALUE
from pspf.keys import partition_for, stream_key, topic_key
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import summing_app

pytestmark = pytest.mark.integration

KEYS = 37


def totals(n_to: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for n in range(n_to):
        found[f"k{n % KEYS}"] = found.get(f"k{n % KEYS}", 0) + n
    return found


def state_of(service: Service, app: str) -> dict[str, int]:
    return {f"k{k}": service.state_get(app, f"k{k}")["total"] for k in range(KEYS)}


def entries_by_partition(rclient: redis.Redis, topic: str, count: int) -> list[int]:
    """Every entry's ``n``, each checked to be in its key's partition."""
    found: list[int] = []
    for partition in range(count):
        for _, fields in rclient.xrange(stream_key(topic, partition)):
            assert partition_for(fields[KEY], count) == partition, (partition, fields[KEY])
            found.append(msgspec.json.decode(fields[VALUE])["n"])
    return found


def start_repartition(redis_url: str, topic: str, *args: str, **env: str) -> subprocess.Popen[str]:
    command = pspf_command("topic", "repartition", topic, *args, "--yes", "--broker", redis_url)
    return subprocess.Popen(
        command, env=subprocess_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("apart_s", [0.4, 1.0])
def test_two_repartitions_at_once_one_is_refused_and_nothing_is_lost_or_doubled(
    apart_s: float,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """120,000 keyed entries, an app that handled 20,000: a second command started mid-way is refused."""
    topic, app = make_topic(4), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(20_000)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(20_000, 120_000)])

    first = start_repartition(redis_url, topic, "--partitions", "3")
    time.sleep(apart_s)
    second = start_repartition(redis_url, topic, "--partitions", "6")
    outcomes = {}
    for name, process in (("first", first), ("second", second)):
        out, err = process.communicate(timeout=300)
        outcomes[name] = (process.returncode, out, err)
    assert outcomes["first"][0] == 0, outcomes["first"]
    code, _, err = outcomes["second"]
    assert code == 6, outcomes["second"]
    assert len(err.strip().splitlines()) == 1, err
    assert "is being run by" in err and "3 partitions" in err, err

    assert int(rclient.hget(topic_key(topic), "partitions")) == 3
    seen = entries_by_partition(rclient, topic, 3)
    assert len(seen) == 120_000 and set(seen) == set(range(120_000))
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100_000
    assert state_of(Service(make_settings()), app) == totals(120_000)
