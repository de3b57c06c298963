"""The read order and the screening of ``pspf.cycle.delivery``, on the memory store and a fake broker.

What ``Delivery`` owns: an entry at or below its stream's checkpoint needs no handler (unless a
foreign consumer took it, or it is a parked entry claimed again when due); one judged dead
before a crash is moved, a superseded one and one redriven for another app are skipped, one
deleted while pending is lost; a stream re-reads its own pending entries before anything new;
an entry whose deliveries no recorded outcome explains runs alone, and past ``max_deliveries``
it is poison; ``advance`` moves the read positions after the cycle.

The broker is ``FakeBroker`` below: one consumer group's streams, pending lists and leases, with
only the methods ``Delivery`` calls, answering as ``pspf.broker.Reading`` documents them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest

from pspf import keys
from pspf.broker import Fields, RawEntry, Reading, Topics
from pspf.cycle.delivery import Delivery, Screened
from pspf.errors import BrokerError
from pspf.failures import Failure, RetryPolicy
from pspf.keys import ZERO_ID, StreamId, entry_name
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.partition.owned import OwnedPartition, Read, StreamCursor
from pspf.state_stores import MemoryStore

GROUP, CONSUMER = "app", "c1"
TOPIC, OTHER = "orders", "refunds"
LEASE = "owner|1"
VALUE: Fields = {b"key": b"k", b"value": b"{}"}

NewReply = tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]


# -- the fake broker --------------------------------------------------------------------------


@dataclass
class FakeStream:
    """One stream with one consumer group: its entries, last delivered id and pending list."""

    entries: dict[bytes, Fields] = field(default_factory=dict)
    last_delivered: StreamId = ZERO_ID
    #: id -> (consumer, times delivered)
    pending: dict[bytes, tuple[str, int]] = field(default_factory=dict)

    def ids(self) -> list[bytes]:
        return sorted(self.entries, key=StreamId.parse)


class FakeReadAhead:
    """A read sent ahead: delivered at once here (so pending either way), its reply kept."""

    def __init__(self, reply: NewReply) -> None:
        self.reply = reply
        self.taken = self.dropped = False

    def take(self) -> NewReply:
        self.taken = True
        return self.reply

    def drop(self) -> dict[str, list[bytes]]:
        self.dropped = True
        return {stream.decode(): [entry_id for entry_id, _ in read] for stream, read in self.reply[1]}

    def abandon(self) -> None:
        self.dropped = True


class FakeBroker:
    """The broker calls ``Delivery`` makes (reading, and a stream's last id), over in-memory streams.

    One consumer group's; it stands in for both families ``Delivery`` takes.
    """

    #: what ``Delivery`` asks of the connection: not a cluster
    conn = SimpleNamespace(cluster=False)

    def __init__(self) -> None:
        self.streams: dict[str, FakeStream] = {}
        self.leases: dict[str, str] = {}
        self.calls: list[str] = []
        self.waited: list[dict[str, bytes]] = []
        self.ahead: list[FakeReadAhead] = []

    # -- setting a scene --

    def add(self, stream: str, *ids: str, fields: Fields | None = None) -> None:
        found = self.streams.setdefault(stream, FakeStream())
        for entry_id in ids:
            found.entries[entry_id.encode()] = dict(VALUE if fields is None else fields)

    def delivered(self, stream: str, entry_id: str, times: int, consumer: str = CONSUMER) -> None:
        """Make an entry pending as if delivered ``times`` times before (to ``consumer``)."""
        found = self.streams[stream]
        found.pending[entry_id.encode()] = (consumer, times)
        found.last_delivered = max(found.last_delivered, StreamId.parse(entry_id))

    def times_delivered(self, stream: str, entry_id: str) -> int:
        return self.streams[stream].pending[entry_id.encode()][1]

    # -- Reading --

    def read_new(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> NewReply:
        self.calls.append("read_new")
        return self._read_new(consumer, streams, count)

    def _read_new(self, consumer: str, streams: Sequence[tuple[str, str, str]], count: int) -> NewReply:
        lost = [s for s, lease, value in streams if self.leases.get(lease) != value]
        read: list[tuple[bytes, list[RawEntry]]] = []
        held = [s for s, _, _ in streams if s not in lost]
        for name in held:
            stream = self.streams.setdefault(name, FakeStream())
            new = [i for i in stream.ids() if StreamId.parse(i) > stream.last_delivered][:count]
            for entry_id in new:
                stream.pending[entry_id] = (consumer, 1)
                stream.last_delivered = StreamId.parse(entry_id)
            if new:
                read.append((name.encode(), [(i, dict(stream.entries[i])) for i in new]))
        if read:
            return lost, read, {}
        return lost, [], {name: self.last_id(name) or b"0-0" for name in held}

    def read_ahead(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> FakeReadAhead:
        self.calls.append("read_ahead")
        self.ahead.append(FakeReadAhead(self._read_new(consumer, streams, count)))
        return self.ahead[-1]

    def wait_for_new(self, last_ids: dict[str, bytes], block_ms: int) -> None:
        self.waited.append(dict(last_ids))

    def pending_counts(
        self, stream: str, group: str, consumer: str, after: StreamId, count: int
    ) -> list[tuple[bytes, int]]:
        found = self.streams[stream].pending
        mine = [(i, n) for i, (c, n) in found.items() if c == consumer and StreamId.parse(i) > after]
        return sorted(mine, key=lambda row: StreamId.parse(row[0]))[:count]

    def claim_entries(
        self, stream: str, group: str, consumer: str, ids: Sequence[bytes], lease: tuple[str, str]
    ) -> list[RawEntry] | None:
        self.calls.append(f"claim {stream} {b','.join(ids).decode()}")
        lease_key, lease_value = lease
        if self.leases.get(lease_key) != lease_value:
            return None
        found = self.streams[stream]
        claimed: list[RawEntry] = []
        for entry_id in ids:
            if entry_id not in found.pending:
                continue
            if entry_id not in found.entries:  # deleted while pending: XCLAIM drops it
                del found.pending[entry_id]
                continue
            found.pending[entry_id] = (consumer, found.pending[entry_id][1] + 1)
            claimed.append((entry_id, dict(found.entries[entry_id])))
        return claimed

    def delivery_counts(self, stream: str, group: str, ids: Sequence[bytes]) -> dict[bytes, int]:
        found = self.streams[stream].pending
        return {i: found[i][1] for i in ids if i in found}

    def last_id(self, stream: str) -> bytes | None:
        ids = self.streams.get(stream, FakeStream()).ids()
        return ids[-1] if ids else None


# -- the partition a worker owns ----------------------------------------------------------------


class Scene:
    """A worker owning partition 0 of one or two topics, on the memory store and the fake broker."""

    def __init__(
        self,
        checkpoint: str | None = None,
        topics: Sequence[str] = (TOPIC,),
        batch_size: int = 100,
        max_deliveries: int = 5,
        store: MemoryStore | None = None,
    ) -> None:
        self.broker = FakeBroker()
        self.store = store or MemoryStore()
        if checkpoint is not None:
            with self.store.transaction() as tx:
                tx.set_checkpoint(TOPIC, StreamId.parse(checkpoint))
        self.cursors: dict[str, StreamCursor] = {}
        for topic in topics:
            stream = keys.stream_key(topic, 0)
            lease = keys.lease_key(topic, 0, GROUP)
            self.broker.leases[lease] = LEASE
            self.broker.streams[stream] = FakeStream()
            self.cursors[stream] = StreamCursor(
                topic=topic,
                partition=0,
                stream=stream,
                dlq=keys.dlq_key(topic, 0),
                lease_key=lease,
                lease_value=LEASE,
                checkpoint=self.store.checkpoints().get(topic),
            )
        self.owned = OwnedPartition(
            0, self.store, dict(self.cursors), PartitionOutbox(self.store, GROUP, 0, CONSUMER)
        )
        self.owned.load_bookkeeping()
        policies = {topic: RetryPolicy(max_deliveries=max_deliveries) for topic in topics}
        # The fake answers every method Delivery calls; it is no broker family otherwise.
        self.delivery = Delivery(
            cast(Reading, self.broker),
            cast(Topics, self.broker),
            GROUP,
            CONSUMER,
            batch_size,
            100,
            policies,
            {0: self.owned},
            self.cursors,
        )

    @property
    def stream(self) -> str:
        return keys.stream_key(TOPIC, 0)

    @property
    def cursor(self) -> StreamCursor:
        return self.cursors[self.stream]

    def screen(
        self, *ids: str, due: bool = False, fields: Mapping[str, Fields | None] | None = None
    ) -> Screened:
        """Screen a read of these ids (fields by id where given, else ``VALUE``)."""
        chosen = fields or {}
        entries: list[RawEntry] = [(i.encode(), chosen.get(i, VALUE)) for i in ids]
        return self.delivery.screen(self.owned, Read(self.cursor, entries, {}, due=due))


def todo_ids(screened: Screened) -> list[str]:
    return [entry_id.decode() for entry_id, _ in screened.todo]


def ids_of(entries: Sequence[tuple[bytes, object]]) -> list[str]:
    return [entry_id.decode() for entry_id, _ in entries]


def read_ids(reads: list[Read]) -> list[tuple[str, list[str]]]:
    return [(r.cursor.topic, ids_of(r.entries)) for r in reads]


def failure(attempts: int = 1, due_ms: int = 0) -> Failure:
    return Failure(
        attempts=attempts,
        first_failed_ms=1,
        last_failed_ms=1,
        error_type="RuntimeError",
        message="boom",
        due_ms=due_ms,
    )


def store_with(
    checkpoint: str, marks: dict[str, dict[str, bytes]], extra: dict[tuple[str, str], bytes] | None = None
) -> MemoryStore:
    """A store at ``checkpoint`` of TOPIC holding bookkeeping ``marks`` (namespace -> id -> value)."""
    store = MemoryStore()
    values = {(ns, entry_name(TOPIC, i.encode())): v for ns, by_id in marks.items() for i, v in by_id.items()}
    store.rewind(set(), {TOPIC: StreamId.parse(checkpoint)}, {**values, **(extra or {})})
    return store


# -- screening --------------------------------------------------------------------------------


def test_entries_at_or_below_the_checkpoint_are_done_without_a_handler() -> None:
    scene = Scene(checkpoint="5-0")

    screened = scene.screen("4-0", "5-0", "5-1", "6-0")

    assert screened.done_ids == [b"4-0", b"5-0"]
    assert screened.skipped == 2 and screened.lost == 0 and screened.dead == []
    assert todo_ids(screened) == ["5-1", "6-0"]


def test_ids_are_compared_as_numbers_not_as_text() -> None:
    """As text "10-0" < "9-0"; as ids 10-0 is above a checkpoint at 9-0."""
    scene = Scene(checkpoint="9-0")

    screened = scene.screen("8-0", "10-0")

    assert screened.done_ids == [b"8-0"] and todo_ids(screened) == ["10-0"]


def test_without_a_checkpoint_every_entry_needs_its_handler() -> None:
    screened = Scene().screen("1-0", "2-0")

    assert todo_ids(screened) == ["1-0", "2-0"] and screened.done_ids == [] and screened.skipped == 0


def test_an_entry_judged_dead_before_a_crash_is_moved_with_its_recorded_dlq_fields() -> None:
    dlq_fields = {b"error_type": b"Boom", b"value": b"{}"}
    store = store_with("5-0", {keys.DEAD_NAMESPACE: {"3-0": msgspec.msgpack.encode(dlq_fields)}})
    scene = Scene(store=store)

    screened = scene.screen("2-0", "3-0", "6-0")

    assert screened.dead == [(b"3-0", dlq_fields)]
    assert screened.done_ids == [b"2-0"] and screened.skipped == 1
    assert todo_ids(screened) == ["6-0"]


def test_a_parked_entry_at_or_below_the_checkpoint_stays_pending_until_due() -> None:
    parked = msgspec.msgpack.encode(failure(due_ms=int(time.time() * 1000) + 60_000))
    waiting = msgspec.msgpack.encode(failure())  # a failure in ordered mode: not parked
    store = store_with("5-0", {keys.FAILURES_NAMESPACE: {"3-0": parked, "4-0": waiting}})
    scene = Scene(store=store)

    screened = scene.screen("3-0", "4-0")

    # Neither acknowledged nor run nor dead: it stays in the pending list for read_due.
    assert screened.done_ids == [b"4-0"] and screened.todo == [] and screened.dead == []


def test_a_parked_entry_claimed_when_due_runs_although_below_the_checkpoint() -> None:
    scene = Scene(checkpoint="5-0")

    screened = scene.screen("3-0", due=True)

    assert todo_ids(screened) == ["3-0"] and screened.done_ids == []


def test_a_foreign_entry_below_the_checkpoint_runs_first_in_id_order() -> None:
    """Taken from a foreign consumer: never applied by this app's history, so it is run."""
    store = store_with("5-0", {keys.FOREIGN_NAMESPACE: {"2-0": b"", "4-0": b""}})
    scene = Scene(store=store)
    assert scene.cursor.foreign == {b"2-0", b"4-0"}

    screened = scene.screen("2-0", "3-0", "4-0", "6-0")

    assert todo_ids(screened) == ["2-0", "4-0", "6-0"]
    assert screened.done_ids == [b"3-0"] and screened.skipped == 1


def test_superseded_entries_are_skipped_below_and_above_the_checkpoint() -> None:
    marks = {"2-0": b"9-0", "6-0": b"9-0"}
    store = store_with("5-0", {keys.SUPERSEDED_NAMESPACE: marks, keys.FOREIGN_NAMESPACE: {"2-0": b""}})
    scene = Scene(store=store)

    screened = scene.screen("2-0", "6-0", "7-0")

    # 2-0 is foreign but superseded: its redriven copy is applied instead, so it is not run.
    assert todo_ids(screened) == ["7-0"]
    assert sorted(screened.done_ids) == [b"2-0", b"6-0"] and screened.skipped == 2


def test_an_entry_deleted_while_pending_is_done_as_lost() -> None:
    scene = Scene()

    screened = scene.screen("1-0", "2-0", fields={"1-0": None})

    assert screened.done_ids == [b"1-0"] and screened.lost == 1 and screened.skipped == 0
    assert todo_ids(screened) == ["2-0"]


def redriven(app: str | None) -> Fields:
    headers = {"trace": "x"} if app is None else {keys.REDRIVE_APP_HEADER: app}
    return {**VALUE, b"headers": msgspec.json.encode(headers)}


def test_a_redriven_entry_runs_only_in_the_app_it_was_redriven_for() -> None:
    scene = Scene()
    fields = {"1-0": redriven("another-app"), "2-0": redriven(GROUP), "3-0": redriven(None)}

    screened = scene.screen("1-0", "2-0", "3-0", fields=fields)

    assert screened.done_ids == [b"1-0"] and screened.skipped == 1
    assert todo_ids(screened) == ["2-0", "3-0"]


# -- pending entries first ------------------------------------------------------------------


def test_own_pending_entries_are_read_before_new_ones() -> None:
    scene = Scene()
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0", "4-0")
    scene.broker.delivered(scene.stream, "1-0", 1)
    scene.broker.delivered(scene.stream, "2-0", 1)

    reads, lost = scene.delivery.read(block=False)

    assert lost == [] and read_ids(reads) == [(TOPIC, ["1-0", "2-0"])]
    assert "read_new" not in scene.broker.calls  # nothing new is read while own entries are pending
    assert reads[0].counts == {b"1-0": 2, b"2-0": 2}  # this delivery counts
    assert not reads[0].poison and not reads[0].alone

    scene.delivery.advance([(scene.cursor, [b"1-0", b"2-0"], None)], reads)
    assert scene.cursor.pending_after == StreamId(2, 0)
    for entry_id in ("1-0", "2-0"):  # as the acknowledgement would
        del scene.broker.streams[scene.stream].pending[entry_id.encode()]

    reads, _ = scene.delivery.read(block=False)

    # The pending list is done: the stream is caught up and reads new entries in the same cycle.
    assert scene.cursor.pending_after is None
    assert read_ids(reads) == [(TOPIC, ["3-0", "4-0"])]


def test_a_stream_with_pending_entries_does_not_hold_back_the_others() -> None:
    scene = Scene(topics=(TOPIC, OTHER))
    other = keys.stream_key(OTHER, 0)
    scene.broker.add(scene.stream, "1-0", "2-0")
    scene.broker.delivered(scene.stream, "1-0", 1)
    scene.broker.add(other, "5-0")
    scene.cursors[other].pending_after = None  # caught up

    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["1-0"]), (OTHER, ["5-0"])]


