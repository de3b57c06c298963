"""A batch reads the state of keys not in memory in one store query, and only when it must.

A key read one by one costs a store query per entry (more than handling the entry); a batch
after one that did so reads its keys at once. When every key is in memory nothing is read.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pspf import keys
from pspf.codec import StateDecoder
from pspf.outbox.emit import Emitter
from pspf.partition.batch import PartitionBatch
from pspf.partition.owned import OwnedPartition
from pspf.state_stores import MemoryStore
from tests.unit.test_batch import Topics, owned_partition


class CountingStore(MemoryStore):
    """A memory store that counts its reads of single keys and of many."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0
        self.many: list[set[str]] = []

    def get(self, namespace: str, key: str) -> bytes | None:
        self.gets += 1
        return super().get(namespace, key)

    def get_many(self, namespace: str, keys: Iterable[str]) -> dict[str, bytes]:
        self.many.append(set(keys))
        return super().get_many(namespace, self.many[-1])


def with_store(values: dict[str, int]) -> tuple[OwnedPartition, CountingStore]:
    owned, _ = owned_partition(0)
    store = CountingStore()
    with store.transaction() as tx:
        for key, value in values.items():
            tx.set(keys.STATE_NAMESPACE, key, msgspec.msgpack.encode(value))
    owned.store = store
    return owned, store


def entries(*names: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [(f"1-{i}".encode(), {b"key": name.encode(), b"value": b"{}"}) for i, name in enumerate(names)]


def batch(owned: OwnedPartition) -> PartitionBatch:
    return PartitionBatch(owned, StateDecoder(), Emitter(Topics(), "app"))


def test_the_first_batch_reads_its_keys_at_once_and_sees_each_value() -> None:
    owned, store = with_store({"a": 1, "b": 2})
    first = batch(owned)
    first.prefetch(entries("a", "b", "c", "a"))
    assert store.many == [{"a", "b", "c"}]
    assert [first.base(k) for k in "abc"] == [msgspec.msgpack.encode(1), msgspec.msgpack.encode(2), None]
    assert store.gets == 0, "every key was read ahead"


def test_a_batch_whose_keys_are_all_in_memory_reads_nothing() -> None:
    owned, store = with_store({"a": 1})
    first = batch(owned)
    first.prefetch(entries("a", "b"))
    second = batch(owned)
    second.prefetch(entries("a", "b"))
    assert len(store.many) == 1, "the second batch found nothing missed: it read nothing ahead"
    assert second.base("a") == msgspec.msgpack.encode(1) and store.gets == 0


def test_a_batch_after_one_that_missed_reads_ahead_again() -> None:
    owned, store = with_store({"x": 5})
    first = batch(owned)
    first.prefetch(entries("a", "b"))
    assert first.base("x") == msgspec.msgpack.encode(5)  # a key not read ahead: one read, one miss
    assert store.gets == 1
    second = batch(owned)
    second.prefetch(entries("y", "z"))
    assert store.many[-1] == {"y", "z"}


def test_values_read_ahead_past_the_cache_share_are_kept_for_the_batch() -> None:
    owned, store = with_store({f"k{i}": i for i in range(10)})
    owned.cache_limit = 3
    first = batch(owned)
    first.prefetch(entries(*(f"k{i}" for i in range(10))))
    assert len(owned.cache) == 3
    assert [first.base(f"k{i}") for i in range(10)] == [msgspec.msgpack.encode(i) for i in range(10)]
    assert store.gets == 0


def test_a_key_written_in_the_batch_is_not_read_ahead() -> None:
    owned, store = with_store({"a": 1})
    first = batch(owned)
    first.overlay["a"] = msgspec.msgpack.encode(7)
    first.prefetch(entries("a", "b", "c"))
    assert store.many == [{"b", "c"}]
    assert first.base("a") == msgspec.msgpack.encode(7)


def test_batches_that_keep_finding_new_keys_keep_reading_ahead() -> None:
    """A key space larger than the batches: each batch finds keys not in memory, read at once."""
    owned, store = with_store({})
    for names in (("a", "b"), ("c", "d"), ("e", "f")):
        batch(owned).prefetch(entries(*names))
    assert store.many == [{"a", "b"}, {"c", "d"}, {"e", "f"}]
    assert store.gets == 0
