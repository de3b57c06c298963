"""A standby hands a partition's store over when asked, not after the idle wait of its thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from pspf.broker import Broker
from pspf.ownership import standby
from pspf.ownership.standby import Standby
from pspf.settings import Settings
from pspf.state_stores import MemoryStore, StateStore
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_release_wakes_the_standby_thread_to_close_the_store(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(standby, "POLL_S", 120.0)  # an idle wait far longer than this test may run
    topic = make_topic(1)
    stores: list[StateStore] = []

    def open_store(group: str, partition: int) -> StateStore:
        stores.append(MemoryStore())
        return stores[-1]

    follower = Standby(Broker(make_settings().redis), "app-x", [topic], open_store)
    try:
        follower.keep({0})
        wait_until(lambda: stores, 10, "the standby to open the partition's store")
        released = threading.Thread(target=follower.release, args=(0,), daemon=True)
        released.start()
        released.join(30)  # the thread is in its idle wait (no backup to follow yet)

        assert not released.is_alive()
    finally:
        follower.close()