def test_a_pending_read_under_a_lease_that_moved_claims_nothing_and_reports_the_stream() -> None:
    scene = Scene()
    scene.broker.add(scene.stream, "1-0")
    scene.broker.delivered(scene.stream, "1-0", 1)
    scene.broker.leases[scene.cursor.lease_key] = "another|2"

    reads, lost = scene.delivery.read(block=False)

    assert reads == [] and lost == [scene.stream]
    assert scene.broker.times_delivered(scene.stream, "1-0") == 1


def test_new_reads_under_a_lease_that_moved_report_the_stream() -> None:
    scene = Scene()
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0")
    scene.broker.leases[scene.cursor.lease_key] = "another|2"

    reads, lost = scene.delivery.read(block=False)

    assert reads == [] and lost == [scene.stream]


# -- crash suspects and poison ------------------------------------------------------------------


def test_an_entry_delivered_twice_without_an_outcome_is_read_alone() -> None:
    """It may have crashed the worker: nothing else is delivered with it, not even new entries."""
    scene = Scene(topics=(TOPIC, OTHER))
    other = keys.stream_key(OTHER, 0)
    scene.broker.add(scene.stream, "1-0", "2-0")
    scene.broker.delivered(scene.stream, "1-0", 2)
    scene.broker.delivered(scene.stream, "2-0", 2)
    scene.broker.add(other, "5-0")
    scene.cursors[other].pending_after = None

    reads, lost = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["1-0"])] and lost == []
    assert reads[0].alone
    assert "read_new" not in scene.broker.calls
    assert scene.broker.times_delivered(scene.stream, "2-0") == 2  # its batch-mate's count stays


