"""A worker takes a partition it should own when the membership or lease that keeps it out runs out.

Not at its next lease round, a third of the TTL later: a dead owner's membership expires, the
standby looks again at that moment (its next round is scheduled then), finds the lease free and
takes it. The leases themselves are unchanged: nothing is taken before the server expired it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.broker import Broker
from pspf.hooks import CycleResult
from pspf.keys import lease_key, members_key
from pspf.ownership.owning import PartitionLeases
from tests.conftest import Names

pytestmark = pytest.mark.integration

TTL_MS = 3000  # a lease round every second
GHOST = "ghost/1/00000000"  # a worker that is no member
MakeWorker = Callable[[str, str], Worker]


@pytest.fixture
def make_worker(make_settings: Callable[..., Settings], names: Names, tmp_path: Path) -> Iterator[MakeWorker]:
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
        worker.shutdown()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def regular_round(worker: Worker) -> float:
    return worker.lease_round.round_at + TTL_MS / 3000


def test_a_dead_members_partitions_are_looked_at_when_its_membership_runs_out(
    make_topic: Callable[[int], str], make_worker: MakeWorker, rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    dead, standby = make_worker(topic, "owner"), make_worker(topic, "standby")
    dead.start()
    dead.lease_round.step()
    assert list(dead.processor.owned) == [0]
    standby.start()
    # The owner died a little less than a TTL ago: its membership has 400 ms left, its lease a
    # little less (a worker renews its leases before its membership).
    expiry_ms = server_ms(rclient) + 400
    rclient.zadd(members_key(dead.app.name), {dead.membership.member: expiry_ms}, xx=True)
    rclient.pexpire(lease_key(topic, 0, dead.app.name), 390)

    standby.lease_round.step()
    assert not standby.processor.owned  # the owner is still a member: the partition is its own
    before_look = time.monotonic()
    left_s = (expiry_ms - server_ms(rclient)) / 1000
    due = standby.lease_round.next_at()

    assert due < regular_round(standby)
    # At the expiry as seen from here: not before it (10 ms: the servers' ms are floored and a
    # cluster's nodes each keep their time), and not much later (the round trips of the look).
    assert before_look + left_s - 0.01 <= due <= before_look + left_s + 0.25
    time.sleep(max(0.0, due - time.monotonic()))
    standby.lease_round.step()
    assert list(standby.processor.owned) == [0]  # gone then, its lease free: taken at once


def test_a_lease_whose_holder_is_no_member_is_looked_at_again_until_it_runs_out(
    make_topic: Callable[[int], str], make_worker: MakeWorker, rclient: redis.Redis
) -> None:
    """It runs out with the holder's membership or moments after: looks 10 ms apart, then twice
    as far each time, not a lease round later."""
    topic = make_topic(1)
    worker = make_worker(topic, "standby")
    worker.start()
    rclient.set(lease_key(topic, 0, worker.app.name), f"{GHOST}|7", px=300)

    rounds = 0
    while not worker.processor.owned:
        assert rounds < 10, "the lease ran out long ago: it would have been taken"
        worker.lease_round.step()
        rounds += 1
        if not worker.processor.owned:
            assert worker.lease_round.next_at() < regular_round(worker)
            time.sleep(max(0.0, worker.lease_round.next_at() - time.monotonic()))
    assert rounds > 1  # the first look found it held
    assert worker.lease_round.look_again_at is None  # nothing is held by a gone worker any more


def test_looks_at_a_lease_that_never_runs_out_space_out_to_the_lease_round(
    make_topic: Callable[[int], str], make_worker: MakeWorker, rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    worker = make_worker(topic, "standby")
    worker.start()
    rclient.set(lease_key(topic, 0, worker.app.name), f"{GHOST}|7")  # set by hand: no TTL

    gaps = []
    for _ in range(9):
        worker.lease_round.step()
        assert worker.lease_round.look_again_at is not None
        gaps.append(round(worker.lease_round.look_again_at - time.monotonic(), 2))

    assert not worker.processor.owned
    assert gaps[:4] == pytest.approx([0.01, 0.02, 0.04, 0.08], abs=0.006)
    assert gaps[-1] == pytest.approx(1.0, abs=0.02)  # the regular round's period: no busy loop


def test_a_live_members_lease_and_membership_set_no_earlier_round(
    make_topic: Callable[[int], str], make_worker: MakeWorker
) -> None:
    topic = make_topic(2)
    first, second = make_worker(topic, "first"), make_worker(topic, "second")
    first.start()
    first.lease_round.step()
    second.start()
    second.lease_round.step()
    assert second.lease_round.next_at() == regular_round(second)  # first renews long before it expires
    time.sleep(TTL_MS / 3000 + 0.05)  # second counts now: one partition moves to it

    second.lease_round.step()
    # The partition is second's to take, but first, alive, holds it until its next round hands
    # it over: nothing to look at before second's own next round.
    assert not second.processor.owned and second.lease_round.look_again_at is None
    assert second.lease_round.next_at() == regular_round(second)


def test_a_worker_renews_its_leases_before_its_membership(
    make_topic: Callable[[int], str], make_worker: MakeWorker
) -> None:
    """So when its membership runs out, so have they: a dead worker's partitions are free then.

    The lease keeper renews both, on its own connection (``pspf.ownership.leases``).
    """
    topic = make_topic(2)
    worker = make_worker(topic, "owner")
    worker.start()
    worker.lease_round.step()
    assert sorted(worker.processor.owned) == [0, 1]
    calls: list[str] = []

    def recorded(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return call(*args, **kwargs)

        return wrapper

    keeper = worker.keeper
    keeper.leasing.renew_leases = recorded("leases", keeper.leasing.renew_leases)  # type: ignore[method-assign]
    keeper.leasing.member_heartbeat = recorded("membership", keeper.leasing.member_heartbeat)  # type: ignore[method-assign]
    assert keeper.renew() == []
    assert calls == ["leases", "membership"]


def test_takeable_names_the_holders_of_the_leases_it_finds_held(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    orders, refunds = make_topic(2), make_topic(2)
    broker = Broker(make_settings().redis)
    leases = PartitionLeases(broker.leases, "app-x", [orders, refunds], "me/1/00000000", TTL_MS)
    try:
        rclient.set(lease_key(refunds, 0, "app-x"), f"{GHOST}|3", px=5000)
        rclient.set(lease_key(orders, 1, "app-x"), "other/2/00000000|4", px=5000)

        found = leases.takeable([0, 1])

        assert found.free == []  # a partition is free when its leases of every topic are
        assert found.holders == {GHOST, "other/2/00000000"}
        rclient.delete(lease_key(refunds, 0, "app-x"))
        assert leases.takeable([0, 1]) == ([0], {"other/2/00000000"})
    finally:
        broker.close()


def test_the_read_after_a_round_ends_by_the_next_round(
    make_topic: Callable[[int], str], make_worker: MakeWorker, rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    worker = make_worker(topic, "standby")
    rclient.set(lease_key(topic, 0, worker.app.name), f"{GHOST}|7", px=5000)
    asked: list[tuple[bool, int | None]] = []

    def run_once(block: bool = True, block_ms: int | None = None) -> CycleResult:
        asked.append((block, block_ms))
        worker.stop()
        return CycleResult()

    worker.processor.run_once = run_once  # type: ignore[method-assign]
    worker.run()

    # A gone worker's lease is looked at again in 10 ms: the read waits that long at most, not
    # its block of 1000 ms.
    assert len(asked) == 1 and asked[0][0] is True
    assert asked[0][1] is not None and asked[0][1] <= 11
