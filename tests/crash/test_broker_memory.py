"""A server that runs out of memory or may evict keys, under running workers (``pspf run``).

Out of memory (``noeviction``): the server refuses writes; a worker waits, says so once, in its
log, metrics and health, acknowledges nothing it has not committed, and finishes exactly once
memory is freed. An evicting ``maxmemory-policy``: the worker stops with exit 3 and one line that
names the policy and the fix, before acknowledging anything more and without making any consumer
group again.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import Producer, Settings
from pspf.keys import joined_key, lease_key, member_info_key, members_key, stream_key
from pspf.service import Service
from tests.conftest import Names, RedisServer, standalone_only
from tests.crash.conftest import Spawner
from tests.crash.support import (
    Records,
    WorkerProcess,
    assert_exact,
    assert_no_ack_before_commit,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash, standalone_only]

PARTITIONS = 2
METRICS_URL = re.compile(rb"serving metrics on (http://\S+)/metrics")
FILLER = "filler-of-another-client"
FIX = "CONFIG SET maxmemory-policy noeviction"


def _setup(server: RedisServer, names: Names, tmp_path: Path, n: int) -> tuple[str, str, Records, Spawner]:
    topic, app = names.topic(), names.app()
    settings = Settings.load({"PSPF_BROKER": server.url}, environ={})
    Service(settings).create_topic(topic, PARTITIONS)
    records = order_records(n, 40, seed=2511)
    with Producer(settings=settings, batch_size=500) as producer:
        for key, value in records:
            producer.send(topic, value, key=key)
    spawner = Spawner(tmp_path, server.url)
    return topic, app, records, spawner


def _fill(client: Any) -> list[str]:
    """Write filler keys (another client's data) until the server refuses writes; their names.

    Full means still refusing a second later: the AOF buffer counts in the memory in use until
    the server writes it out, which makes the first refusal come early.
    """
    fillers = [f"{FILLER}:probe"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client.set(f"{FILLER}:{len(fillers)}", b"x" * 50_000)
            fillers.append(f"{FILLER}:{len(fillers)}")
        except redis.OutOfMemoryError:
            time.sleep(1.5)
            try:
                client.set(fillers[0], b"x")
            except redis.OutOfMemoryError:
                # and a margin, so that what the worker frees (or expires) lets no write through
                used = int(client.info("memory")["used_memory"])
                client.config_set("maxmemory", used - 1_000_000)
                return fillers
    raise AssertionError("the server never refused a write")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _committed(client: Any, state_dir: Path, topic: str, app: str) -> int:
    return sum(v.applied for v in view_all(client, state_dir, topic, app, PARTITIONS))


def test_a_worker_waits_while_the_server_is_out_of_memory_and_finishes_exactly(
    own_server: RedisServer, tmp_path: Path, names: Names
) -> None:
    topic, app, records, spawn = _setup(own_server, names, tmp_path, 6000)
    client = own_server.client()
    worker = spawn(
        "worker",
        topic,
        app,
        "--lease-ttl-ms",
        "3000",
        "--batch-size",
        "50",
        "--metrics-port",
        "0",
        env={"PSPF_TEST_WORK_US": "1000"},
    )
    try:
        found = wait_until(lambda: METRICS_URL.search(worker.log.read_bytes()), 20, "the metrics server")
        base = found.group(1).decode()
        wait_until(lambda: _committed(client, spawn.state_dir, topic, app) >= 500, 30, "some progress")
        # Another client fills the server: from now on it refuses every write (noeviction).
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", used + 2_000_000)
        fillers = _fill(client)
        full = len(worker.log.read_bytes())
        time.sleep(6)  # two lease TTLs: several refused heartbeats, acknowledgements and retries
        assert worker.alive(), worker.tail()
        log = worker.log.read_text(errors="replace")
        since_full = worker.log.read_bytes()[full:].decode(errors="replace")
        # said once per episode, not per retry (while the filling went on it may have come and gone)
        assert "out of memory (maxmemory reached" in log, log[-3000:]
        assert since_full.count("out of memory") <= 1 and "accepts writes again" not in since_full, since_full
        stats = client.info("errorstats")
        assert int(stats["errorstat_OOM"]["count"]) > 1, stats
        before = _committed(client, spawn.state_dir, topic, app)
        assert before < len(records)
        assert_no_ack_before_commit(view_all(client, spawn.state_dir, topic, app, PARTITIONS))
        _, metrics = _get(f"{base}/metrics")
        assert re.search(rb"pspf_broker_out_of_memory\{[^}]*\} 1\.0", metrics), metrics[-2000:]
        refused = re.search(rb"pspf_broker_refused_calls_total\{[^}]*\} (\d+)", metrics)
        assert refused is not None and int(refused.group(1)) >= 2, metrics[-2000:]
        code, health = _get(f"{base}/healthz")
        assert (code, json.loads(health)["status"]) == (503, "broker_out_of_memory")

        client.delete(*fillers)  # memory is freed: the worker goes on by itself
        wait_until(
            lambda: all(
                v.checkpoint == v.last_id and not v.pending
                for v in view_all(client, spawn.state_dir, topic, app, PARTITIONS)
            ),
            60,
            "the worker to finish after memory was freed",
        )
        wait_until(lambda: b"accepts writes again" in worker.log.read_bytes(), 10, "the end of the episode")
        assert _get(f"{base}/healthz")[0] == 200
        assert re.search(rb"pspf_broker_out_of_memory\{[^}]*\} 0\.0", _get(f"{base}/metrics")[1])
        assert worker.alive(), worker.tail()
    finally:
        if worker.alive():
            worker.proc.terminate()
    assert worker.wait(30) == 0, worker.tail()
    assert_exact(client, spawn.state_dir, topic, app, PARTITIONS, records)
    client.close()


def _error_lines(worker: WorkerProcess) -> list[str]:
    return [line for line in worker.log.read_text(errors="replace").splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize("evicts", [False, True], ids=["policy-only", "keys-evicted"])
def test_a_worker_stops_with_exit_3_when_the_server_may_evict(
    own_server: RedisServer, tmp_path: Path, names: Names, evicts: bool
) -> None:
    topic, app, records, spawn = _setup(own_server, names, tmp_path, 6000)
    client = own_server.client()
    options = ["--lease-ttl-ms", "3000", "--batch-size", "50"]
    worker = spawn("worker", topic, app, *options, env={"PSPF_TEST_WORK_US": "1000"})
    wait_until(lambda: _committed(client, spawn.state_dir, topic, app) >= 500, 30, "some progress")
    client.config_set("maxmemory-policy", "allkeys-lru")
    if evicts:  # the server evicts at once: streams, groups, leases and backups go
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
    switched = time.monotonic()
    assert worker.wait(15) == 3, worker.tail()
    assert time.monotonic() - switched < 4  # within a few lease rounds (a round is 1 s here)
    errors = _error_lines(worker)
    assert len(errors) == 1 and "maxmemory-policy allkeys-lru" in errors[0] and FIX in errors[0], errors
    log = worker.log.read_text(errors="replace")
    assert "taking them again" not in log  # no group or partition taken again under eviction
    for partition in range(PARTITIONS):
        stream = stream_key(topic, partition)
        # a group made again would have made the stream again, empty (XGROUP CREATE ... MKSTREAM)
        assert not client.exists(stream) or client.xlen(stream) > 0
    if evicts:
        return
    assert_no_ack_before_commit(view_all(client, spawn.state_dir, topic, app, PARTITIONS))
    client.config_set("maxmemory-policy", "noeviction")
    again = spawn("again", topic, app, *options, "--until-idle")
    assert again.wait(60) == 0, again.tail()
    assert_exact(client, spawn.state_dir, topic, app, PARTITIONS, records)
    client.close()


def test_a_worker_checks_the_policy_when_it_reconnects(
    own_server: RedisServer, tmp_path: Path, names: Names
) -> None:
    """Lease rounds every 20 s: the check that stops the worker is the one of its reconnect."""
    topic, app, _, spawn = _setup(own_server, names, tmp_path, 6000)
    client = own_server.client()
    worker = spawn("worker", topic, app, "--lease-ttl-ms", "60000", env={"PSPF_TEST_WORK_US": "1000"})
    wait_until(lambda: _committed(client, spawn.state_dir, topic, app) >= 500, 30, "some progress")
    client.close()
    own_server.stop()
    # down long enough for the worker's calls to fail (a pooled connection reconnects unnoticed)
    wait_until(lambda: b"Redis unavailable" in worker.log.read_bytes(), 10, "the worker to lose Redis")
    own_server.args += ["--maxmemory-policy", "volatile-lru"]
    own_server.start()
    back = time.monotonic()
    assert worker.wait(15) == 3, worker.tail()
    assert time.monotonic() - back < 10
    errors = _error_lines(worker)
    assert len(errors) == 1 and "maxmemory-policy volatile-lru" in errors[0] and FIX in errors[0], errors
    with own_server.client() as after:
        assert_no_ack_before_commit(view_all(after, spawn.state_dir, topic, app, PARTITIONS))


def test_leases_and_membership_deleted_under_a_running_worker_are_an_error(
    own_server: RedisServer, tmp_path: Path, names: Names
) -> None:
    """Deleted, not expired: the worker says keys vanished, takes its partitions again, finishes."""
    topic, app, records, spawn = _setup(own_server, names, tmp_path, 6000)
    client = own_server.client()
    options = ["--lease-ttl-ms", "3000", "--batch-size", "50"]
    worker = spawn("worker", topic, app, *options, "--until-idle", env={"PSPF_TEST_WORK_US": "500"})
    wait_until(lambda: _committed(client, spawn.state_dir, topic, app) >= 500, 30, "some progress")
    gone = [lease_key(topic, p, app) for p in range(PARTITIONS)]
    gone += [members_key(app), joined_key(app), member_info_key(app)]
    assert client.delete(*gone) == len(gone)
    assert worker.wait(60) == 0, worker.tail()
    log = worker.log.read_text(errors="replace")
    vanished = [line for line in log.splitlines() if "PSPF keys vanished" in line]
    assert any("ERROR" in line and "leases of partitions" in line for line in vanished), log[-3000:]
    assert any("ERROR" in line and "membership" in line for line in vanished), log[-3000:]
    assert_exact(client, spawn.state_dir, topic, app, PARTITIONS, records)
    client.close()