def test_a_pending_read_stops_before_the_first_suspect() -> None:
    scene = Scene()
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0")
    scene.broker.delivered(scene.stream, "1-0", 1)
    scene.broker.delivered(scene.stream, "2-0", 2)
    scene.broker.delivered(scene.stream, "3-0", 1)

    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["1-0"])] and not reads[0].alone


@pytest.mark.parametrize(
    "explained",
    [
        pytest.param("failure", id="a recorded failed attempt"),
        pytest.param("unattempted", id="a delivery that ended unattempted"),
    ],
)
def test_deliveries_with_a_recorded_outcome_do_not_make_an_entry_a_suspect(explained: str) -> None:
    store = MemoryStore()
    if explained == "failure":
        store = store_with("0-1", {keys.FAILURES_NAMESPACE: {"1-0": msgspec.msgpack.encode(failure(1))}})
    scene = Scene(store=store)
    if explained == "unattempted":
        scene.cursor.unattempted[b"1-0"] = 1
    scene.broker.add(scene.stream, "1-0", "2-0")
    scene.broker.delivered(scene.stream, "1-0", 2)
    scene.broker.delivered(scene.stream, "2-0", 1)

    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["1-0", "2-0"])] and not reads[0].alone
    assert reads[0].poison == frozenset()


@pytest.mark.parametrize(("delivered", "poison"), [(2, False), (3, True)])
def test_an_entry_delivered_more_than_max_deliveries_times_without_an_outcome_is_poison(
    delivered: int, poison: bool
) -> None:
    """This read is delivery number ``delivered + 1``: poison once that exceeds max_deliveries 3."""
    scene = Scene(max_deliveries=3)
    scene.broker.add(scene.stream, "1-0")
    scene.broker.delivered(scene.stream, "1-0", delivered)

    reads, _ = scene.delivery.read(block=False)

    assert reads[0].counts == {b"1-0": delivered + 1}
    assert reads[0].poison == (frozenset({b"1-0"}) if poison else frozenset())


