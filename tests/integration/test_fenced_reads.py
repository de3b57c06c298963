"""A worker that lost its lease cannot take entries out of the group's delivery order."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.broker import Broker
from pspf.keys import dlq_key, fence_key, lease_key, partition_for, stream_key
from pspf.service import Service
from tests.conftest import Names
from tests.support.fixtures import MakeAppOnTopic

pytestmark = pytest.mark.integration


def test_zombie_owner_reads_nothing_after_its_lease_moved(
    app_on_topic: MakeAppOnTopic,
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    case = app_on_topic(1, [("k", {"n": 1})] * 50)
    topic, app = case.topic, case.app

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    zombie = Worker(app, make_settings(PSPF_CONSUMER="zombie", PSPF_STATE_DIR=str(tmp_path / "a")))
    zombie.start()
    zombie.lease_round.step()
    assert 0 in zombie.processor.owned

    # The zombie stalls past its lease TTL; its lease and membership expire and another worker
    # takes over.
    rclient.delete(lease_key(topic, 0, app.name))
    zombie.membership.leave()
    settings_b = make_settings(PSPF_CONSUMER="owner", PSPF_STATE_DIR=str(tmp_path / "b"))
    owner = Worker(app, settings_b)
    owner.start()
    owner.lease_round.step()
    assert 0 in owner.processor.owned

    result = zombie.processor.run_once(block=False)

    assert result.read == 0
    assert result.lost_partitions == [0]
    # Nothing was delivered to the zombie: no entry can hide in its pending list.
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
    zombie.shutdown()
    owner.shutdown()

    summary = Worker(app, settings_b).run(until_idle=True)
    assert summary.handled == 50
    assert Service(settings_b).state_get(app.name, "k") == {"count": 50}


def test_a_zombie_cannot_claim_its_pending_entries_back_by_id_after_its_lease_moved(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, group = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})] * 10)
    stream, lease, fence = stream_key(topic, 0), lease_key(topic, 0, group), fence_key(topic, 0, group)
    broker = Broker(make_settings().redis)
    try:
        broker.apps.ensure_group(stream, group, "0")
        zombie = broker.leases.acquire_lease(lease, fence, "zombie", 10_000)
        assert zombie is not None
        ids = [
            entry_id
            for _, entries in rclient.xreadgroup(group, "zombie", {stream: ">"})
            for entry_id, _ in entries
        ]
        assert len(ids) == 10
        # The zombie stalls; its lease expires, the new owner takes the partition and its entries.
        rclient.delete(lease)
        owner = broker.leases.acquire_lease(lease, fence, "owner", 10_000)
        assert owner is not None
        rclient.xclaim(stream, group, "owner", 0, ids)

        # The zombie wakes up and re-reads what it still believes its own pending entries.
        assert broker.reading.claim_entries(stream, group, "zombie", ids, (lease, zombie)) is None
        held = rclient.xpending_range(stream, group, "-", "+", 100)
        assert {row["consumer"] for row in held} == {b"owner"}
        assert {row["times_delivered"] for row in held} == {2}  # the zombie's try counted nothing

        claimed = broker.reading.claim_entries(stream, group, "owner", ids, (lease, owner))
        assert claimed is not None and [entry_id for entry_id, _ in claimed] == ids
    finally:
        broker.close()


def seen_app(name: str, topic: str, before: Callable[[int], None] = lambda n: None) -> App:
    """An app that keeps the ``n`` of each entry of a key in order; ``before(n)`` runs first."""
    app = App(name)

    @app.handler(topic)
    def keep(value: dict[str, int], ctx: Context) -> None:
        before(value["n"])
        ctx.state["seen"] = [*ctx.state.get("seen", []), value["n"]]

    return app


def test_the_next_batch_is_read_ahead_while_the_handlers_run(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    produce(topic, [("k", {"n": n}) for n in range(1, 31)])
    stream = stream_key(topic, 0)
    name = names.app()
    pending_seen: list[int] = []

    def look(n: int) -> None:
        if n % 10 == 1:  # the first entry of each batch: what is delivered by now
            # (the read ahead goes on another connection: give the server a moment to run it)
            deadline = time.monotonic() + 0.5
            while (pending := rclient.xpending(stream, name)["pending"]) <= 10:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            pending_seen.append(pending)

    app = seen_app(name, topic, look)

    settings = make_settings(PSPF_BATCH_SIZE=10)
    worker = Worker(app, settings)
    worker.start()
    worker.lease_round.step()
    try:
        if worker.broker.conn.cluster:
            pytest.skip("a cluster's reads are not sent ahead")
        assert [worker.processor.run_once(block=False).read for _ in range(3)] == [10, 10, 10]
    finally:
        worker.shutdown()
    # Each batch ran while the next one was already delivered; the last read ahead found the
    # last ten entries, and the one after them found nothing.
    assert pending_seen == [20, 20, 10]
    assert Service(settings).state_get(app.name, "k") == {"seen": list(range(1, 31))}


def test_a_read_ahead_the_next_cycle_cannot_use_is_read_again_in_order(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    """Entry 5 fails once: its stream re-reads its pending list, and the batch read ahead
    (entries 11 to 20) comes after it from there, in order, each applied once and none taken for
    poison by the deliveries it did not run."""
    failed: list[int] = []

    def fail_once(n: int) -> None:
        if n == 5 and not failed:
            failed.append(5)
            raise RuntimeError("once")

    case = app_on_topic(
        1, [("k", {"n": n}) for n in range(1, 31)], build=lambda name, topic: seen_app(name, topic, fail_once)
    )
    topic, app = case.topic, case.app

    settings = make_settings(PSPF_BATCH_SIZE=10, PSPF_MAX_DELIVERIES=2)
    summary = Worker(app, settings).run(until_idle=True)
    assert failed == [5]
    assert (summary.handled, summary.failed) == (30, 1)
    assert Service(settings).state_get(app.name, "k") == {"seen": list(range(1, 31))}
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
    assert not rclient.exists(dlq_key(topic, 0))


def test_a_read_ahead_under_a_lease_that_moved_delivers_nothing(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, group = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})] * 10)
    stream, lease, fence = stream_key(topic, 0), lease_key(topic, 0, group), fence_key(topic, 0, group)
    broker = Broker(make_settings().redis)
    try:
        if broker.conn.cluster:
            pytest.skip("a cluster's reads are not sent ahead")
        broker.apps.ensure_group(stream, group, "0")
        zombie = broker.leases.acquire_lease(lease, fence, "zombie", 10_000)
        assert zombie is not None
        rclient.delete(lease)
        assert broker.leases.acquire_lease(lease, fence, "owner", 10_000) is not None

        ahead = broker.reading.read_ahead(group, "zombie", [(stream, lease, zombie)], 10)
        assert ahead.take() == ([stream], [], {})
        assert rclient.xpending(stream, group)["pending"] == 0
        # A dropped one says what it delivered: here nothing.
        assert broker.reading.read_ahead(group, "zombie", [(stream, lease, zombie)], 10).drop() == {}
    finally:
        broker.close()


def test_a_stream_whose_read_ahead_is_dropped_reads_it_back_before_anything_newer(
    app_on_topic: MakeAppOnTopic, make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    """Both partitions' next batches are read ahead; partition 1 is given up before the next
    cycle, so the read ahead is dropped: partition 0 must take entries 11 to 20 back from its
    pending list before it reads 21 to 30 (read first, they would make 11 to 20 look done)."""
    key_of = {partition_for(f"k{i}".encode(), 2): f"k{i}" for i in range(20)}
    records = [(key_of[p], {"n": n}) for n in range(1, 31) for p in (0, 1)]
    app = app_on_topic(2, records, build=seen_app).app

    settings = make_settings(PSPF_BATCH_SIZE=10)
    worker = Worker(app, settings)
    worker.start()
    worker.lease_round.step()
    try:
        if worker.broker.conn.cluster:
            pytest.skip("a cluster's reads are not sent ahead")
        assert sorted(worker.processor.owned) == [0, 1]
        assert worker.processor.run_once(block=False).read == 20
        worker.lease_round.drop(1, release=True)
        reads = [worker.processor.run_once(block=False).read for _ in range(5)]
    finally:
        worker.shutdown()
    # The cycle that dropped it read nothing new; then the pending list, then what came after.
    assert reads == [0, 10, 10, 0, 0]
    assert Service(settings).state_get(app.name, key_of[0])["seen"] == list(range(1, 31))
    summary = Worker(app, settings).run(until_idle=True)  # partition 1, from its pending list
    assert summary.skipped == 0
    assert Service(settings).state_get(app.name, key_of[1])["seen"] == list(range(1, 31))
