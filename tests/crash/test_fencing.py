"""Fencing: a worker whose lease moved on cannot acknowledge, and gives the partition up."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.broker import AckRequest, Broker
from pspf.errors import LeaseLost
from pspf.keys import StreamId, fence_key, lease_key, stream_key
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.crash.support import assert_exact, backup_checkpoint, order_records, read_store, view_all
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

THIEF = "thief/1/00000000|999999"


def test_ack_with_a_stale_lease_value_is_refused(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, group = make_topic(1), names.app()
    produce(topic, order_records(5, 3, seed=1))
    stream, lease, fence = stream_key(topic, 0), lease_key(topic, 0, group), fence_key(topic, 0, group)
    broker = Broker(make_settings().redis)
    try:
        broker.apps.ensure_group(stream, group, "0")
        ids = [entry_id for _, entries in broker.reading.read_group(group, "c1", {stream: ">"}, 10, None)
               for entry_id, _ in entries]  # fmt: skip
        assert len(ids) == 5
        old = broker.leases.acquire_lease(lease, fence, "owner/1/aa", 60_000)
        assert old is not None
        assert broker.leases.acquire_lease(lease, fence, "other/2/bb", 60_000) is None, "two owners at once"

        # The lease expires; the same owner name takes it again: a new token fences the old value.
        rclient.delete(lease)
        new = broker.leases.acquire_lease(lease, fence, "owner/1/aa", 60_000)
        assert new is not None and new != old
        assert int(new.rpartition("|")[2]) > int(old.rpartition("|")[2])

        reply = broker.acks.ack([AckRequest(stream, group, lease, old, ids)])
        assert len(reply) == 1 and isinstance(reply[0], LeaseLost)
        assert rclient.xpending(stream, group)["pending"] == 5
        # The stale holder can neither renew nor release the new holder's lease.
        assert broker.leases.renew_leases([(lease, old)], 60_000) == [False]
        broker.leases.release_leases([(lease, old)])
        assert rclient.get(lease) == new.encode()
        # An expired lease (no key at all) refuses too.
        rclient.delete(lease)
        reply = broker.acks.ack([AckRequest(stream, group, lease, new, ids)])
        assert isinstance(reply[0], LeaseLost)
        assert rclient.xpending(stream, group)["pending"] == 5

        current = broker.leases.acquire_lease(lease, fence, "owner/1/aa", 60_000)
        assert current is not None
        assert broker.acks.ack([AckRequest(stream, group, lease, current, ids)]) == [(5, 0)]
        assert rclient.xpending(stream, group)["pending"] == 0
    finally:
        broker.close()


def test_worker_whose_lease_is_stolen_cannot_ack_and_drops_the_partition(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic, name = make_topic(1), names.app()
    records = order_records(100, 7, seed=2)
    produce(topic, records)
    ids = [StreamId.parse(i) for i, _ in rclient.xrange(stream_key(topic, 0))]
    lease = lease_key(topic, 0, name)
    settings = make_settings(PSPF_BATCH_SIZE=10, PSPF_CONSUMER="w1", PSPF_LEASE_TTL_MS=3000)
    state_dir = Path(settings.state.dir)
    stolen = threading.Event()

    def build(steal_at: int | None) -> App:
        app = App(name)
        seen = 0

        @app.handler(topic)
        def add(order: dict[str, int], ctx: Context) -> None:
            nonlocal seen
            ctx.state["count"] = ctx.state.get("count", 0) + 1
            ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
            seen += 1
            if seen == steal_at:
                # The lease expired and another worker took it, in the middle of the batch.
                rclient.set(lease, THIEF, px=60_000)
                stolen.set()

        return app

    caplog.set_level(logging.INFO, logger="pspf")
    # The 25th entry is in the third batch (entries 21-30): it is committed, but its ack is refused.
    worker = Worker(build(steal_at=25), settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert stolen.wait(10)
        wait_until(lambda: not worker.processor.owned, 5, "the worker to drop the partition")
        # Give it a few lease rounds (every TTL/3): it must not take the partition back.
        threading.Event().wait(2.5)
        assert not worker.processor.owned
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert "lease lost" in caplog.text

    assert rclient.get(lease) == THIEF.encode(), "the fenced worker touched the new owner's lease"
    [view] = view_all(rclient, state_dir, topic, name, 1)
    assert view.checkpoint == ids[29], "the batch was committed before its ack was refused"
    # The refused batch stays pending, and so does the next one, read ahead while the lease was
    # still held: the next owner claims both when it takes the partition.
    assert sorted(view.pending) == ids[20:40]
    assert set(view.pending.values()) == {"w1"}
    assert view.applied == 30
    # The dropped partition's store was closed: another process can open it for writing.
    open_store("sqlite", state_dir, name, 0).close()

    # The fenced worker's ack was refused, and so was its backup update.
    assert backup_checkpoint(rclient, topic, name, 0) == ids[19]

    # The thief goes away (its lease expires); the next owner rolls the store back to the backup
    # and applies the refused batch again.
    rclient.delete(lease)
    summary = Worker(build(steal_at=None), make_settings(PSPF_CONSUMER="w2")).run(until_idle=True)
    assert (summary.handled, summary.skipped) == (80, 0)
    assert_exact(rclient, state_dir, topic, name, 1, records)
    assert read_store(state_dir, name, 0)[0][topic] == ids[-1]
