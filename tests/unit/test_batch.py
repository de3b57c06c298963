"""The batch's durability on the memory store: commit, then the fenced acknowledgement, then confirm.

``Durability`` is the one place that orders them; these tests pin that order and what a refused
acknowledgement leaves: no outbox row of a partition whose lease was lost may be published, its
DLQ records stay in the store, and the other partitions of the cycle go on.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pspf import keys
from pspf.broker import AckRequest, Fields
from pspf.codec import StateDecoder
from pspf.errors import LeaseLost
from pspf.failures import DeadLetter, record_failure
from pspf.hooks import ProcessorHooks
from pspf.keys import StreamId
from pspf.outbox.emit import Emitted, Emitter
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.durability import Durability, flush
from pspf.partition.owned import OwnedPartition, StreamCursor
from pspf.state_stores import MemoryStore

TOPIC = "orders"


class Topics:
    """Partition counts for the emitter: every topic has one partition."""

    def topic_layout(self, topic: str) -> tuple[int, str, bool]:
        return 1, "0", False


class Acks:
    """The broker's acknowledging call: records each round trip, refuses the streams it is told to."""

    def __init__(self, refuse: Sequence[str] = (), fail: bool = False) -> None:
        self.refuse = set(refuse)
        self.fail = fail
        self.calls: list[list[AckRequest]] = []

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        self.calls.append(list(requests))
        if self.fail:
            raise ConnectionError("the call may or may not have run")
        return [
            LeaseLost(f"LEASE_LOST {r.stream}") if r.stream in self.refuse else (len(r.ids), len(r.dead))
            for r in requests
        ]


