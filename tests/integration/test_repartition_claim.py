"""Repartitions that meet each other, or the server's memory limit: one claim per topic, and a way back."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis
from litestar.testing import TestClient

from pspf import Producer, Settings, Worker
from pspf.admin_api import create_app
from pspf.codec import KEY, VALUE
from pspf.keys import partition_for, stream_key, topic_key
from pspf.service import Service
from tests.conftest import Names, RedisServer, pspf_command, standalone_only, subprocess_env
from tests.integration.failures_support import KEYS, state_of, summing_app, totals
from tests.support import wait_until

pytestmark = pytest.mark.integration


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


def run_cli(url: str, topic: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command, run to its end; its claim lapses 1 s after it is killed."""
    command = pspf_command("topic", "repartition", topic, *args, "--yes", "--broker", url)
    env = {"PSPF_LEASE_TTL_MS": "1000", **env}
    return subprocess.run(command, env=subprocess_env(**env), capture_output=True, text=True, timeout=300)


def staged_keys(client: redis.Redis) -> list[bytes]:
    return [k for k in client.scan_iter(match="*:next", count=1000)]


@standalone_only
def test_a_repartition_out_of_memory_halfway_is_aborted_and_the_topic_is_as_it_was(
    own_server: RedisServer, names: Names, tmp_path: Path
) -> None:
    """The copy fills the server (noeviction): exit 3 naming --abort; the abort frees it all."""
    url = own_server.url
    settings = Settings.load({"PSPF_BROKER": url, "PSPF_STATE_DIR": str(tmp_path / "s")}, environ={})
    service = Service(settings)
    topic, app = names.topic(), names.app()
    service.create_topic(topic, 4)
    pad = "x" * 200
    with Producer(settings=settings, batch_size=2000) as producer:
        for n in range(40_000):
            producer.send(topic, {"n": n}, key=f"k{n % KEYS}", headers={"pad": pad})
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    client = own_server.client()
    streams = sum(int(client.memory_usage(stream_key(topic, p)) or 0) for p in range(4))
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + streams // 2)
    try:
        full = run_cli(url, topic, "--partitions", "6")
        assert full.returncode == 3, full
        assert len(full.stderr.strip().splitlines()) == 1, full.stderr
        assert "out of memory" in full.stderr and f"pspf topic repartition {topic} --abort" in full.stderr
        assert staged_keys(client), "the copy stopped before it staged anything"
        assert client.hget(topic_key(topic), "moving") == b"1"

        # Memory a DEL frees in the background (lazyfree) comes back late: the abort's writes after
        # its deletes must wait for it, not fail. A ballast freed 2 s into the abort stands for it.
        client.config_set("maxmemory", 0)
        client.setrange("ballast", 4 * streams, "b")  # more than twice what the staged copies hold
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 2 * streams)
        freer = threading.Timer(2.0, lambda: own_server.client().delete("ballast"))
        freer.start()
        undone = run_cli(url, topic, "--abort")
        freer.join()
        assert undone.returncode == 0, undone
        assert "undid the repartition" in undone.stdout
        assert staged_keys(client) == []
        assert [k for k in client.scan_iter(match="pspf:repartition:*")] == []
        assert client.hget(topic_key(topic), "moving") is None
        assert run_cli(url, topic, "--abort").returncode == 4  # nothing left to undo
        # The staged keys' memory may be freed in the background (lazyfree): wait for it to be
        # back under the limit, then writes fit again.
        limit = int(client.config_get("maxmemory")["maxmemory"])
        wait_until(
            lambda: int(client.info("memory")["used_memory"]) < limit, 30, "the abort's memory to be freed"
        )
        client.set("a-write-fits-again", "1")
        with Producer(settings=settings) as producer:  # not sealed any more
            for n in range(40_000, 40_100):
                producer.send(topic, {"n": n}, key=f"k{n % KEYS}", headers={"pad": pad})
    finally:
        client.config_set("maxmemory", 0)
    assert int(client.hget(topic_key(topic), "partitions")) == 4
    assert sorted(entries_by_partition(client, topic, 4)) == list(range(40_100))
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100
    assert state_of(service, app) == totals(40_100)
    # the topic can be repartitioned afterwards, exactly
    again = run_cli(url, topic, "--partitions", "6")
    assert again.returncode == 0, again
    assert sorted(entries_by_partition(client, topic, 6)) == list(range(40_100))
    with Producer(settings=settings) as producer:
        producer.send(topic, {"n": 40_100}, key=f"k{40_100 % KEYS}")
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 1
    assert state_of(service, app) == totals(40_101)
    client.close()


def test_a_repartition_that_began_its_switch_is_not_aborted_and_resumes(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(4), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    killed = run_cli(redis_url, topic, "--partitions", "2", PSPF_REPARTITION_CRASH_AT=f"switched {topic} 0")
    assert killed.returncode == -9, killed
    refused = run_cli(redis_url, topic, "--abort")
    assert refused.returncode == 2, refused
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "cannot be undone" in refused.stderr and "--resume" in refused.stderr, refused.stderr
    resumed = run_cli(redis_url, topic, "--resume")
    assert resumed.returncode == 0, resumed
    assert sorted(entries_by_partition(rclient, topic, 2)) == list(range(2000))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000, 2100)])
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100
    assert state_of(Service(make_settings()), app) == totals(2100)


def test_an_interrupted_repartition_is_aborted_through_the_admin_api(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(3), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(3000)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    killed = run_cli(redis_url, topic, "--partitions", "5", PSPF_REPARTITION_CRASH_AT=f"copied {topic}")
    assert killed.returncode == -9, killed
    assert staged_keys(rclient)
    path, auth = f"/topics/{topic}/repartition", {"Authorization": "Bearer t0k"}
    with TestClient(create_app(Service(settings), token="t0k")) as api:
        both = api.post(path, json={"abort": True, "resume": True}, headers=auth)
        assert both.status_code == 422 and "resume" in both.text and "abort" in both.text
        time.sleep(1.2)  # the killed command's claim lapses
        undone = api.post(path, json={"abort": True}, headers=auth)
        assert undone.status_code == 200, undone.text
        assert undone.json()["aborted"] is True and undone.json()["partitions_after"] == 5
        assert api.post(path, json={"abort": True}, headers=auth).status_code == 404
    assert staged_keys(rclient) == [] and rclient.hget(topic_key(topic), "moving") is None
    assert sorted(entries_by_partition(rclient, topic, 3)) == list(range(3000))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(3000, 3100)])
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100
    assert state_of(Service(make_settings()), app) == totals(3100)


def test_a_resume_while_the_command_runs_never_runs_it_a_second_time(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """``--resume`` 0.8 s into a live run: refused (its runner renews the claim) or nothing left."""
    topic, app = make_topic(4), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(20_000)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(20_000, 120_000)])
    first = start_repartition(redis_url, topic, "--partitions", "6", PSPF_LEASE_TTL_MS="1000")
    time.sleep(0.8)
    resumed = run_cli(redis_url, topic, "--resume")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, (out, err)
    assert resumed.returncode in (4, 6), resumed
    assert len(resumed.stderr.strip().splitlines()) == 1, resumed.stderr
    assert sorted(entries_by_partition(rclient, topic, 6)) == list(range(120_000))
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100_000
    assert state_of(Service(make_settings()), app) == totals(120_000)
