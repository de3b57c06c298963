"""A worker takes a partition it should own when the lease or membership that keeps it out runs out.

Not at its next lease round, a third of the TTL later: a dead owner's lease expires, the standby
looks again at that moment (its next round is scheduled then), finds the lease free and takes it.
The leases themselves are unchanged: nothing is taken before the server expired it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.broker import Broker
from pspf.hooks import CycleResult
from pspf.keys import lease_key, members_key
from pspf.ownership import PartitionLeases
from tests.conftest import Names

pytestmark = pytest.mark.integration

TTL_MS = 3000  # a lease round every second
GHOST = "ghost/1/00000000|7"  # a lease value of a worker that is gone


@pytest.fixture
def make_worker(
    make_settings: Callable[..., Settings], names: Names, tmp_path: Path
) -> Callable[[str, str], Worker]:
    app_name = names.app()
    made: list[Worker] = []

    def make(topic: str, name: str) -> Worker:
        app = App(app_name)

        @app.handler(topic)
        def count(value: dict[str, int], ctx: Context) -> None:
            ctx.state["n"] = ctx.state.get("n", 0) + 1

        settings = make_settings(
            PSPF_CONSUMER=name,
            PSPF_STATE_DIR=str(tmp_path / name),
            PSPF_LEASE_TTL_MS=TTL_MS,
            PSPF_BLOCK_MS=1000,
        )
        worker = Worker(app, settings)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker._shutdown()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def regular_round(worker: Worker) -> float:
    return worker._renewed_at + TTL_MS / 3000


def assert_at(due: float, expiry: float) -> None:
    """``due`` is the expiry seen from here, not before it (10 ms: the servers' ms are floored and
    a cluster's nodes each keep their time), and not much later (the round trips of the look)."""
    assert expiry - 0.01 <= due <= expiry + 0.25


def test_a_lease_held_by_another_is_looked_at_again_when_it_runs_out(
    make_topic: Callable[[int], str], make_worker: Callable[[str, str], Worker], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    worker = make_worker(topic, "standby")
    worker._start()
    lease = lease_key(topic, 0, worker.app.name)
    rclient.set(lease, GHOST, px=400)

    worker._lease_round()
    assert not worker.processor.owned  # its only member wants it, but the lease is held
    before_look = time.monotonic()
    left_s = rclient.pttl(lease) / 1000
    due = worker._next_round_at()

    assert due < regular_round(worker)
    assert_at(due, before_look + left_s)
    time.sleep(max(0.0, due - time.monotonic()))
    worker._lease_round()
    assert list(worker.processor.owned) == [0]  # free at that moment, and taken


def test_a_dead_members_partitions_are_looked_at_when_its_membership_runs_out(
    make_topic: Callable[[int], str], make_worker: Callable[[str, str], Worker], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    dead, standby = make_worker(topic, "owner"), make_worker(topic, "standby")
    dead._start()
    dead._lease_round()
    assert list(dead.processor.owned) == [0]
    standby._start()
    # The owner died a little less than a TTL ago: its membership and lease have 400 ms left
    # (its lease a little less: a round renews the leases before the membership).
    expiry_ms = server_ms(rclient) + 400
    rclient.zadd(members_key(dead.app.name), {dead.membership.member: expiry_ms}, xx=True)
    rclient.pexpire(lease_key(topic, 0, dead.app.name), 390)

    standby._lease_round()
    assert not standby.processor.owned  # the owner is still a member: the partition is its own
    assert standby._lease_free_at is None  # so its lease was not looked at
    before_look = time.monotonic()
    left_s = (expiry_ms - server_ms(rclient)) / 1000
    due = standby._next_round_at()

    assert due < regular_round(standby)
    assert_at(due, before_look + left_s)
    time.sleep(max(0.0, due - time.monotonic()))
    standby._lease_round()
    assert list(standby.processor.owned) == [0]


def test_no_moment_is_set_by_a_live_member_or_a_lease_without_expiry(
    make_topic: Callable[[int], str], make_worker: Callable[[str, str], Worker], rclient: redis.Redis
) -> None:
    topic = make_topic(2)
    first, second = make_worker(topic, "first"), make_worker(topic, "second")
    first._start()
    first._lease_round()
    second._start()
    second._lease_round()
    # A live member renews its membership a third of a TTL apart: it never expires first.
    assert second._next_round_at() == regular_round(second)

    # A lease without a time to live (set by hand) frees itself never: no moment to look at.
    for partition in list(first.processor.owned):
        first._drop(partition, release=True)
    rclient.set(lease_key(topic, 0, first.app.name), GHOST)
    rclient.set(lease_key(topic, 1, first.app.name), GHOST)
    first._lease_round()
    assert first._lease_free_at is None
    assert first._next_round_at() == regular_round(first)


def test_a_partition_of_several_topics_is_free_when_its_last_lease_runs_out(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    orders, refunds = make_topic(2), make_topic(2)
    broker = Broker(make_settings().redis)
    leases = PartitionLeases(broker, "app-x", [orders, refunds], "me/1/00000000", TTL_MS)
    try:
        rclient.set(lease_key(orders, 0, "app-x"), GHOST, px=300)
        rclient.set(lease_key(refunds, 0, "app-x"), GHOST, px=2500)
        rclient.set(lease_key(refunds, 1, "app-x"), GHOST, px=1500)

        found = leases.takeable([0, 1])

        assert found.free == []
        # Partition 1 frees after about 1.5 s, partition 0 only after 2.5 s (its refunds lease).
        assert found.next_expiry_ms is not None and 1000 < found.next_expiry_ms <= 1500
        rclient.delete(lease_key(refunds, 1, "app-x"))
        assert leases.takeable([0, 1]).free == [1]
    finally:
        broker.close()


def test_the_read_after_a_round_ends_by_the_next_round(
    make_topic: Callable[[int], str], make_worker: Callable[[str, str], Worker], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    worker = make_worker(topic, "standby")
    rclient.set(lease_key(topic, 0, worker.app.name), GHOST, px=400)
    asked: list[tuple[bool, int | None]] = []

    def run_once(block: bool = True, block_ms: int | None = None) -> CycleResult:
        asked.append((block, block_ms))
        worker.stop()
        return CycleResult()

    worker.processor.run_once = run_once  # type: ignore[method-assign]
    worker.run()

    # The lease runs out in 400 ms: the read waits that long at most, not its block of 1000 ms.
    assert len(asked) == 1 and asked[0][0] is True
    assert asked[0][1] is not None and asked[0][1] <= 402
