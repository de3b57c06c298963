"""Which consumers an owner deletes: idle ones with nothing pending, never itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from pspf import keys
from pspf.broker import Broker
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.ownership.owning import Partitions
from pspf.partition.owned import OwnedPartition, StreamCursor
from pspf.state_stores.memory import MemoryStore


class Consumers:
    """Stands in for the broker's consumer listing and deletion (``Apps``)."""

    def __init__(self, found: dict[str, list[tuple[str, int, int]]]) -> None:
        self.found = found
        self.deleted: list[tuple[str, str]] = []

    def group_consumers(self, stream: str, group: str) -> list[tuple[str, int, int]]:
        return self.found.get(stream, [])

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        self.deleted.append((stream, consumer))
        return 0


def owned_with(topics: list[str], listed: set[str]) -> OwnedPartition:
    store = MemoryStore()
    with store.transaction() as tx:
        for name in listed:
            tx.set(keys.CONSUMERS_NAMESPACE, name, b"")
    cursors = {
        keys.stream_key(t, 0): StreamCursor(t, 0, keys.stream_key(t, 0), "dlq", "lease", "v", None)
        for t in topics
    }
    owned = OwnedPartition(0, store, cursors, PartitionOutbox(store, "app", 0, "me"))
    owned.load_bookkeeping()
    return owned


def test_idle_consumers_with_nothing_pending_go_and_leave_the_store_list() -> None:
    a, b = keys.stream_key("a", 0), keys.stream_key("b", 0)
    broker = Consumers(
        {
            a: [("me", 0, 10**9), ("old", 0, 5000), ("busy", 3, 10**9), ("young", 0, 10)],
            b: [("old", 0, 5000), ("busy", 0, 10**9)],
        }
    )
    owned = owned_with(["a", "b"], {"me", "old", "busy", "young", "gone-before"})
    partitions = Partitions(
        cast(Broker, SimpleNamespace(apps=broker)), "app", "me", lambda g, p: owned.store, ["a", "b"]
    )
    deleted = partitions.forget_consumers(owned, after_ms=1000)
    assert deleted == ["busy", "old"]
    assert sorted(broker.deleted) == sorted([(a, "old"), (b, "old"), (b, "busy")])
    # busy keeps its pending entries in a (never deleted there), so takeover still knows it
    assert owned.consumers == {"me", "busy", "young"}
    assert {name for name, _ in owned.store.items(keys.CONSUMERS_NAMESPACE)} == owned.consumers
