"""A blocking read waits no longer than the worker asks (its next lease round), and never for ever."""

from __future__ import annotations

import pytest

from pspf.cycle import delivery
from tests.unit.test_delivery import Scene


def waits_of(scene: Scene) -> list[int]:
    """Record the ``block_ms`` of every wait for new entries instead of waiting."""
    waits: list[int] = []
    scene.broker.wait_for_new = lambda last_ids, block_ms: waits.append(block_ms)  # type: ignore[method-assign]
    return waits


def caught_up() -> Scene:
    """One stream whose only entry was delivered before: a read finds nothing new."""
    scene = Scene()  # its Delivery blocks 100 ms at most
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0")
    scene.broker.delivered(scene.stream, "1-0", 1)
    return scene


def test_a_blocking_read_waits_the_shorter_of_its_own_block_and_the_one_asked() -> None:
    scene = caught_up()
    waits = waits_of(scene)

    assert scene.delivery.read(block=True, block_ms=40) == ([], [])
    assert scene.delivery.read(block=True, block_ms=500) == ([], [])
    assert scene.delivery.read(block=True) == ([], [])

    assert waits == [40, 100, 100]


def test_a_read_with_no_time_left_only_looks() -> None:
    """BLOCK 0 would wait until an entry comes: with nothing left of the wait there is none."""
    scene = caught_up()
    waits = waits_of(scene)

    assert scene.delivery.read(block=True, block_ms=0) == ([], [])

    assert waits == []


def test_a_worker_owning_nothing_sleeps_no_longer_than_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    scene = Scene()
    scene.cursors.clear()  # it owns no partition: nothing to read, the read only sleeps
    slept: list[float] = []
    monkeypatch.setattr(delivery.time, "sleep", slept.append)

    scene.delivery.read(block=True, block_ms=30)
    scene.delivery.read(block=True)

    assert slept == [0.03, 0.1]
