"""Live, idle owners keep their leases: ownership must not flap between two live workers."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import assert_exact, held_by, leases, order_records, view_all
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 2


def test_idle_owner_keeps_its_leases_with_a_short_ttl(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """``--lease-ttl-ms 1000`` (the minimum is 500) with the default ``--block-ms`` (1000).

    The owner renews its leases between cycles, but an idle cycle blocks in XREADGROUP for
    ``--block-ms``: unless the worker keeps the block shorter than the lease (or the settings
    refuse the combination), the leases of a healthy owner expire on every idle read and the
    other worker takes partitions from it.
    """
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(100, 10, seed=37)
    produce(topic, records)
    options = ["--lease-ttl-ms", "1000"]
    owner = spawn("owner", topic, app, *options, "--consumer", "one")
    wait_until(lambda: held_by(rclient, topic, app, PARTITIONS, owner.pid), 15, "the owner to start")
    wait_until(
        lambda: all(v.checkpoint == v.last_id for v in view_all(rclient, state_dir, topic, app, PARTITIONS)),
        15,
        "the owner to finish the input",
    )
    second = spawn("second", topic, app, *options, "--consumer", "two")
    wait_until(lambda: b"worker started" in second.log.read_bytes(), 15, "the second worker to start")
    # Work sharing moves one partition to the newcomer, once; from then on nothing moves.
    wait_until(
        lambda: (
            sorted(lease.consumer for lease in leases(rclient, topic, app, PARTITIONS).values() if lease)
            == ["one", "two"]
        ),
        15,
        "the partitions to spread over both workers",
    )

    first = leases(rclient, topic, app, PARTITIONS)
    seen = set()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        now = leases(rclient, topic, app, PARTITIONS)
        seen |= {(p, lease.consumer, lease.token) for p, lease in now.items() if lease is not None}
        time.sleep(0.02)
    assert owner.alive() and second.alive()
    moved = sorted(seen - {(p, lease.consumer, lease.token) for p, lease in first.items() if lease})
    expired = owner.log.read_bytes().count(b"lease expired")
    assert not moved and not expired, (
        f"the idle owner lost its leases {expired} times in 4 s; leases taken since: {moved[:6]}"
    )
    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records)


def test_a_restarted_worker_says_once_which_partitions_it_waits_for_and_until_when(
    spawn: Spawner,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """After a kill -9 the restarted worker (same consumer name) waits up to the TTL for the dead
    run's membership and leases to run out: it says so once, naming the partitions and when."""
    topic, app = make_topic(PARTITIONS), names.app()
    options = ["--lease-ttl-ms", "4000", "--consumer", "one"]
    dead = spawn("dead", topic, app, *options)
    wait_until(lambda: held_by(rclient, topic, app, PARTITIONS, dead.pid), 15, "the first run to start")
    dead.kill9()
    killed = time.time()
    restarted = spawn("restarted", topic, app, *options)
    wait_until(
        lambda: held_by(rclient, topic, app, PARTITIONS, restarted.pid), 20, "the restart to take over"
    )

    lines = restarted.log.read_text().splitlines()
    said = [line for line in lines if "waiting for partitions" in line]
    assert len(said) == 1, "\n".join(lines)
    assert " INFO " in said[0] and "[0, 1]" in said[0], said[0]
    until = re.search(r"until about (\d\d:\d\d:\d\d)", said[0])
    assert until is not None, said[0]
    # The dead run's membership and leases ran out at most a TTL after it was killed.
    expected = time.strftime("%H:%M:%S", time.localtime(killed + 4))
    assert abs(_seconds(until.group(1)) - _seconds(expected)) <= 2, (said[0], expected)
    assert lines.index(said[0]) < next(i for i, line in enumerate(lines) if "partition assigned" in line)


def _seconds(clock: str) -> int:
    h, m, s = (int(part) for part in clock.split(":"))
    return h * 3600 + m * 60 + s
