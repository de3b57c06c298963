"""Warm standby: a worker on another state dir keeps its stores following the owner's backups, and
takes over after a SIGKILL of the owner without a full restore; exact state."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, backup_meta_key
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import assert_exact, held_by, order_records
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

#: One partition: the worker that joined first owns it, the other one only stands by.
PARTITIONS = 1


def _order(identity: str | None) -> tuple[int, int]:
    """An identity ``token-seq`` as numbers, to tell which of two is later."""
    if not identity:
        return (-1, -1)
    token, _, seq = identity.rpartition("-")
    return int(token), int(seq)


def store_identity(state_dir: Path, app: str, partition: int) -> str | None:
    try:
        with open_store("sqlite", state_dir, app, partition, readonly=True) as store:
            raw = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
    except Exception:  # not created yet, or caught between its file and its tables
        return None
    return None if raw is None else raw.decode()


def test_a_standby_follows_within_a_second_and_takes_over_after_kill9_without_a_full_restore(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(12_000, 300, seed=41)
    produce(topic, records)
    options = ["--broker", redis_url, "--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "1500"]
    owner = spawn(
        "owner",
        topic,
        app,
        *options,
        "--state-dir",
        str(tmp_path / "a"),
        env={"PSPF_TEST_WORK_US": "600"},
        cli_settings=False,
    )
    wait_until(
        lambda: held_by(rclient, topic, app, PARTITIONS, owner.pid), 30, "the owner holds the partition"
    )
    follower_dir = tmp_path / "b"
    standby = spawn(
        "standby",
        topic,
        app,
        *options,
        "--state-dir",
        str(follower_dir),
        "--standby",
        "--until-idle",
        cli_settings=False,
    )

    for p in range(PARTITIONS):
        wait_until(lambda p=p: store_identity(follower_dir, app, p), 30, "the standby's first restore")
    # The lag: from the moment a new identity shows in the backup to the moment the standby's
    # store holds it (or a later one), measured on 20 batches.
    lags: list[float] = []
    meta = [backup_meta_key(topic, p, app) for p in range(PARTITIONS)]
    while len(lags) < 20:
        partition = len(lags) % PARTITIONS
        before = rclient.hget(meta[partition], BACKUP_IDENTITY)
        changed = wait_until(
            lambda p=partition, b=before: (now := rclient.hget(meta[p], BACKUP_IDENTITY)) != b and now,
            30,
            "a new batch",
            interval=0.002,
        )
        seen = time.monotonic()
        target = _order(changed.decode())
        wait_until(
            lambda p=partition, t=target: _order(store_identity(follower_dir, app, p)) >= t,
            10,
            f"the standby to reach {changed!r}",
            interval=0.005,
        )
        lags.append(time.monotonic() - seen)
    lags.sort()
    print(f"standby lag over {len(lags)} batches: median {lags[len(lags) // 2]:.3f}s, max {lags[-1]:.3f}s")
    assert lags[-1] < 1.0, lags
    assert owner.alive(), "the owner finished before it was killed"

    assert owner.kill9() == -9
    assert standby.wait(120) == 0, standby.tail()
    log = standby.log.read_text()
    for p in range(PARTITIONS):
        taken = [
            line
            for line in log.splitlines()
            if f"app={app} partition={p} " in line and "state backup" in line
        ]
        assert taken, standby.tail()
        assert "state backup in sync" in taken[-1] or "state backup caught up" in taken[-1], taken
    assert "a full restore" not in log, standby.tail()
    assert "Traceback" not in log
    print("\n".join(line for line in log.splitlines() if "state backup" in line or "standby" in line))
    assert_exact(rclient, follower_dir, topic, app, PARTITIONS, records)
