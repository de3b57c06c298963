"""Every sink, under SIGKILL: each entry's effect in the target exactly once (invariant 10).

Parametrized over ``SINKS``: a sink joins the suite with one line there. Each runs in worker
processes (``tests.sinks.sink_child``) against a real Redis/Valkey (and PostgreSQL for the
PostgreSQL sink; skipped where it is absent), while entries keep arriving; the processes are
killed with SIGKILL at random moments a few times, then one more runs until idle. The target
then holds every produced entry exactly once: none missing, none twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf.keys import partition_for, stream_key
from tests.conftest import subprocess_env
from tests.sinks import dir_sink
from tests.sinks.files_read import files_delivered
from tests.sinks.iceberg_read import iceberg_rows, sql_catalog
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
LIVES = 4
LEASE_TTL_MS = 1000

Delivered = Callable[[], list[tuple[int, str]]]


@dataclass(frozen=True)
class Target:
    """A sink under test: its class, its constructor arguments, and what its target holds."""

    factory: str
    kwargs: dict[str, Any]
    #: (partition, entry id) of every effect in the target, once per effect
    delivered: Delivered


def _postgres(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    dsn = request.getfixturevalue("pg_dsn")  # skips where PostgreSQL is absent
    query = request.getfixturevalue("pg_query")
    return Target(
        "pspf.sink_postgres:PostgresSink",
        {"dsn": dsn, "table": "conformance", "name": f"sink-pg-{uuid.uuid4().hex[:8]}"},
        lambda: [(p, e) for p, e in query("SELECT partition, entry_id FROM conformance")],
    )


def _dir(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    root = tmp_path / "out"
    return Target(
        "tests.sinks.dir_sink:DirSink",
        {"root": str(root), "name": f"sink-dir-{uuid.uuid4().hex[:8]}"},
        lambda: [(r["partition"], r["entry_id"]) for r in dir_sink.delivered(root)],
    )


def _files(fmt: str, s3: bool) -> Callable[[pytest.FixtureRequest, Path], Target]:
    """The files sink into a folder, or into a bucket of the S3 server, in one format."""

    def make(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
        url = f"s3://{request.getfixturevalue('s3_bucket')}/out" if s3 else str(tmp_path / "files")
        return Target(
            "pspf.sink.files:FilesSink",
            {"url": url, "format": fmt, "name": f"sink-files-{uuid.uuid4().hex[:8]}"},
            lambda: [(r["partition"], r["id"]) for r in files_delivered(url)],
        )

    return make


def _iceberg(s3: bool) -> Callable[[pytest.FixtureRequest, Path], Target]:
    """The Iceberg sink, a SQL catalog on SQLite; its warehouse on disk, or in a bucket of the S3 server.

    A snapshot takes a dozen file writes (round trips on S3), and the table's metadata grows with
    each: batches of up to 200 entries (not 20) keep the sink ahead of the producer, so the last
    run delivers what the killed ones left within its time on a loaded machine too.
    """

    def make(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
        properties = sql_catalog(tmp_path, request.getfixturevalue("s3_bucket") if s3 else None)
        table = "lake.conformance"
        kwargs = {"table": table, "name": f"sink-iceberg-{uuid.uuid4().hex[:8]}", "properties": properties}
        return Target(
            "pspf.sink.iceberg:IcebergSink",
            {**kwargs, "batch_size": 200},
            lambda: [(r["partition"], r["id"]) for r in iceberg_rows(table, properties)],
        )

    return make


#: The sinks under test: one line each.
SINKS: dict[str, Callable[[pytest.FixtureRequest, Path], Target]] = {
    "postgres": _postgres,
    "dir": _dir,
    "files-jsonl": _files("jsonl", s3=False),
    "files-parquet": _files("parquet", s3=False),
    "files-s3-jsonl": _files("jsonl", s3=True),
    "files-s3-parquet": _files("parquet", s3=True),
    "iceberg": _iceberg(s3=False),
    "iceberg-s3": _iceberg(s3=True),
}


@pytest.fixture(params=sorted(SINKS))
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    return SINKS[request.param](request, tmp_path)


class SinkProcess:
    """One sink process; its output goes to a log file."""

    def __init__(self, target: Target, topic: str, redis_url: str, log: Path, *extra: str) -> None:
        self.log = log
        env = subprocess_env(
            PSPF_BROKER=redis_url,
            PSPF_BATCH_SIZE="20",
            PSPF_BLOCK_MS="100",
            PSPF_LEASE_TTL_MS=str(LEASE_TTL_MS),
            PSPF_STATE_DIR=str(log.parent / "state"),
        )
        args = [target.factory, topic, json.dumps(target.kwargs), *extra]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.sinks.sink_child", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def started(self) -> bool:
        return b"worker started" in self.log.read_bytes() or self.proc.poll() is not None

    def kill9(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


class Producer(threading.Thread):
    """Adds keyed entries in small bursts until stopped; ``sent`` holds their (partition, id)."""

    def __init__(self, redis_url: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(redis_url)
        self.topic = topic
        self.sent: list[tuple[int, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pipe = self.client.pipeline(transaction=False)
            partitions: list[int] = []
            for _ in range(25):
                n = len(self.sent) + len(partitions)
                key = f"k{n % 37}"
                partition = partition_for(key.encode(), PARTITIONS)
                value = msgspec.json.encode({"n": n})
                pipe.xadd(stream_key(self.topic, partition), {"key": key, "value": value})
                partitions.append(partition)
            ids = pipe.execute()
            self.sent += [(p, bytes(i).decode()) for p, i in zip(partitions, ids, strict=True)]
            time.sleep(0.02)


def test_random_sigkills_leave_every_entrys_effect_in_the_target_exactly_once(
    target: Target, make_topic: Callable[[int], str], redis_url: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    topic = make_topic(PARTITIONS)
    producer = Producer(redis_url, topic)
    processes: list[SinkProcess] = []
    kills = 0
    sent_at_kills: list[int] = []
    producer.start()
    try:
        for life in range(LIVES):
            alive = [
                SinkProcess(target, topic, redis_url, tmp_path / f"sink-{life}-{n}.log")
                for n in range(rng.choice((1, 2)))
            ]
            processes += alive
            for process in alive:
                wait_until(process.started, 60, "the sink to start")
            if life == LIVES - 1:  # a slow target (Iceberg on S3) may not commit in one short life
                wait_until(lambda: target.delivered(), 120, "the sinks to deliver something", interval=0.2)
            time.sleep(rng.uniform(0.5, 1.5))
            for process in alive:
                assert process.proc.poll() is None, f"a sink exited by itself\n{process.tail()}"
                assert process.kill9() == -signal.SIGKILL
                kills += 1
            sent_at_kills.append(len(producer.sent))
        producer.stop.set()
        producer.join(10)
        before = len(target.delivered())
        # The kills land mid-stream: the sinks had delivered some, and entries kept arriving.
        assert before > 0 and sent_at_kills == sorted(set(sent_at_kills)), sent_at_kills
        time.sleep(LEASE_TTL_MS / 1000 + 0.5)  # the dead sinks' leases expire
        final = SinkProcess(target, topic, redis_url, tmp_path / "sink-final.log", "--until-idle")
        processes.append(final)
        assert final.proc.wait(timeout=240) == 0, final.tail()
    finally:
        producer.stop.set()
        for process in processes:
            if process.proc.poll() is None:
                process.kill9()
    delivered = target.delivered()
    final_line = final.log.read_text().splitlines()[-1]  # "handled N skipped M": M read again, done
    print(f"{kills} kills, {before} of {len(producer.sent)} delivered before the last run; {final_line}")
    assert len(delivered) == len(set(delivered)), "an entry's effect is in the target twice"
    assert sorted(delivered) == sorted(producer.sent)