class Order(ProcessorHooks):
    """What the hooks saw, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_commit(self, partition: int, seconds: float) -> None:
        self.seen.append(f"commit {partition}")

    def on_acknowledging(self, entries: dict[str, int]) -> None:
        self.seen.append("acknowledging")

    def on_ack(self, seconds: float) -> None:
        self.seen.append("acknowledged")


def owned_partition(partition: int) -> tuple[OwnedPartition, StreamCursor]:
    store = MemoryStore()
    stream = keys.stream_key(TOPIC, partition)
    cursor = StreamCursor(
        TOPIC,
        partition,
        stream,
        keys.dlq_key(TOPIC, partition),
        keys.lease_key(TOPIC, partition, "app"),
        "owner|1",
        None,
    )
    owned = OwnedPartition(partition, store, {TOPIC: cursor}, PartitionOutbox(store, "app", partition, "c"))
    owned.load_bookkeeping()
    return owned, cursor


def batch_of(owned: OwnedPartition, emits: int = 0) -> PartitionBatch:
    batch = PartitionBatch(owned, StateDecoder(), Emitter(Topics(), "app"))
    batch.overlay["k"] = b"\x81\xa1n\x01"
    batch.emitted += [emitted(i) for i in range(emits)]
    return batch


def emitted(i: int) -> Emitted:
    return ("totals", 0, b"k", str(i).encode(), TOPIC, f"1-{i}".encode(), None)


def done(cursor: StreamCursor, *ids: str, dead: list[tuple[bytes, Fields]] | None = None) -> StreamOutcome:
    acked = [i.encode() for i in ids]
    last = StreamId.parse(ids[-1]) if ids else None
    return StreamOutcome(cursor, last, acked, dead or [], None, len(ids), 0)


def test_commit_comes_before_the_acknowledgement_and_confirm_after_it() -> None:
    owned, cursor = owned_partition(0)
    hooks = Order()
    durability = Durability(Acks(), "app", hooks)
    batch = batch_of(owned, emits=2)
    outcomes = [done(cursor, "1-1", "1-2")]
    durability.commit(batch, outcomes)
    assert owned.store.checkpoints() == {TOPIC: StreamId(1, 2)}
    assert owned.outbox.confirmed < owned.outbox.unconfirmed, "committed rows wait for the acknowledgement"
    acked = durability.acknowledge([(batch, outcomes)])
    assert acked.lost == {}
    assert hooks.seen == ["commit 0", "acknowledging", "acknowledged"]
    assert owned.outbox.confirmed == owned.outbox.unconfirmed == 2


def test_a_refused_partition_keeps_its_rows_unconfirmed_and_the_others_go_on() -> None:
    (owned0, cursor0), (owned1, cursor1) = owned_partition(0), owned_partition(1)
    acks = Acks(refuse=[cursor0.stream])
    durability = Durability(acks, "app", ProcessorHooks())
    done0 = (batch_of(owned0, emits=1), [done(cursor0, "1-1")])
    done1 = (batch_of(owned1, emits=1), [done(cursor1, "1-1")])
    for batch, outcomes in (done0, done1):
        durability.commit(batch, outcomes)
    acked = durability.acknowledge([done0, done1])
    assert set(acked.lost) == {0}
    stream, why = acked.lost[0]
    assert stream == cursor0.stream and isinstance(why, LeaseLost)
    assert owned0.outbox.confirmed == 0, "no row of a partition whose lease was lost may be published"
    assert owned1.outbox.confirmed == 1
    assert len(acks.calls) == 1, "one round trip for both partitions"


def test_dead_letters_are_forgotten_only_after_the_dlq_move_succeeded() -> None:
    owned, cursor = owned_partition(0)
    failure = record_failure(ValueError("bad"), None)
    dlq_fields: Fields = DeadLetter.of(TOPIC, 0, b"1-2", "app", "c", {b"value": b"{}"}, failure).to_fields()
    name = keys.entry_name(TOPIC, b"1-2")

    def commit_dead(durability: Durability) -> tuple[PartitionBatch, list[StreamOutcome]]:
        batch = batch_of(owned)
        batch.dead[name] = dlq_fields
        outcomes = [done(cursor, "1-1", dead=[(b"1-2", dlq_fields)])]
        durability.commit(batch, outcomes)
        return batch, outcomes

    refused = Durability(Acks(refuse=[cursor.stream]), "app", ProcessorHooks())
    assert refused.acknowledge([commit_dead(refused)]).dead_lettered == 0
    assert owned.store.get(keys.DEAD_NAMESPACE, name) is not None, "the decision outlives a refused move"
    assert name in owned.dead

    moved = Durability(Acks(), "app", ProcessorHooks())
    assert moved.acknowledge([commit_dead(moved)]).dead_lettered == 1
    assert owned.store.get(keys.DEAD_NAMESPACE, name) is None
    assert name not in owned.dead


def test_a_call_that_failed_confirms_nothing_and_raises() -> None:
    owned, cursor = owned_partition(0)
    durability = Durability(Acks(fail=True), "app", ProcessorHooks())
    batch = batch_of(owned, emits=1)
    outcomes = [done(cursor, "1-1")]
    durability.commit(batch, outcomes)
    with pytest.raises(ConnectionError):
        durability.acknowledge([(batch, outcomes)])
    assert owned.outbox.confirmed == 0


def test_nothing_written_means_nothing_to_acknowledge() -> None:
    owned, _ = owned_partition(0)
    acks = Acks()
    durability = Durability(acks, "app", ProcessorHooks())
    empty = PartitionBatch(owned, StateDecoder(), Emitter(Topics(), "app"))
    assert durability.commit(empty, []) is None
    assert durability.acknowledge([(empty, [])]).lost == {}
    assert acks.calls == []
    assert durability.commit_alone(empty) is None


def test_time_work_is_committed_alone_then_confirmed_by_the_flush() -> None:
    owned, _ = owned_partition(0)
    durability = Durability(Acks(), "app", ProcessorHooks())
    batch = batch_of(owned, emits=3)
    assert durability.commit_alone(batch) is None
    assert owned.store.get(keys.STATE_NAMESPACE, "k") == b"\x81\xa1n\x01"
    assert owned.outbox.confirmed == owned.outbox.unconfirmed == 3
    assert flush(owned) is None