def test_after_a_failure_the_retried_entry_is_read_alone_and_the_stream_waits() -> None:
    scene = Scene()
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0")
    scene.cursor.pending_after = None
    reads, _ = scene.delivery.read(block=False)
    assert read_ids(reads) == [(TOPIC, ["1-0", "2-0", "3-0"])]

    # 1-0 committed, 2-0 failed and is retried in a moment; 3-0 waits.
    scene.delivery.advance([(scene.cursor, [b"1-0"], 30.0)], reads)
    del scene.broker.streams[scene.stream].pending[b"1-0"]

    assert scene.cursor.pending_after == ZERO_ID and scene.cursor.isolate
    assert scene.cursor.retry_at > time.monotonic() + 20
    assert scene.delivery.read(block=False) == ([], [])  # not before its retry is due
    assert scene.broker.times_delivered(scene.stream, "2-0") == 1

    scene.cursor.retry_at = 0.0
    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["2-0"])]


def test_a_stream_that_went_on_reads_its_whole_pending_window_again() -> None:
    scene = Scene()
    scene.cursor.isolate = True
    scene.cursor.pending_after = StreamId(0, 5)
    reads = [Read(scene.cursor, [(b"1-0", VALUE), (b"2-0", VALUE)], {})]

    scene.delivery.advance([(scene.cursor, [b"1-0", b"2-0"], None)], reads)

    assert not scene.cursor.isolate and scene.cursor.retry_at == 0.0
    assert scene.cursor.pending_after == StreamId(2, 0)


