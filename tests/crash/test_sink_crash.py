"""SIGKILL ``pspf sink postgres`` processes at random, from two directories, while entries arrive.

Then one more run of each sink to the end: the rows table holds every entry exactly once, the
upsert table every key's last value, and both sinks' checkpoints are the streams' last ids.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf.keys import partition_for, stream_key
from tests.conftest import subprocess_env
from tests.crash.support import WorkerProcess
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
KEYS = 40
LIVES = 5
LEASE_TTL_MS = 1000


def test_random_sigkills_of_two_sinks_write_every_row_once_and_every_keys_last_value(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    redis_url: str,
    pg_dsn: str,
    pg_query: Callable[..., list[tuple[Any, ...]]],
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    topic = make_topic(PARTITIONS)
    last: dict[str, int] = {}
    produced = 0
    stop = threading.Event()

    def produce() -> None:  # entries keep arriving while the sinks die
        nonlocal produced
        client = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            pipe = client.pipeline(transaction=False)
            for _ in range(50):
                key = f"k{produced % KEYS}"
                value = msgspec.json.encode({"n": produced})
                pipe.xadd(
                    stream_key(topic, partition_for(key.encode(), PARTITIONS)), {"key": key, "value": value}
                )
                last[key] = produced
                produced += 1
            pipe.execute()
            time.sleep(0.02)

    sinks = {"rows": "crash_rows", "upsert": "crash_latest"}
    processes: list[WorkerProcess] = []

    def start(label: str, mode: str, where: Path, *extra: str) -> WorkerProcess:
        """A sink process run from ``where``: a sink keeps no local state, its stores are the database's."""
        where.mkdir(exist_ok=True)
        args = ["--dsn", pg_dsn, "--table", sinks[mode], "--mode", mode, "--broker", redis_url]
        args += ["--batch-size", "20", "--block-ms", "100"]
        args += ["--lease-ttl-ms", str(LEASE_TTL_MS), *extra]
        process = WorkerProcess(
            tmp_path / f"{label}.log", args, subprocess_env(), where, command=("sink", "postgres", topic)
        )
        processes.append(process)
        return process

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        for life in range(LIVES):
            alive = [
                start(f"{mode}-{life}-{d}", mode, tmp_path / d)
                for mode in sinks
                for d in (("a", "b") if rng.random() < 0.5 else ("ab"[life % 2],))
            ]
            for process in alive:  # each has started: it runs, then dies at a random moment
                wait_until(
                    lambda p=process: b"worker started" in p.log.read_bytes() or not p.alive(),
                    60,
                    "the sink to start",
                )
            time.sleep(rng.uniform(0.5, 2.0))
            for process in alive:
                assert process.alive(), f"a sink exited by itself\n{process.tail()}"
                assert process.kill9() == -9
        stop.set()
        producer.join(10)
        count = pg_query("SELECT count(*) FROM crash_rows")[0][0]
        assert 0 < count < produced, "the kills should land mid-stream"
        time.sleep(LEASE_TTL_MS / 1000 + 0.5)  # the dead sinks' leases expire
        for mode in sinks:
            final = start(f"{mode}-final", mode, tmp_path / "c", "--until-idle")
            assert final.wait(timeout=120) == 0, final.tail()
    finally:
        stop.set()
        for process in processes:
            if process.alive():
                process.kill9()

    values = [v["n"] for (v,) in pg_query("SELECT value FROM crash_rows")]
    assert len(values) == produced and sorted(values) == list(range(produced))
    latest = {key: value["n"] for key, value in pg_query("SELECT key, value FROM crash_latest")}
    assert latest == last
    for name in ("sink-postgres-crash_rows", "sink-postgres-crash_latest"):
        rows = pg_query("SELECT partition, ms, seq FROM pspf_sink_checkpoints WHERE sink = %s", name)
        found = {partition: f"{ms}-{seq}" for partition, ms, seq in rows}
        expected = {
            p: rclient.xinfo_stream(stream_key(topic, p))["last-generated-id"].decode()
            for p in range(PARTITIONS)
        }
        assert found == expected, name
