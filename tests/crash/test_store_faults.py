"""A broken local store stops the worker (exit 5, naming the store) before anything is acknowledged.

Real ``pspf run`` workers over real store files: a store damaged under the state a handler reads
(never a handler failure: nothing retried, nothing dead-lettered), a state dir deleted under a
running worker, and a store that cannot be opened (its leases are given up at once).
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf.keys import dlq_key, stream_key
from pspf.state_stores import open_store, store_path
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import ENGINES, held_by, leases, order_records, read_store
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

BATCH = 100
RUN = ["--batch-size", str(BATCH), "--block-ms", "100", "--lease-ttl-ms", "10000"]


def unacknowledged(client: Any, topic: str, app: str) -> int:
    """Entries of partition 0 the app has not acknowledged: pending or never delivered."""
    stream = stream_key(topic, 0)
    group = next(g for g in client.xinfo_groups(stream) if g["name"] == app.encode())
    undelivered = len(client.xrange(stream, f"({group['last-delivered-id'].decode()}", "+"))
    return int(group["pending"]) + undelivered


def damage_state(state_dir: Path, engine: str, app: str) -> None:
    """Damage the values of a store but not its checkpoints, so it still opens.

    SQLite: 16 KB of random bytes over the middle of the file (state table pages; the schema and
    the checkpoints are on the first pages). RocksDB: bytes inverted in the middle of its table
    file (checkpoints sort first, in the first block).
    """
    path = store_path(state_dir, engine, app, 0)
    if engine == "sqlite":
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.seek(size // 2)
            f.write(random.Random(7).randbytes(16 * 1024))
        db = sqlite3.connect(path)
        try:
            assert db.execute("SELECT count(*) FROM checkpoints").fetchone() == (1,)
            with pytest.raises(sqlite3.DatabaseError):
                db.execute("SELECT key, value FROM state").fetchall()
        finally:
            db.close()
        return
    open_store(engine, state_dir, app, 0).close()  # the reopen flushes the WAL into a table file
    (table,) = path.glob("*.sst")
    data = bytearray(table.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    table.write_bytes(bytes(data))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_damaged_store_read_by_a_handler_stops_the_worker_instead_of_failing_entries(
    engine: str,
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    produce(topic, order_records(6_000, 3_000, seed=1))
    first = spawn("first", topic, app, *RUN, "--store", engine, "--until-idle")
    assert first.wait(60) == 0, first.tail()
    damage_state(state_dir, engine, app)
    path = store_path(state_dir, engine, app, 0)

    produce(topic, order_records(500, 3_000, seed=2))
    second = spawn("second", topic, app, *RUN, "--store", engine, "--until-idle", "--max-retries", "2")
    code = second.wait(60)
    log = second.log.read_text()
    assert code == 5, f"exit code {code}\n{second.tail()}"
    assert str(path) in log and "Traceback" not in log, second.tail()
    assert "entry failed" not in log, "a store error was taken for a handler failure"
    assert rclient.xlen(dlq_key(topic, 0)) == 0, "entries went to the DLQ for the store's damage"
    assert unacknowledged(rclient, topic, app) == 500, "entries were acknowledged without being applied"


def test_state_dir_deleted_under_a_running_worker_stops_it_before_it_acknowledges_more(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    records = order_records(20_000, 200, seed=3)
    produce(topic, records)
    worker = spawn("worker", topic, app, *RUN, "--until-idle", env={"PSPF_TEST_WORK_US": "300"})
    wait_until(lambda: read_store(state_dir, app, 0)[0], 30, "a first commit")
    applied_before = sum(value["count"] for value in read_store(state_dir, app, 0)[1].values())
    shutil.rmtree(state_dir / app)
    code = worker.wait(60)
    log = worker.log.read_text()
    assert code == 5, f"exit code {code}\n{worker.tail()}"
    assert str(store_path(state_dir, "sqlite", app, 0)) in log, worker.tail()
    acknowledged = len(records) - unacknowledged(rclient, topic, app)
    # What was committed before the deletion, plus at most the batches in hand while it happened.
    assert acknowledged <= applied_before + 2 * BATCH, (
        f"{acknowledged - applied_before} entries acknowledged after the state dir was deleted"
    )


def test_a_store_that_fails_to_open_gives_its_leases_up_at_once(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    produce(topic, order_records(200, 20, seed=4))
    first = spawn("first", topic, app, *RUN, "--until-idle")
    assert first.wait(60) == 0, first.tail()
    path = store_path(state_dir, "sqlite", app, 1)
    path.write_bytes(b"this is not a SQLite database, " * 512)
    os.utime(path)

    second = spawn("second", topic, app, *RUN, "--lease-ttl-ms", "30000")
    code = second.wait(30)
    assert code == 5, f"exit code {code}\n{second.tail()}"
    assert str(path) in second.log.read_text(), second.tail()
    assert all(lease is None for lease in leases(rclient, topic, app, 2).values()), (
        "the worker died with leases still held: they block the partitions for their whole TTL"
    )
    assert not held_by(rclient, topic, app, 2, second.pid)