def test_advance_forgets_the_marks_of_finished_entries_and_leaves_a_caught_up_stream_so() -> None:
    scene = Scene()
    scene.cursor.pending_after = None
    scene.cursor.unattempted.update({b"1-0": 1, b"9-0": 1})
    scene.cursor.foreign.update({b"1-0", b"9-0"})
    reads = [Read(scene.cursor, [(b"1-0", VALUE)], {})]

    scene.delivery.advance([(scene.cursor, [b"1-0"], None)], reads)

    assert scene.cursor.unattempted == {b"9-0": 1} and scene.cursor.foreign == {b"9-0"}
    assert scene.cursor.pending_after is None


def test_advance_leaves_the_read_position_of_a_stream_that_only_retried_parked_entries() -> None:
    scene = Scene()
    scene.cursor.pending_after = StreamId(1, 0)
    due = [Read(scene.cursor, [(b"7-0", VALUE)], {}, due=True)]

    scene.delivery.advance([(scene.cursor, [b"7-0"], 5.0)], due)

    assert scene.cursor.pending_after == StreamId(1, 0)
    assert not scene.cursor.isolate and scene.cursor.retry_at == 0.0


def test_parked_entries_are_left_out_of_the_pending_read() -> None:
    parked = msgspec.msgpack.encode(failure(due_ms=int(time.time() * 1000) + 60_000))
    scene = Scene(store=store_with("0-1", {keys.FAILURES_NAMESPACE: {"1-0": parked, "2-0": parked}}))
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0")
    for entry_id in ("1-0", "2-0"):
        scene.broker.delivered(scene.stream, entry_id, 3)

    reads, _ = scene.delivery.read(block=False)

    # Only parked entries pending: the window moves past them, their counts do not grow.
    assert reads == []
    assert scene.cursor.pending_after == StreamId(2, 0)
    assert scene.broker.times_delivered(scene.stream, "1-0") == 3

    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["3-0"])]


