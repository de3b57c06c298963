"""``pspf run --until-idle`` right after a worker was killed must still finish the work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import assert_exact, backup_applied, held_by, leases, order_records, view_all
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 2
ENTRIES = 3_000
LEASE_TTL_MS = 5000


def test_until_idle_after_sigkill_processes_everything(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The recovery run of a crashed batch job must not exit while the work is undone.

    The killed worker's leases live on for up to the lease TTL. A restarted ``--until-idle``
    worker (same consumer name, as after a pod restart) must wait for them instead of reporting
    success with nothing processed.
    """
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 50, seed=3)
    produce(topic, records)
    options = ["--batch-size", "50", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
    options += ["--consumer", "job"]
    env = {"PSPF_TEST_WORK_US": "300"}

    first = spawn("first", topic, app, *options, env=env)
    wait_until(lambda: held_by(rclient, topic, app, PARTITIONS, first.pid), 15, "the worker to start")
    wait_until(
        lambda: sum(v.applied for v in view_all(rclient, state_dir, topic, app, PARTITIONS)) > 0,
        15,
        "the first commit",
    )
    assert first.kill9() == -9
    applied = sum(v.applied for v in view_all(rclient, state_dir, topic, app, PARTITIONS))
    assert applied < ENTRIES
    assert all(leases(rclient, topic, app, PARTITIONS).values()), "the dead worker's leases live on"

    left = ENTRIES - backup_applied(rclient, topic, app, PARTITIONS)  # a store ahead is rolled back
    recovery = spawn("recovery", topic, app, *options, "--until-idle", env=env)
    assert recovery.wait(timeout=45) == 0, recovery.tail()
    handled, _, _ = recovery.summary()
    assert handled == left, (
        f"--until-idle exited after handling {handled} of the {left} entries left, "
        f"while the killed worker's leases had not expired yet\n{recovery.tail(8)}"
    )
    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records)
