"""Superseded marks on the memory store: screened out, and kept until the checkpoint passes them.

A replay marks the entries a redriven copy replaces. The mark must outlive the batch that
acknowledges the entry while the checkpoint is still below it: if that acknowledgement is lost,
the entry is read again from the pending list, above the checkpoint, and must be skipped again.
"""

from __future__ import annotations

from pspf import keys
from pspf.broker import Broker
from pspf.codec import StateDecoder
from pspf.cycle.delivery import Delivery
from pspf.keys import StreamId
from pspf.outbox.emit import Emitter
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.owned import OwnedPartition, Read, StreamCursor
from pspf.settings import Settings
from pspf.state_stores import MemoryStore

TOPIC = "orders"
VALUE = {b"value": b"{}"}


def owned_partition(store: MemoryStore) -> tuple[OwnedPartition, StreamCursor]:
    stream = keys.stream_key(TOPIC, 0)
    cursor = StreamCursor(
        topic=TOPIC,
        partition=0,
        stream=stream,
        dlq=keys.dlq_key(TOPIC, 0),
        lease_key=keys.lease_key(TOPIC, 0, "app"),
        lease_value="owner|1",
        checkpoint=store.checkpoints().get(TOPIC),
    )
    owned = OwnedPartition(0, store, {stream: cursor}, PartitionOutbox(store, "app", 0, "c"))
    owned.load_bookkeeping()
    return owned, cursor


def delivery(owned: OwnedPartition, cursor: StreamCursor) -> Delivery:
    """Screening reads no stream: the broker is never reached."""
    broker = Broker(Settings.load({}, environ={}).redis)
    return Delivery(
        broker.reading, broker.topics, "app", "c", 100, 100, {}, {0: owned}, {cursor.stream: cursor}
    )


def marks(store: MemoryStore) -> list[str]:
    return [name for name, _ in store.items(keys.SUPERSEDED_NAMESPACE)]


def commit(owned: OwnedPartition, cursor: StreamCursor, checkpoint: str | None, acked: list[bytes]) -> None:
    moved = None if checkpoint is None else StreamId.parse(checkpoint)
    emitter = Emitter(
        Broker(Settings.load({}, environ={}).redis).topics, "app"
    )  # never reached: nothing emitted
    PartitionBatch(owned, StateDecoder(), emitter).commit(
        [StreamOutcome(cursor, moved, acked, [], None, 0, 0)]
    )


def test_marked_entries_are_skipped_until_the_checkpoint_passes_them() -> None:
    store = MemoryStore()
    store.rewind(
        set(),
        {TOPIC: StreamId(1, 0)},
        {
            (keys.SUPERSEDED_NAMESPACE, f"{TOPIC}/5-0"): b"20-0",
            (keys.SUPERSEDED_NAMESPACE, f"{TOPIC}/9-0"): b"21-0",
            (keys.SUPERSEDED_NAMESPACE, "other/6-0"): b"22-0",  # another topic's: not this cursor's
        },
    )
    owned, cursor = owned_partition(store)
    screen = delivery(owned, cursor).screen
    assert b"5-0" in cursor.superseded and b"6-0" not in cursor.superseded

    screened = screen(owned, Read(cursor, [(b"4-0", VALUE), (b"5-0", VALUE), (b"6-0", VALUE)], {}))
    assert [entry_id for entry_id, _ in screened.todo] == [b"4-0", b"6-0"]
    assert screened.done_ids == [b"5-0"] and screened.skipped == 1

    # A batch that handled 4-0 and acknowledged 5-0: the checkpoint stops below 5-0, so its mark
    # stays; read again (its acknowledgement lost), 5-0 is still skipped.
    commit(owned, cursor, "4-0", [b"4-0", b"5-0"])
    assert marks(store) == [f"{TOPIC}/5-0", f"{TOPIC}/9-0", "other/6-0"]
    again = screen(owned, Read(cursor, [(b"5-0", VALUE)], {}))
    assert again.todo == [] and again.done_ids == [b"5-0"]

    # The checkpoint passes 5-0: its mark goes in that commit, 9-0's stays.
    commit(owned, cursor, "6-0", [b"6-0"])
    assert marks(store) == [f"{TOPIC}/9-0", "other/6-0"]
    assert b"5-0" not in cursor.superseded and b"9-0" in cursor.superseded
    assert store.checkpoints()[TOPIC] == StreamId(6, 0)

    commit(owned, cursor, "9-0", [b"7-0", b"8-0", b"9-0"])
    assert marks(store) == ["other/6-0"] and not cursor.superseded
    # What a new owner loads agrees with what the worker kept.
    assert not owned_partition(store)[1].superseded