def test_due_parked_entries_are_claimed_and_counted_and_not_yet_due_ones_wait() -> None:
    now_ms = int(time.time() * 1000)
    failures = {
        "1-0": msgspec.msgpack.encode(failure(due_ms=now_ms - 1)),
        "2-0": msgspec.msgpack.encode(failure(due_ms=now_ms + 60_000)),
        "3-0": msgspec.msgpack.encode(failure(due_ms=now_ms - 1)),  # deleted from the stream meanwhile
    }
    scene = Scene(store=store_with("0-1", {keys.FAILURES_NAMESPACE: failures}))
    scene.broker.add(scene.stream, "1-0", "2-0")
    for entry_id in ("1-0", "2-0", "3-0"):
        scene.broker.delivered(scene.stream, entry_id, 1)

    reads = scene.delivery.read_due()

    assert read_ids(reads) == [(TOPIC, ["1-0"])] and reads[0].due
    assert reads[0].counts == {b"1-0": 2}
    assert scene.broker.times_delivered(scene.stream, "2-0") == 1
    # The deleted one is forgotten, in memory and in the store.
    gone = entry_name(TOPIC, b"3-0")
    assert gone not in scene.owned.failures
    assert scene.store.get(keys.FAILURES_NAMESPACE, gone) is None


# -- new entries ----------------------------------------------------------------------------


