"""Two workers of one app: one owner per partition, and takeover after SIGKILL within the lease TTL."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import (
    WorkerProcess,
    all_state,
    assert_exact,
    assert_no_ack_before_commit,
    leases,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 20_000
LEASE_TTL_MS = 2000
WORK_US = 200


def owners_by_partition(state: dict[int, dict[str, dict[str, Any]]]) -> dict[int, set[str]]:
    """The worker labels that handled entries of each partition (from the state's ``by``)."""
    return {p: {who for value in keys.values() for who in value["by"]} for p, keys in state.items()}


def test_two_workers_one_owner_each_then_takeover_after_sigkill(
    spawn: Spawner,
    state_dir: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 400, seed=5)

    def start(label: str) -> WorkerProcess:
        # Settings from PSPF_* variables only, as a container would pass them.
        env = {
            "PSPF_BROKER": redis_url,
            "PSPF_STATE_DIR": str(state_dir),
            "PSPF_CONSUMER": label,
            "PSPF_LEASE_TTL_MS": str(LEASE_TTL_MS),
            "PSPF_BATCH_SIZE": "100",
            "PSPF_BLOCK_MS": "100",
            "PSPF_TEST_WORK_US": str(WORK_US),
            "PSPF_TEST_WHO": label,
        }
        return spawn(label, topic, app, env=env, cli_settings=False)

    workers = {"wa": start("wa"), "wb": start("wb")}
    by_pid = {w.pid: label for label, w in workers.items()}

    def all_held() -> dict[int, Any] | None:
        """Every partition owned, and by both workers: the first one to start held all until the
        second joined, and a lease round later gives the second its share."""
        held = leases(rclient, topic, app, PARTITIONS)
        owners = [lease.consumer for lease in held.values() if lease is not None]
        # Each its share, not merely both some: the second may take a free partition before the
        # first, which took the rest, gives one up at its next lease round.
        shared = len(owners) == PARTITIONS and all(
            owners.count(w) == PARTITIONS // len(workers) for w in workers
        )
        return held if shared else None

    for worker in workers.values():
        wait_until(lambda w=worker: b"worker started" in w.log.read_bytes(), 20, "both workers to start")
    held = wait_until(all_held, 20, "every partition to be owned")
    produce(topic, records)  # once the two share the partitions: each entry has one owner
    wait_until(
        lambda: sum(v.applied for v in view_all(rclient, state_dir, topic, app, PARTITIONS)) >= 2000,
        20,
        "some progress",
    )
    # One owner per partition: the lease names it, and only it has handled the partition's entries.
    held_now = leases(rclient, topic, app, PARTITIONS)
    assert held_now == held, f"leases moved between two live workers: {held} -> {held_now}"
    owner = {p: by_pid[lease.pid] for p, lease in held.items()}
    for p, lease in held.items():
        assert lease.consumer == owner[p]
    for p, who in owners_by_partition(all_state(state_dir, app, PARTITIONS)).items():
        assert who <= {owner[p]}, f"partition {p} owned by {owner[p]} was handled by {who}"
    for v in view_all(rclient, state_dir, topic, app, PARTITIONS):
        assert set(v.pending.values()) <= {owner[v.partition]}

    # Kill the worker that owns most partitions (a standby owns none).
    counts = {label: list(owner.values()).count(label) for label in workers}
    victim = max(counts, key=lambda label: counts[label])
    survivor = next(label for label in workers if label != victim)
    print(f"owners before the kill: {owner}")
    assert workers[victim].kill9() == -9
    killed_at = time.monotonic()
    assert_no_ack_before_commit(view_all(rclient, state_dir, topic, app, PARTITIONS))

    survivor_pid = workers[survivor].pid
    wait_until(
        lambda: all(
            lease is not None and lease.pid == survivor_pid
            for lease in leases(rclient, topic, app, PARTITIONS).values()
        ),
        LEASE_TTL_MS / 1000 + 10,
        "the survivor to take over",
    )
    takeover_s = time.monotonic() - killed_at
    print(f"takeover after {takeover_s:.2f}s")
    assert takeover_s < LEASE_TTL_MS / 1000 + 1.5, f"takeover took {takeover_s:.2f}s"
    after = leases(rclient, topic, app, PARTITIONS)
    for p, lease in after.items():
        assert lease is not None
        if owner[p] == victim:
            assert lease.token > held[p].token, "a new owner must get a new fencing token"

    def finished() -> bool:
        views = view_all(rclient, state_dir, topic, app, PARTITIONS)
        assert_no_ack_before_commit(views)  # also while the survivor works
        return all(not v.pending and v.checkpoint == v.last_id for v in views)

    wait_until(finished, 60, "the survivor to finish every partition", interval=0.2)
    workers[survivor].proc.send_signal(signal.SIGTERM)
    assert workers[survivor].wait(timeout=5) == 0

    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records)
    handled_by = owners_by_partition(all_state(state_dir, app, PARTITIONS))
    for p in range(PARTITIONS):
        if owner[p] == survivor:
            assert handled_by[p] == {survivor}
        else:
            assert handled_by[p] == {victim, survivor}, f"partition {p}: {handled_by[p]}"
