"""The outbox row lifecycle of seed 000: every allowed transition and its fields; every other refused."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest

from pspf import keys
from pspf.outbox.emit import SOURCE_APP_HEADER, SOURCE_ID_HEADER
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.outbox.rows import (
    TRANSITIONS,
    OutboxRow,
    RowState,
    TransitionRefused,
    move,
    rows_in_store,
    watermark_key,
)
from pspf.state_stores import MemoryStore

ALLOWED = {
    (RowState.PENDING, RowState.CLAIMED),
    (RowState.CLAIMED, RowState.PUBLISHED),
    (RowState.CLAIMED, RowState.PENDING),
    (RowState.CLAIMED, RowState.DEAD),
    (RowState.PUBLISHED, RowState.PENDING),
    (RowState.DEAD, RowState.PENDING),
}


def row(state: RowState = RowState.PENDING, **changes: object) -> OutboxRow:
    base = OutboxRow(7, 7, "out", 1, {b"value": b"{}"}, created_ms=100, available_ms=100)
    fields = {"state": state, **changes}
    if state is RowState.CLAIMED:
        fields.setdefault("claimed_ms", 150)
        fields.setdefault("claimed_by", "relay-a")
    return msgspec.structs.replace(base, **fields)


def test_the_transitions_are_exactly_the_seeds() -> None:
    assert TRANSITIONS == ALLOWED


@pytest.mark.parametrize(
    ("before", "after"),
    [pair for pair in itertools.product(RowState, RowState) if pair not in ALLOWED],
    ids=lambda s: str(s),
)
def test_every_other_transition_is_refused(before: RowState, after: RowState) -> None:
    with pytest.raises(TransitionRefused, match=f"{before} -> {after}"):
        move(row(before), after, 200, relay="relay-b", error="e", seq=9)


def test_a_claim_sets_when_and_by_whom() -> None:
    claimed = move(row(), RowState.CLAIMED, 200, relay="relay-b")
    assert (claimed.state, claimed.claimed_ms, claimed.claimed_by) == (RowState.CLAIMED, 200, "relay-b")
    assert claimed.attempts == 0


def test_a_claim_needs_a_relay_and_an_available_row() -> None:
    with pytest.raises(TransitionRefused, match="needs the relay"):
        move(row(), RowState.CLAIMED, 200)
    with pytest.raises(TransitionRefused, match="not available"):
        move(row(available_ms=300), RowState.CLAIMED, 200, relay="r")


def test_publishing_sets_the_time() -> None:
    published = move(row(RowState.CLAIMED), RowState.PUBLISHED, 250)
    assert (published.state, published.published_ms) == (RowState.PUBLISHED, 250)


@pytest.mark.parametrize("to", [RowState.PENDING, RowState.DEAD])
def test_a_failed_attempt_counts_keeps_the_error_and_clears_the_claim(to: RowState) -> None:
    failed = move(row(RowState.CLAIMED, attempts=2), to, 300, error="WRONGTYPE", retry_in_ms=50)
    assert failed.state is to
    assert (failed.attempts, failed.last_error) == (3, "WRONGTYPE")
    assert (failed.claimed_ms, failed.claimed_by) == (None, None)
    assert failed.available_ms == 350


@pytest.mark.parametrize("before", [RowState.PUBLISHED, RowState.DEAD])
def test_a_replay_needs_a_new_sequence_and_starts_over(before: RowState) -> None:
    done = row(
        before, attempts=10, last_error="x", published_ms=120 if before is RowState.PUBLISHED else None
    )
    with pytest.raises(TransitionRefused, match="new sequence"):
        move(done, RowState.PENDING, 400)
    again = move(done, RowState.PENDING, 400, seq=42)
    assert (again.state, again.seq, again.id, again.attempts) == (RowState.PENDING, 42, 7, 0)
    assert again.published_ms is None and again.available_ms == 400


def emitted(
    topic: str, value: bytes, key: bytes | None = None
) -> tuple[str, int, bytes | None, bytes, str, bytes, None]:
    """An emitted entry to partition 0 of ``topic``, from entry 1-0 of topic ``in``."""
    return (topic, 0, key, value, "in", b"1-0", None)


def commit(outbox: PartitionOutbox, entries: list[Any]) -> list[int]:
    """Commit a batch's emitted entries as the batch commit does; the ids of its rows."""
    page, writes = outbox.page_for(entries)
    with outbox.store.transaction() as tx:
        for (namespace, key), value in writes.items():
            tx.set(namespace, key, value)
    outbox.committed(page, writes)
    return [page.first_id + i for i in range(len(entries))]


def states(outbox: PartitionOutbox) -> dict[int, RowState]:
    return {r.id: r.state for r in rows_in_store(outbox.store, "app", 0)}


