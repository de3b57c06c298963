"""Id order across a partition's topics (``pspf.cycle.ordering``): what is applied now, what waits."""

from __future__ import annotations

from typing import Any, cast

from pspf import keys
from pspf.broker import RawEntry, Reading
from pspf.cycle.ordering import CrossTopicOrder
from pspf.keys import StreamId
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.partition.owned import OwnedPartition, Read, StreamCursor
from pspf.state_stores.memory import MemoryStore

ORDERS, CUSTOMERS = "orders", "customers"


class Heads:
    """Stands in for ``Reading.read_after``: the first entry of each stream after a position."""

    def __init__(self, streams: dict[str, list[str]]) -> None:
        self.streams = streams

    def read_after(
        self, positions: dict[str, StreamId | None], count: int
    ) -> list[tuple[str, list[RawEntry]]]:
        found = []
        for stream, after in positions.items():
            ids = [i for i in self.streams.get(stream, []) if after is None or StreamId.parse(i) > after]
            if ids:
                found.append((stream, [(i.encode(), {}) for i in ids[:count]]))
        return found


def partition(checkpoints: dict[str, str | None], heads: dict[str, list[str]] | None = None) -> Any:
    store = MemoryStore()
    cursors = {
        topic: StreamCursor(
            topic,
            0,
            keys.stream_key(topic, 0),
            keys.dlq_key(topic, 0),
            keys.lease_key(topic, 0, "app"),
            "lease",
            None if checkpoint is None else StreamId.parse(checkpoint),
        )
        for topic, checkpoint in checkpoints.items()
    }
    owned = OwnedPartition(
        0, store, {c.stream: c for c in cursors.values()}, PartitionOutbox(store, "app", 0, "c")
    )
    broker = Heads({keys.stream_key(t, 0): ids for t, ids in (heads or {}).items()})
    order = CrossTopicOrder(cast(Reading, broker), frozenset({CUSTOMERS}), {0: owned}, batch_size=3)
    return order, cursors


def read(cursor: StreamCursor, *ids: str) -> Read:
    return Read(cursor, [(i.encode(), {}) for i in ids], {})


def ids(reads: list[Read]) -> dict[str, list[str]]:
    return {r.cursor.topic: [e.decode() for e, _ in r.entries] for r in reads}


def test_a_full_read_holds_back_what_another_stream_gave_after_its_last_entry() -> None:
    order, c = partition({ORDERS: None, CUSTOMERS: None})
    order.complete = {c[ORDERS].stream}  # orders gave all there was; customers a full batch
    kept = order.hold_back(
        [read(c[ORDERS], "1-0", "5-0"), read(c[CUSTOMERS], "2-0", "3-0", "4-0")], {CUSTOMERS}
    )
    assert ids(kept) == {CUSTOMERS: ["2-0", "3-0", "4-0"], ORDERS: ["1-0"]}
    assert list(ids(kept)) == [CUSTOMERS, ORDERS], "a partition's tables run first"
    # What was held comes first in the stream's next read, with what that read gave.
    again = order.with_held([read(c[ORDERS], "6-0")], list(c.values()))
    assert ids(again) == {ORDERS: ["5-0", "6-0"]}
    assert c[ORDERS].held is None


def test_equal_ids_of_two_streams_apply_the_tables_entry_first() -> None:
    order, c = partition({ORDERS: None, CUSTOMERS: None})
    order.complete = set()  # both full: each bounds the other at its last id
    kept = order.hold_back([read(c[ORDERS], "1-0", "2-0"), read(c[CUSTOMERS], "2-0", "3-0")], {CUSTOMERS})
    assert ids(kept) == {CUSTOMERS: ["2-0"], ORDERS: ["1-0", "2-0"]}


def test_a_suspect_waits_for_an_earlier_entry_of_another_topic_and_lets_equal_table_ids_pass() -> None:
    order, c = partition({ORDERS: "1-0", CUSTOMERS: "1-0"}, heads={CUSTOMERS: ["5-0", "7-0"]})
    suspects = [(c[ORDERS], b"5-0")]
    assert order.first_suspect(suspects) is None, "the table's update 5-0 comes first"
    order.wait(c[ORDERS], b"5-0")
    order.complete = set()
    kept = order.hold_back([read(c[CUSTOMERS], "5-0", "7-0")], {CUSTOMERS})
    assert ids(kept) == {CUSTOMERS: ["5-0"]}, "up to the suspect, the table's equal id included"
    # Once the table is past it, the suspect runs (alone), and nothing cuts it.
    c[CUSTOMERS].checkpoint = StreamId.parse("5-0")
    assert order.first_suspect(suspects) == 0
    alone = read(c[ORDERS], "5-0")._replace(alone=True)
    assert order.hold_back([alone], {CUSTOMERS}) == [alone]


def test_a_suspect_at_or_below_its_checkpoint_waits_for_nothing() -> None:
    order, c = partition({ORDERS: "9-0", CUSTOMERS: "1-0"}, heads={CUSTOMERS: ["2-0"]})
    assert order.first_suspect([(c[ORDERS], b"8-0")]) == 0


def test_a_stream_not_read_bounds_at_its_checkpoint_and_a_due_read_is_never_cut() -> None:
    order, c = partition({ORDERS: "1-0", CUSTOMERS: "3-0"})
    order.complete = set()
    due = read(c[ORDERS], "9-0")._replace(due=True)
    kept = order.hold_back([due, read(c[ORDERS], "2-0", "4-0")], {CUSTOMERS})
    assert [len(r.entries) for r in kept] == [1, 1]
    assert c[ORDERS].held is not None and [e for e, _ in c[ORDERS].held.entries] == [b"4-0"]
