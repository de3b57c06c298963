"""What a worker holds for one partition it owns: its streams' cursors, store and bookkeeping.

``ownership`` takes a partition on and builds an ``OwnedPartition``; the cycle (``delivery``,
``batch``, ``timekeeping``, ``relay``) works on it until the worker gives it up. Everything here
mirrors the partition's store: a field changes only after the store transaction that holds it
committed, so the memory never runs ahead of what a crash would leave.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import keys
from pspf.broker import Fields, RawEntry
from pspf.errors import StreamWentBack
from pspf.failures import Failure
from pspf.keys import ZERO_ID, StreamId
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.outbox.views import PartitionViews
from pspf.partition.backup import PartitionBackup
from pspf.tables.table import RowCache
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import PartitionTimers

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

#: Committed values a worker keeps in memory, shared by the partitions it owns (the store is ours
#: alone while we own the partition); the worker's memory stays bounded however many it owns.
CACHE_LIMIT = 100_000
#: The least a partition keeps, however many the worker owns: a batch's keys are read at once.
MIN_CACHE_SHARE = 100

_failure_decoder = msgspec.msgpack.Decoder(Failure)
_fields_decoder = msgspec.msgpack.Decoder(dict[bytes, bytes])


@dataclass(slots=True, eq=False)
class Superseded:
    """Entries of one stream that a redriven copy later in it replaces (mirrors SUPERSEDED_NAMESPACE).

    A replay marks them; they are done without a handler. A mark is forgotten in the commit that
    moves the checkpoint to or past it, not in the one that finishes the entry: an entry above
    the checkpoint whose acknowledgement is lost is read again, and must still be skipped.
    """

    ids: set[bytes] = field(default_factory=set)
    #: the same ids, largest first: the ones a checkpoint passes come off the end
    order: list[StreamId] = field(default_factory=list)

    def __contains__(self, entry_id: bytes) -> bool:
        return entry_id in self.ids

    def __bool__(self) -> bool:
        return bool(self.ids)

    def load(self, entry_ids: Iterable[bytes]) -> None:
        self.ids.update(entry_ids)
        self.order = sorted((StreamId.parse(e) for e in self.ids), reverse=True)

    def passed(self, checkpoint: StreamId) -> list[bytes]:
        """The marked ids at or below ``checkpoint``: a commit that moves it there forgets them."""
        found = []
        for entry_id in reversed(self.order):
            if entry_id > checkpoint:
                break
            found.append(str(entry_id).encode())
        return found

    def forget(self, passed: list[bytes]) -> None:
        """Drop what ``passed`` returned, once the commit that deleted those marks is done."""
        if passed:
            del self.order[-len(passed) :]
            self.ids.difference_update(passed)


@dataclass(slots=True, eq=False)
class StreamCursor:
    """Where this worker stands in one owned topic partition."""

    topic: str
    partition: int
    stream: str
    dlq: str
    lease_key: str
    lease_value: str
    checkpoint: StreamId | None
    #: Read own pending entries after this id before new ones; None once caught up.
    pending_after: StreamId | None = ZERO_ID
    #: After a failure, the stream is not read before this monotonic time.
    retry_at: float = 0.0
    #: The next pending read takes one entry: the one being retried.
    isolate: bool = False
    #: Deliveries this worker made that ended without an attempt (the stream stopped before
    #: them): they explain part of an entry's delivery count, so they do not make it look poison.
    unattempted: dict[bytes, int] = field(default_factory=dict)
    #: Entries taken from foreign consumers (mirrors FOREIGN_NAMESPACE): never applied, even
    #: at or below the checkpoint, so they are run.
    foreign: set[bytes] = field(default_factory=set)
    #: Entries a redriven copy replaces (a replay marked them): done without a handler.
    superseded: Superseded = field(default_factory=Superseded)
    #: Entries delivered and held back (``pspf.cycle.ordering``): the stream's next ones, a ``Read``
    held: Any = None
    #: After a repartition (``MOVED_NAMESPACE``): old partition -> the entries of it at or below
    #: this were handled; an entry moved from there (its ``pspf-moved-from`` header) is done when
    #: its id is. Empty once the checkpoint passes ``moved_until``, the last moved entry.
    moved: dict[int, StreamId] = field(default_factory=dict)
    moved_until: StreamId | None = None

    def rewind(self) -> None:
        """Re-read all own pending entries: after a failure or a lost connection.

        From the start, not from the checkpoint: entries at or below it may be pending too when
        their acknowledgement was lost; reading them again acknowledges them (held ones too).
        """
        self.pending_after = ZERO_ID
        self.held = None


class Read(NamedTuple):
    """Entries of one stream read in this cycle; ``due`` marks parked entries claimed again.

    Here, beside the cursor, so that ``delivery`` (which reads them) and ``ordering`` (which
    orders them across topics) both import it from below.
    """

    cursor: StreamCursor
    entries: list[RawEntry]
    counts: dict[bytes, int]
    poison: frozenset[bytes] = frozenset()
    due: bool = False
    #: a crash suspect, read with nothing else
    alone: bool = False


@dataclass(slots=True, eq=False)
class OwnedPartition:
    """A partition this worker holds the leases of, with its open store and bookkeeping."""

    partition: int
    store: StateStore
    streams: dict[str, StreamCursor]
    #: what the partition's handlers emitted, to publish
    outbox: PartitionOutbox
    cache: dict[str, bytes | None] = field(default_factory=dict)
    #: the most values ``cache`` keeps: the worker's budget shared by its partitions
    cache_limit: int = CACHE_LIMIT
    #: keys the last batch read ahead or read one by one: while any, the next reads ahead (the first does)
    misses: int = 1
    #: committed rows of the app's tables
    table_cache: RowCache = field(default_factory=RowCache)
    failures: dict[str, Failure] = field(default_factory=dict)
    dead: dict[str, Fields] = field(default_factory=dict)
    consumers: set[str] = field(default_factory=set)
    #: the partition's state backup in Redis; None when the backup is off
    backup: PartitionBackup | None = None
    #: the stream time and open windows (apps with windows or schedules; else None)
    windows: PartitionWindows | None = None
    #: schedules, timer periods and state expiry (apps with any of them; else None)
    timers: PartitionTimers | None = None
    #: the view writes committed and not yet written (apps with views; else None)
    views: PartitionViews | None = None
    #: whether the store holds rows parked entries may look up (``pspf.tables.table``); None: unknown
    history: bool | None = None

    @property
    def keeps_time(self) -> bool:
        """Whether the app has windows, schedules, timers or expiry here (time keeping's work)."""
        return self.windows is not None or self.timers is not None

    def confirmed(self) -> None:
        """What the partition committed so far is acknowledged: its outbox rows and views may go out."""
        self.outbox.confirm()
        if self.views is not None:
            self.views.confirm()

    @property
    def has_parked(self) -> bool:
        """Whether an entry waits parked for its retry (deferred mode)."""
        return any(parked(f) for f in self.failures.values())

    def has_history(self) -> bool:
        """Whether the store holds table rows kept for parked entries (looked at once)."""
        if self.history is None:
            self.history = next(self.store.items(keys.TABLE_HISTORY_NAMESPACE), None) is not None
        return self.history

    def parked_floor(self, changes: dict[str, Failure | None]) -> StreamId | None:
        """The first entry that waits parked once ``changes`` (a batch's failures) are made."""
        names = [n for n, f in self.failures.items() if parked(f) and n not in changes]
        names += [n for n, f in changes.items() if parked(f)]
        return min((StreamId.parse(n.rpartition("/")[2]) for n in names), default=None)

    def due(self, topic: str, now_ms: int, limit: int) -> list[bytes]:
        """The ids of ``topic``'s parked entries whose retry is due at ``now_ms``, at most ``limit``."""
        prefix = f"{topic}/"
        return [
            name[len(prefix) :].encode()
            for name, failure in self.failures.items()
            if failure.due_ms and failure.due_ms <= now_ms and name.startswith(prefix)
        ][:limit]

    def forget_failure(self, topic: str, entry_id: bytes) -> None:
        """Drop an entry's retry bookkeeping outside a batch (the entry left its stream)."""
        name = keys.entry_name(topic, entry_id)
        self.failures.pop(name, None)
        with self.store.transaction() as tx:
            tx.delete(keys.FAILURES_NAMESPACE, name)

    def rewind(self) -> None:
        """Trust nothing read or sent (a lost connection): re-read every own pending entry."""
        if self.outbox.sending is not None:
            self.outbox.sending.sent.abandon()
        for cursor in self.streams.values():
            cursor.rewind()

    def adopt(
        self,
        values: dict[str, bytes | None],
        failures: dict[str, Failure | None],
        dead: dict[str, Fields | None],
    ) -> None:
        """After a commit: its values (cached), retry bookkeeping and DLQ decisions are ours."""
        if len(self.cache) + len(values) > self.cache_limit:
            self.cache.clear()
        self.cache.update(values)
        for name, failure in failures.items():
            if failure is None:
                self.failures.pop(name, None)
            else:
                self.failures[name] = failure
        self.dead.update((name, fields) for name, fields in dead.items() if fields is not None)

    def adopt_rows(self, rows: dict[str, bytes | None], history: bool | None = None) -> None:
        """After a commit: its table rows are the partition's (cached).

        ``history``: whether the store now holds rows kept for parked entries (None: as before).
        """
        if history is not None:
            self.history = history
        if rows:
            self.table_cache.put(rows, self.cache_limit)

    def forget_consumers(self, names: set[str]) -> None:
        """Drop consumers from the store's list (they have nothing pending: takeover needs them not)."""
        if not names:
            return
        with self.store.transaction() as tx:
            for name in names:
                tx.delete(keys.CONSUMERS_NAMESPACE, name)
        self.consumers -= names

    def load_bookkeeping(self) -> None:
        store = self.store
        self.failures = {k: _failure_decoder.decode(v) for k, v in store.items(keys.FAILURES_NAMESPACE)}
        self.dead = {k: _fields_decoder.decode(v) for k, v in store.items(keys.DEAD_NAMESPACE)}
        self.consumers = {name for name, _ in store.items(keys.CONSUMERS_NAMESPACE)}
        for cursor in self.streams.values():
            cursor.foreign.update(self._marked(keys.FOREIGN_NAMESPACE, cursor.topic))
            cursor.superseded.load(self._marked(keys.SUPERSEDED_NAMESPACE, cursor.topic))
            for name, raw in store.items(keys.MOVED_NAMESPACE, f"{cursor.topic}/"):
                where = name.rpartition("/")[2]
                if where == "until":
                    cursor.moved_until = StreamId.parse(raw)
                else:
                    cursor.moved[int(where)] = StreamId.parse(raw)
        self.outbox.load()

    def _marked(self, namespace: str, topic: str) -> list[bytes]:
        """The ids of ``topic`` that a namespace of ``entry_name`` keys marks."""
        prefix = f"{topic}/"
        return [name[len(prefix) :].encode() for name, _ in self.store.items(namespace, prefix)]

    def mark_foreign(self, marks: dict[StreamCursor, list[bytes]], consumer: str | None = None) -> None:
        """Record entries to run although at or below the checkpoint, before they are claimed.

        With ``consumer``, also that this consumer's reads count here from now on.
        """
        if not any(marks.values()) and (consumer is None or consumer in self.consumers):
            return
        with self.store.transaction() as tx:
            for cursor, ids in marks.items():
                for entry_id in ids:
                    tx.set(keys.FOREIGN_NAMESPACE, keys.entry_name(cursor.topic, entry_id), b"")
            if consumer is not None:
                tx.set(keys.CONSUMERS_NAMESPACE, consumer, b"")
        for cursor, ids in marks.items():
            cursor.foreign.update(ids)
        if consumer is not None:
            self.consumers.add(consumer)


def parked(failure: Failure | None) -> bool:
    """Whether a failed entry waits parked for its retry (deferred mode), not in its stream's way."""
    return failure is not None and failure.due_ms > 0


def went_back(last_id: bytes | None, checkpoint: StreamId | None) -> bool:
    """Whether a stream's last generated id is below the checkpoint (``check_tail``)."""
    return checkpoint is not None and last_id is not None and StreamId.parse(last_id) < checkpoint


def check_tail(stream: str, last_id: bytes | None, checkpoint: StreamId | None) -> None:
    """Refuse a stream whose last generated id is below the checkpoint, before anything more is acknowledged.

    Redis gives a new entry an id above the stream's last generated one (kept when trimming
    empties the stream): once that is below the checkpoint, new entries can land at or below it
    and would be skipped as done.
    """
    if not went_back(last_id, checkpoint):
        return
    assert last_id is not None
    raise StreamWentBack(
        f"stream {stream} went back: its last generated id {last_id.decode()} is below the app's "
        f"checkpoint {checkpoint} (the topic was recreated, or Redis lost writes: a restart without "
        "its data, a fail-over, a restore). Entries added now could get ids at or below the "
        "checkpoint and be skipped as done, so nothing more is acknowledged. If the stream holds no "
        f"entry added since (it may be empty), `XSETID {stream} {checkpoint}` moves the stream past "
        "the checkpoint; otherwise replay the app (pspf replay)"
    )
