"""A running worker's stores: a second writer is refused at once, readers still read, both engines.

The conformance suite covers two plain opens; here the first is a real ``pspf run`` worker
holding its partitions, and the others are this process, ``pspf state import`` (a writer) and
``pspf state get`` / ``pspf state export`` (read-only opens, which must not take the lock).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.errors import StoreLocked
from pspf.keys import StreamId, stream_key
from pspf.state_stores import open_store
from pspf.state_stores import store_path as store_location
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import ENGINES, expected_state, held_by, order_records, read_store
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 2
ENTRIES = 3_000
#: About 4.5 s of work in all, so the worker is busy committing while the others open its stores.
WORK_US = 1_500
#: "Fails fast": the refused open returns within this, instead of waiting for the lock.
FAST_S = 0.5


def _pspf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        pspf_command(*args), capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=cwd
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_running_worker_keeps_a_second_writer_out_and_readers_in(
    engine: str,
    spawn: Spawner,
    state_dir: Path,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 50, seed=3)
    produce(topic, records)
    options = ["--store", engine, "--batch-size", "20", "--block-ms", "100", "--consumer", "first"]
    worker = spawn("worker", topic, app, *options, "--until-idle", env={"PSPF_TEST_WORK_US": str(WORK_US)})
    wait_until(lambda: held_by(rclient, topic, app, PARTITIONS, worker.pid), 20, "the worker's leases")
    # A committed checkpoint in every store: the worker has each store open.
    wait_until(
        lambda: all(topic in read_store(state_dir, app, p, engine)[0] for p in range(PARTITIONS)),
        20,
        "a first commit in every partition",
    )

    # A second writer, this process: refused at once, with a clear StoreLocked naming the store.
    for p in range(PARTITIONS):
        started = time.perf_counter()
        try:
            with pytest.raises(StoreLocked) as refused:
                open_store(engine, state_dir, app, p).close()
        finally:
            took = time.perf_counter() - started
        print(f"{engine}: the refused open of partition {p} took {took * 1000:.1f} ms")
        assert took < FAST_S, f"the refused open of partition {p} took {took:.3f} s"
        message = str(refused.value)
        assert str(store_location(state_dir, engine, app, p)) in message
        assert "is in use by" in message
        if engine == "sqlite":
            assert f"process {worker.pid}" in message  # the lock file names its holder

    # `pspf state import` (a writer too) fails with the same error and its exit code, writing nothing.
    export = tmp_path / "other.ndjson"
    export.write_text(json.dumps({"kind": "checkpoints", "partition": 0, "checkpoints": {}}) + "\n")
    store_args = ["--state-dir", str(state_dir), "--store", engine]
    refused_import = _pspf("state", "import", app, "--file", str(export), *store_args, cwd=tmp_path)
    assert refused_import.returncode == StoreLocked.exit_code, refused_import.stderr
    assert "is in use by" in refused_import.stderr

    # Readers do not take the lock: `pspf state get` and `pspf state export` work meanwhile.
    assert worker.alive(), f"the worker finished too early for this test\n{worker.tail()}"
    _, state0 = read_store(state_dir, app, 0, engine)
    key = sorted(state0)[0]
    got = _pspf("state", "get", app, key, "--json", "--broker", redis_url, *store_args, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["count"] >= 1

    exported = _pspf("state", "export", app, *store_args, cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert worker.alive(), "the reads should have happened while the worker ran"
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    checkpoints = {line["partition"]: line["checkpoints"] for line in lines if line["kind"] == "checkpoints"}
    assert sorted(checkpoints) == list(range(PARTITIONS))
    for p in range(PARTITIONS):
        # A snapshot: each partition's counts add up to the entries at or below its checkpoint.
        checkpoint = StreamId.parse(checkpoints[p][topic])
        below = len(rclient.xrange(stream_key(topic, p), "-", str(checkpoint)))
        counted = sum(
            line["state"]["count"]
            for line in lines
            if line.get("partition") == p and line.get("namespace") == "state"
        )
        assert counted == below, f"partition {p}: export counts {counted}, checkpoint covers {below}"

    # The worker finishes undisturbed; then its locks are gone and the state is exact.
    assert worker.wait(timeout=60) == 0, worker.tail()
    for p in range(PARTITIONS):
        with open_store(engine, state_dir, app, p) as store:
            assert store.integrity_check() == "ok"
    final = _pspf("state", "get", app, key, "--json", "--broker", redis_url, *store_args, cwd=tmp_path)
    assert final.returncode == 0, final.stderr
    count, total = expected_state(records)[key]
    assert json.loads(final.stdout) == {"count": count, "total": total}
