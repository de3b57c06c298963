"""SIGKILL a worker at random moments, again and again: the state stays exactly-once."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import (
    ENGINES,
    assert_exact,
    assert_no_ack_before_commit,
    assert_store_files,
    backup_applied,
    held_by,
    no_leases,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 50_000
KILLS = 12
LEASE_TTL_MS = 1000
#: Busy work per entry: about 6,000 entries/s, so the kills land mid-stream.
WORK_US = 150


@pytest.mark.parametrize("engine", ENGINES)
def test_random_sigkills_leave_exact_state(
    engine: str,
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 300, seed)
    assert produce(topic, records) == ENTRIES
    options = ["--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
    options += ["--consumer", "crash-w", "--store", engine]
    env = {"PSPF_TEST_WORK_US": str(WORK_US)}

    applied = [0]
    mid_batch = 0
    for life in range(KILLS):
        worker = spawn(f"life{life}", topic, app, *options, env=env)
        # A restarted worker waits for the dead one's leases to expire; kill it once it works.
        wait_until(
            lambda w=worker: held_by(rclient, topic, app, PARTITIONS, w.pid) or not w.alive(),
            timeout=LEASE_TTL_MS / 1000 + 15,
            what="the worker to take every partition",
        )
        time.sleep(rng.uniform(0.0, 0.05) if life % 4 == 3 else rng.uniform(0.05, 0.5))
        assert worker.alive(), f"worker exited by itself\n{worker.tail()}"
        assert worker.kill9() == -9

        views = view_all(rclient, state_dir, topic, app, PARTITIONS, engine)
        assert_no_ack_before_commit(views)
        # A store may be ahead of its backup (killed between commit and ack: rolled back at the
        # next takeover); the backup, what a new owner starts from, never goes back.
        applied.append(backup_applied(rclient, topic, app, PARTITIONS))
        assert applied[-1] >= applied[-2], "the state backup went backwards"
        mid_batch += any(v.pending for v in views)

    progressed = sum(1 for a, b in itertools.pairwise(applied) if b > a)
    print(f"applied after each kill: {applied[1:]}")
    assert 0 < applied[-1] < ENTRIES, "the kills should land mid-stream"
    assert progressed >= KILLS // 2, f"too few lives made progress: {applied}"
    assert mid_batch >= 1, "no kill left entries pending"

    # Work around the --until-idle early exit while a dead worker's lease lives (see
    # test_until_idle_after_sigkill_processes_everything): let the leases expire first.
    wait_until(lambda: no_leases(rclient, topic, app, PARTITIONS), 10, "the dead worker's leases to expire")
    in_backup = backup_applied(rclient, topic, app, PARTITIONS)
    final = spawn("final", topic, app, *options, "--until-idle", env=env)
    assert final.wait(timeout=60) == 0, final.tail()

    handled, skipped, failures = final.summary()
    assert failures == 0
    # Stores ahead of their backup (committed, not acknowledged) are rolled back to it: every
    # entry the backup lacks is applied once more, none is skipped.
    assert (handled, skipped) == (ENTRIES - in_backup, 0)
    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records, engine)
    assert_store_files(state_dir, app, PARTITIONS, engine)