def test_a_read_that_finds_nothing_waits_for_new_entries_only_when_told_to_block() -> None:
    scene = Scene()
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0")
    scene.broker.delivered(scene.stream, "1-0", 1)  # read before: nothing new

    assert scene.delivery.read(block=False) == ([], [])
    assert scene.broker.waited == []

    assert scene.delivery.read(block=True) == ([], [])
    assert scene.broker.waited == [{scene.stream: b"1-0"}]


def test_a_stream_whose_last_id_is_below_the_checkpoint_is_refused() -> None:
    """The stream went back (recreated, or Redis lost writes): new entries could be skipped as done."""
    scene = Scene(checkpoint="9-0")
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "3-0")
    scene.broker.delivered(scene.stream, "3-0", 1)

    with pytest.raises(BrokerError, match="went back"):
        scene.delivery.read(block=False)


def test_new_entries_at_or_below_the_checkpoint_make_the_stream_tail_checked() -> None:
    scene = Scene(checkpoint="9-0")
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "3-0", "4-0")

    with pytest.raises(BrokerError, match="went back"):
        scene.delivery.read(block=False)


def test_after_a_full_batch_the_next_read_is_sent_ahead_and_taken_by_the_next_cycle() -> None:
    scene = Scene(batch_size=2)
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0")

    reads, _ = scene.delivery.read(block=False)
    assert read_ids(reads) == [(TOPIC, ["1-0", "2-0"])]
    assert scene.broker.calls == ["read_new", "read_ahead"]
    scene.delivery.advance([(scene.cursor, [b"1-0", b"2-0"], None)], reads)

    reads, _ = scene.delivery.read(block=False)

    assert read_ids(reads) == [(TOPIC, ["3-0"])]
    assert scene.broker.calls == ["read_new", "read_ahead"]  # the reply sent ahead was taken
    assert scene.broker.ahead[0].taken


def test_a_read_ahead_for_other_streams_is_dropped_and_its_entries_read_again_from_pending() -> None:
    scene = Scene(batch_size=2)
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0", "2-0", "3-0", "4-0")
    reads, _ = scene.delivery.read(block=False)
    assert read_ids(reads) == [(TOPIC, ["1-0", "2-0"])]

    # 1-0 failed: the stream rewinds; its read sent ahead (3-0, 4-0) no longer fits.
    scene.delivery.advance([(scene.cursor, [], 0.0)], reads)
    scene.cursor.retry_at = 0.0
    reads, _ = scene.delivery.read(block=False)

    assert scene.broker.ahead[0].dropped and not scene.broker.ahead[0].taken
    # Their delivery by the dropped read counts as unattempted: it makes no entry look poison.
    assert scene.cursor.unattempted == {b"3-0": 1, b"4-0": 1}
    assert read_ids(reads) == [(TOPIC, ["1-0"])]  # isolated: the retried entry alone


def test_drop_ahead_rewinds_the_streams_it_read() -> None:
    scene = Scene(batch_size=1)
    scene.cursor.pending_after = None
    scene.broker.add(scene.stream, "1-0", "2-0")
    scene.delivery.read(block=False)

    scene.delivery.drop_ahead()

    assert scene.cursor.pending_after == ZERO_ID
    assert scene.cursor.unattempted == {b"2-0": 1}
    scene.delivery.drop_ahead()  # nothing left to drop
    assert scene.cursor.unattempted == {b"2-0": 1}
