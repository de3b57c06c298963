"""SIGKILL at named points of the batch cycle; a restart finishes with exactly-once state."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.keys import StreamId, stream_key
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import (
    ENGINES,
    assert_exact,
    assert_no_ack_before_commit,
    assert_store_files,
    backup_applied,
    no_leases,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 6_000
LEASE_TTL_MS = 1000
BATCH = 50
OPTIONS = ["--batch-size", str(BATCH), "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("crash", "is_async"),
    [
        pytest.param("handler:1777", False, id="in-handler-after-state-update"),
        pytest.param("commit:13", False, id="after-one-partition-commit"),
        pytest.param("ack:7", False, id="after-commit-before-ack"),
        pytest.param("handler:1777", True, id="async-in-handler-after-state-update"),
        pytest.param("ack:7", True, id="async-after-commit-before-ack"),
    ],
)
def test_crash_point_then_restart_is_exact(
    crash: str,
    is_async: bool,
    engine: str,
    spawn: Spawner,
    state_dir: Path,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 200, seed=11)
    produce(topic, records)
    marker = tmp_path / "crashed.json"
    env = {"PSPF_TEST_CRASH": crash, "PSPF_TEST_MARKER": str(marker), "PSPF_TEST_ASYNC": str(int(is_async))}
    options = [*OPTIONS, "--consumer", "crash-w", "--store", engine]

    first = spawn("first", topic, app, *options, "--until-idle", env=env)
    assert first.wait(timeout=30) == -9, f"the crash point was not reached\n{first.tail()}"
    report = json.loads(marker.read_text())
    views = view_all(rclient, state_dir, topic, app, PARTITIONS, engine)
    assert_no_ack_before_commit(views)
    applied = sum(v.applied for v in views)
    assert 0 < applied < ENTRIES
    done = sum(v.pending_done for v in views)
    by_partition = {v.partition: v for v in views}

    if report["where"] == "handler":
        # The entry's state update died with the process: not committed, still pending.
        v = by_partition[report["partition"]]
        entry = StreamId.parse(report["id"])
        assert v.checkpoint is None or v.checkpoint < entry
        assert entry in v.pending
    elif report["where"] == "commit":
        # The partition just committed holds its batch pending; the others hold nothing done.
        assert by_partition[report["partition"]].pending_done == report["applied"] > 0
        assert done == report["applied"]
    else:
        # Every partition of the cycle committed, nothing of it acknowledged. Pending beyond that:
        # at most the next batch, read ahead while this one ran, after every committed entry.
        unacked = report["unacked"]
        for v in views:
            assert v.pending_done == unacked.get(stream_key(topic, v.partition), 0)
            assert v.pending_todo <= BATCH
            ahead = [i for i in v.pending if v.checkpoint is None or i > v.checkpoint]
            assert all(i > done_id for i in ahead for done_id in v.pending if done_id not in ahead)
        assert done == sum(unacked.values()) > 0

    in_backup = backup_applied(rclient, topic, app, PARTITIONS)
    assert in_backup == applied - done
    wait_until(lambda: no_leases(rclient, topic, app, PARTITIONS), 10, "the dead worker's leases to expire")
    second = spawn("second", topic, app, *options, "--until-idle", env=env)
    assert second.wait(timeout=30) == 0, second.tail()
    handled, skipped, failures = second.summary()
    # What was committed but not acknowledged is not in the backup: the store is rolled back to
    # the backup and those entries are applied again, once.
    assert (handled, skipped, failures) == (ENTRIES - in_backup, 0, 0)
    if done:
        assert "state backup restored" in second.log.read_text(), second.tail()
    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records, engine)
    assert_store_files(state_dir, app, PARTITIONS, engine)