def test_a_batch_is_one_page_of_rows_claimed_by_the_relay_and_waits_for_its_confirmation() -> None:
    outbox = PartitionOutbox(MemoryStore(), "app", 0, "relay-a")
    ids = commit(outbox, [emitted("a", b"1"), emitted("a", b"2"), emitted("b", b"3", key=b"k")])
    assert ids == [1, 2, 3]
    assert len(dict(outbox.store.items(keys.OUTBOX_NAMESPACE))) == 1  # one value for the batch
    assert dict(outbox.store.items(keys.OUTBOX_STATE_NAMESPACE)) == {}  # no record per row
    rows = rows_in_store(outbox.store, "app", 0)
    assert [(r.state, r.claimed_by, r.seq) for r in rows] == [
        (RowState.CLAIMED, "relay-a", s) for s in (1, 2, 3)
    ]
    assert rows[2].fields[b"key"] == b"k" and json.loads(rows[2].fields[b"headers"]) == {
        SOURCE_APP_HEADER: "app",
        "pspf-source-topic": "in",
        "pspf-source-partition": "0",
        SOURCE_ID_HEADER: "1-0",
    }
    assert outbox.publishable(10**13, 100) == []  # not confirmed yet
    outbox.confirm()
    work = outbox.publishable(10**13, 100)
    assert [(target, [item[1] for item in items]) for target, items in work] == [
        (("a", 0), [1, 2]),
        (("b", 0), [3]),
    ]
    assert outbox.counts[RowState.CLAIMED] == 3 and outbox.waiting == 3


def test_rows_wait_behind_a_failed_row_to_the_same_target_and_new_ones_are_created_pending() -> None:
    outbox = PartitionOutbox(MemoryStore(), "app", 0, "relay-a")
    commit(outbox, [emitted("a", b"1"), emitted("a", b"2"), emitted("b", b"3")])
    outbox.confirm()
    first = rows_in_store(outbox.store, "app", 0)[0]
    backing_off = move(first, RowState.PENDING, 10**13, error="down", retry_in_ms=10**13)
    outbox.update([(None, backing_off)])
    assert [(t, [i[1] for i in items]) for t, items in outbox.publishable(10**13, 100)] == [(("b", 0), [3])]
    later = commit(outbox, [emitted("a", b"4"), emitted("c", b"5")])
    assert [states(outbox)[i] for i in later] == [RowState.PENDING, RowState.CLAIMED]
    assert outbox.counts == {
        RowState.PENDING: 2,
        RowState.CLAIMED: 3,
        RowState.PUBLISHED: 0,
        RowState.DEAD: 0,
    }


def test_a_watermark_marks_rows_published_and_a_takeover_reaps_the_other_claims() -> None:
    store = MemoryStore()
    outbox = PartitionOutbox(store, "app", 0, "relay-a")
    commit(outbox, [emitted("a", b"1"), emitted("b", b"2"), emitted("a", b"3")])
    with store.transaction() as tx:  # the relay published rows 1 (a) and 2 (b): seq 1 and 2
        tx.set(keys.OUTBOX_META_NAMESPACE, watermark_key(("a", 0)), msgspec.msgpack.encode((1, 500)))
        tx.set(keys.OUTBOX_META_NAMESPACE, watermark_key(("b", 0)), msgspec.msgpack.encode((2, 600)))
    assert states(outbox) == {1: RowState.PUBLISHED, 2: RowState.PUBLISHED, 3: RowState.CLAIMED}
    again = PartitionOutbox(store, "app", 0, "relay-b")
    again.load()
    rows = {r.id: r for r in rows_in_store(store, "app", 0)}
    assert (
        rows[3].state is RowState.PENDING and rows[3].attempts == 1 and "reaped" in (rows[3].last_error or "")
    )
    assert (rows[1].published_ms, rows[2].published_ms) == (500, 600)
    assert again.counts == {RowState.PENDING: 1, RowState.CLAIMED: 0, RowState.PUBLISHED: 2, RowState.DEAD: 0}
    assert (again.next_id, again.next_seq, again.confirmed) == (4, 4, 3)
    assert [(t, [i[1] for i in items]) for t, items in again.publishable(10**13, 100)] == [(("a", 0), [3])]


def test_a_replay_gives_published_and_dead_rows_new_sequence_numbers_behind_the_rest() -> None:
    store = MemoryStore()
    outbox = PartitionOutbox(store, "app", 0, "relay-a")
    commit(outbox, [emitted("a", b"1"), emitted("a", b"2")])
    outbox.confirm()
    dead = move(rows_in_store(store, "app", 0)[1], RowState.DEAD, 10, error="gone")
    outbox.update(
        [(None, dead)],
        {(keys.OUTBOX_META_NAMESPACE, watermark_key(("a", 0))): msgspec.msgpack.encode((1, 5))},
    )
    outbox.watermarks[("a", 0)] = (1, 5)
    outbox.counts[RowState.CLAIMED] -= 1
    outbox.counts[RowState.PUBLISHED] += 1
    assert states(outbox) == {1: RowState.PUBLISHED, 2: RowState.DEAD}
    assert outbox.replay([1, 2, 99]) == [1, 2]
    rows = rows_in_store(store, "app", 0)
    assert [(r.state, r.seq, r.attempts) for r in rows] == [
        (RowState.PENDING, 3, 0),
        (RowState.PENDING, 4, 0),
    ]
    assert outbox.replay([1]) == []  # pending already: left as it is
