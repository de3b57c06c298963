"""A worker that lost its lease cannot take entries out of the group's delivery order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pspf import App, Context, Settings, Worker
from pspf.broker import Broker
from pspf.keys import fence_key, lease_key, stream_key
from pspf.service import Service

pytestmark = pytest.mark.integration


def test_zombie_owner_reads_nothing_after_its_lease_moved(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Any,
    rclient: Any,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    produce(topic, [("k", {"n": 1})] * 50)
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    zombie = Worker(app, make_settings(PSPF_CONSUMER="zombie", PSPF_STATE_DIR=str(tmp_path / "a")))
    zombie._start()
    zombie._lease_round()
    assert 0 in zombie.processor.owned

    # The zombie stalls past its lease TTL; its lease and membership expire and another worker
    # takes over.
    rclient.delete(lease_key(topic, 0, app.name))
    zombie.membership.leave()
    settings_b = make_settings(PSPF_CONSUMER="owner", PSPF_STATE_DIR=str(tmp_path / "b"))
    owner = Worker(app, settings_b)
    owner._start()
    owner._lease_round()
    assert 0 in owner.processor.owned

    result = zombie.processor.run_once(block=False)

    assert result.read == 0
    assert result.lost_partitions == [0]
    # Nothing was delivered to the zombie: no entry can hide in its pending list.
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
    zombie._shutdown()
    owner._shutdown()

    summary = Worker(app, settings_b).run(until_idle=True)
    assert summary.handled == 50
    assert Service(settings_b).state_get(app.name, "k") == {"count": 50}


def test_a_zombie_cannot_claim_its_pending_entries_back_by_id_after_its_lease_moved(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Any,
    rclient: Any,
) -> None:
    topic, group = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})] * 10)
    stream, lease, fence = stream_key(topic, 0), lease_key(topic, 0, group), fence_key(topic, 0, group)
    broker = Broker(make_settings().redis)
    try:
        broker.ensure_group(stream, group, "0")
        zombie = broker.acquire_lease(lease, fence, "zombie", 10_000)
        assert zombie is not None
        ids = [
            entry_id
            for _, entries in rclient.xreadgroup(group, "zombie", {stream: ">"})
            for entry_id, _ in entries
        ]
        assert len(ids) == 10
        # The zombie stalls; its lease expires, the new owner takes the partition and its entries.
        rclient.delete(lease)
        owner = broker.acquire_lease(lease, fence, "owner", 10_000)
        assert owner is not None
        rclient.xclaim(stream, group, "owner", 0, ids)

        # The zombie wakes up and re-reads what it still believes its own pending entries.
        assert broker.claim_entries(stream, group, "zombie", ids, (lease, zombie)) is None
        held = rclient.xpending_range(stream, group, "-", "+", 100)
        assert {row["consumer"] for row in held} == {b"owner"}
        assert {row["times_delivered"] for row in held} == {2}  # the zombie's try counted nothing

        claimed = broker.claim_entries(stream, group, "owner", ids, (lease, owner))
        assert claimed is not None and [entry_id for entry_id, _ in claimed] == ids
    finally:
        broker.close()
