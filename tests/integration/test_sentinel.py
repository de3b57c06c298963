"""Running through Sentinel: the master found by name, WAIT for replicas, clear errors."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import Producer, Settings, Worker
from pspf.embedded import LocalSentinel
from pspf.errors import AuthenticationFailed, BrokerError
from pspf.service import Service
from tests.conftest import Names, server_binary_under_test
from tests.integration.failures_support import summing_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    server = LocalSentinel(tmp_path_factory.mktemp("sentinel"), binary=server_binary_under_test())
    server.start()
    yield server
    server.stop()


def run_counting(
    sentinel: LocalSentinel, names: Names, tmp_path: Path, entries: int, **settings: Any
) -> tuple[str, Callable[[], dict[str, Any]]]:
    topic, app = names.topic(), names.app()
    config = Settings.load(
        {
            "PSPF_BROKER": sentinel.url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": 100,
            **settings,
        },
        environ={},
    )
    Service(config).create_topic(topic, 2)
    with Producer(settings=config) as producer:
        for i in range(entries):
            producer.send(topic, {"n": i}, key=f"k{i % 7}")
    Worker(summing_app(app, topic), config).run(until_idle=True)
    return app, lambda: {key: Service(config).state_get(app, key) for key in [f"k{j}" for j in range(7)]}


def wait_calls(port: int) -> int:
    with redis.Redis(port=port) as client:
        return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_a_worker_finds_the_master_by_name_and_waits_for_its_replica(
    sentinel: LocalSentinel, names: Names, tmp_path: Path
) -> None:
    master = sentinel.master_port()
    assert master is not None
    before = wait_calls(master)
    app, state = run_counting(sentinel, names, tmp_path, 3000, PSPF_WAIT_REPLICAS=1, PSPF_BATCH_SIZE=500)
    want = {f"k{j}": {"total": sum(i for i in range(3000) if i % 7 == j)} for j in range(7)}
    assert state() == want
    assert wait_calls(master) - before >= 3000 // 500  # one WAIT at least per acknowledging call
    # the replica has every acknowledgement's backup update: nothing a fail-over now would lose
    replica = sentinel.replica.port if master == sentinel.master.port else sentinel.master.port
    with redis.Redis(port=master) as m, redis.Redis(port=replica) as r:
        meta = [k for k in m.scan_iter(match=f"*backup-meta:{app}")]
        assert meta and all(m.hgetall(k) == r.hgetall(k) for k in meta)


def test_a_replica_that_does_not_answer_in_time_is_reported(
    sentinel: LocalSentinel, names: Names, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    master = sentinel.master_port()
    replica = sentinel.replica if master == sentinel.master.port else sentinel.master
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="pspf.broker"):
            _, state = run_counting(
                sentinel, names, tmp_path, 200, PSPF_WAIT_REPLICAS=1, PSPF_WAIT_TIMEOUT_MS=50
            )
    finally:
        replica.process.send_signal(signal.SIGCONT)
    assert sum(v["total"] for v in state().values()) == sum(range(200))
    assert "only 0 of 1 replicas have the last acknowledgement after 50 ms" in caplog.text


def test_an_unknown_master_name_is_one_clear_error(sentinel: LocalSentinel) -> None:
    url = sentinel.url.replace("/pspf", "/nosuchmaster")
    with pytest.raises(BrokerError, match="No master found for 'nosuchmaster'"):
        Service(Settings.load({"PSPF_BROKER": url}, environ={})).create_topic("t", 1)


def test_a_wrong_password_of_the_master_is_an_authentication_failure(sentinel: LocalSentinel) -> None:
    for server in (sentinel.master, sentinel.replica):
        with server.client() as admin:
            admin.execute_command("ACL", "SETUSER", "app", "reset", "on", ">the-password", "~*", "+@all")  # type: ignore[no-untyped-call]
    url = sentinel.url.replace("://", "://app:not-the-password@", 1)
    with pytest.raises(AuthenticationFailed, match=r"authentication to Redis at .* failed") as refused:
        Service(Settings.load({"PSPF_BROKER": url}, environ={})).topics.list_topics()
    assert "not-the-password" not in str(refused.value)
