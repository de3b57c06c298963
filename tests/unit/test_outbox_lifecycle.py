"""The outbox row lifecycle of seed 000: every allowed transition and its fields; every other refused."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from pspf.outbox import TRANSITIONS, OutboxRow, PartitionOutbox, RowState, TransitionRefused, move
from state_stores import MemoryStore

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


def test_publishable_rows_wait_behind_an_earlier_row_to_the_same_target() -> None:
    outbox = PartitionOutbox(MemoryStore(), "app", 0, "relay-a")
    rows = outbox.rows_for(
        [("a", 0, {b"value": b"1"}), ("a", 0, {b"value": b"2"}), ("b", 0, {b"value": b"3"})]
    )
    outbox.committed(rows)
    assert outbox.publishable(10**13, 100) == []  # not confirmed yet
    outbox.confirm()
    assert [r.id for r in outbox.publishable(10**13, 100)] == [1, 2, 3]
    outbox.open[1] = move(
        outbox.open[1], RowState.PENDING, 10**13, error="down", retry_in_ms=10**13
    )  # backing off
    assert [r.id for r in outbox.publishable(10**13, 100)] == [3]
    # A new row to the held target waits PENDING behind it; one to another target is claimed at once.
    later = outbox.rows_for([("a", 0, {b"value": b"4"}), ("c", 0, {b"value": b"5"})])
    assert [(r.state, r.claimed_by) for r in later] == [
        (RowState.PENDING, None),
        (RowState.CLAIMED, "relay-a"),
    ]
