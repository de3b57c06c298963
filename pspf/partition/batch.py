"""One partition's batch and its durability: the overlay, its ONE commit, then the fenced ack.

Handlers see the batch's own writes first (the overlay), then the values this worker committed
(a cache: the store is ours alone while we own the partition), then the store. The commit is one
store transaction holding the state writes, the new checkpoints, the outbox rows and the retry
bookkeeping of every stream of the partition (step 5 of the cycle).

``Durability`` is the one place that makes a commit durable, in this order and nowhere else:
commit (``commit``), then the acknowledgement under the leases that carries the state backup's
update and the DLQ moves (``acknowledge``; ``flush`` for work that acknowledges nothing), then
the outbox rows may be published (``PartitionOutbox.confirm``). It returns the partitions whose
lease (or backup) refused the call; it calls nothing back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec

from pspf import codec, keys
from pspf.broker import AckInFlight, AckRequest, Fields
from pspf.codec import StateDecoder
from pspf.errors import BackupDamaged, LeaseLost, StateError
from pspf.failures import DeadLetter, Failure
from pspf.hooks import ProcessorHooks, call_hook
from pspf.keys import StreamId, entry_name
from pspf.observability.tracing import Tracing
from pspf.outbox.emit import Emitted, Emitter
from pspf.partition.owned import CACHE_LIMIT, OwnedPartition, StreamCursor
from pspf.tables.lookups import Lookups, check_lookup_key
from pspf.tables.table import MISSING, Table, TableError, TableWrites, add_history, row_then
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import PartitionTimers

if TYPE_CHECKING:
    from pspf.state_stores import StateStore
    from pspf.state_stores.base import StoreTransaction

log = logging.getLogger("pspf.batch")

_T = TypeVar("_T")

#: Not in a map (a key's value may be None: it has no state).
_MISSING: Any = object()


class StreamOutcome(NamedTuple):
    """What one stream's read came to in this batch."""

    cursor: StreamCursor
    #: the new checkpoint, None when it does not move
    checkpoint: StreamId | None
    ack_ids: list[bytes]
    #: (id, DLQ fields) of entries to move to the DLQ
    dead: list[tuple[bytes, Fields]]
    #: the stream waits this long before the failed entry is tried again; None: no wait
    retry_in_s: float | None
    handled: int
    skipped: int
    #: the entry the stream stopped at, to retry after ``retry_in_s``
    retry_id: bytes | None = None

    @property
    def finished(self) -> list[bytes]:
        """The ids this batch is done with: acknowledged or dead-lettered."""
        return [*self.ack_ids, *(entry_id for entry_id, _ in self.dead)]


class PartitionBatch:
    """The writes of one partition in one batch, on top of the committed state."""

    __slots__ = (
        "broken",
        "dead",
        "emitted",
        "emitter",
        "failures",
        "lookups",
        "overlay",
        "owned",
        "state_decoder",
        "table_writes",
        "ttl_ms",
    )

    def __init__(
        self,
        owned: OwnedPartition,
        state_decoder: StateDecoder,
        emitter: Emitter,
        lookups: Lookups | None = None,
    ) -> None:
        self.owned = owned
        self.state_decoder = state_decoder
        self.emitter = emitter
        #: the app's tables (None: it declares none)
        self.lookups = lookups
        #: the batch's table updates, each with its entry's id
        self.table_writes = TableWrites()
        self.overlay: dict[str, bytes | None] = {}
        #: entries emitted by the attempts that returned, in the order they ran
        self.emitted: list[Emitted] = []
        self.failures: dict[str, Failure | None] = {}
        self.dead: dict[str, Fields | None] = {}
        #: A store read that failed under a handler: it stops the worker, whatever the handler
        #: did with the exception, and is never an entry's failure.
        self.broken: StateError | None = None
        #: keys written by a handler whose state_ttl differs from the app's: that handler's
        self.ttl_ms: dict[str, int | None] = {}

    def base(self, key: str) -> bytes | None:
        """The value of ``key`` as the next entry must see it."""
        value: bytes | None = self.overlay.get(key, _MISSING)
        if value is not _MISSING:
            return value
        cache = self.owned.cache
        value = cache.get(key, _MISSING)
        if value is not _MISSING:
            return value
        try:
            value = self.owned.store.get(keys.STATE_NAMESPACE, key)
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc
        if len(cache) < CACHE_LIMIT:
            cache[key] = value
        return value

    def table_row(self, name: str, key: str, before: bytes | None, what: str, check: bool) -> Any:
        """``ctx.table``'s row as of the entry ``before`` (None: the latest), decoded (``pspf.tables.table``).

        A table's row comes from the batch's updates up to that entry, then the partition's
        committed rows, then its store; a global table's from the worker's global store. ``check``:
        the key was given, so it must belong here. Runs per lookup: kept flat.
        """
        lookups = self.lookups
        table = None if lookups is None else lookups.tables.get(name)
        if table is None or (check and (not table.is_global or type(key) is not str)):
            table = self._checked_table(name, key, what, check)  # a global table takes any str key
        stored = f"{name}/{key}"  # keys.table_key
        if table.is_global:
            if not check:
                raise TableError(
                    f"{what}({name!r}): {name!r} is a global table: give the row's key, "
                    f"{what}({name!r}, key=...)"
                )
            assert lookups is not None and lookups.global_tables is not None
            raw = lookups.global_tables.cache.get(stored, MISSING)
        else:
            raw = self.table_writes.find(stored, before) if self.table_writes.versions else MISSING
            if raw is MISSING and before is not None and self.owned.history is not False:
                raw = self._row_then(name, stored, before)
            if raw is MISSING:
                raw = self.owned.table_cache.get(stored, MISSING)
        if raw is MISSING:
            raw = self._stored_row(stored, table.is_global)
        return None if raw is None else table.decode(raw)

    def _row_then(self, name: str, stored: str, before: bytes) -> Any:
        """The committed row as of the entry ``before``: a parked entry's lookup (``pspf.tables.table``).

        MISSING when no committed update comes after the entry: the table's latest row is it.
        """
        owned = self.owned
        cursor = owned.streams.get(keys.stream_key(name, owned.partition))
        at = StreamId.parse(before)
        if cursor is None or cursor.checkpoint is None or at >= cursor.checkpoint:
            return MISSING  # no committed update comes after the entry
        try:
            if not owned.has_history():
                return MISSING
            return row_then(owned.store.get(keys.TABLE_HISTORY_NAMESPACE, stored), at)
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc

    def _table_history(self, rows: dict[str, bytes | None]) -> tuple[dict[str, bytes | None], bool | None]:
        """The table history this commit writes, and whether the store holds any after it.

        The rows it replaces with updates after a parked entry are kept for that entry's lookup;
        all of it is deleted once nothing waits parked (``pspf.tables.table``). None: as before.
        """
        owned = self.owned
        floor = owned.parked_floor(self.failures)
        if floor is None:
            if not owned.has_history():
                return {}, None
            return {key: None for key, _ in owned.store.items(keys.TABLE_HISTORY_NAMESPACE)}, False
        out: dict[str, bytes | None] = {}
        for stored in rows:
            if self.table_writes.versions[stored][-1][0] <= floor:
                continue  # every update comes before the parked entries: none looks it up
            committed = owned.table_cache.get(stored, MISSING)
            if committed is MISSING:
                committed = owned.store.get(keys.TABLES_NAMESPACE, stored)
            replaced = self.table_writes.replaced(stored, committed)
            history = owned.store.get(keys.TABLE_HISTORY_NAMESPACE, stored) if owned.has_history() else None
            out[stored] = add_history(history, replaced, floor)
        return out, True if any(v is not None for v in out.values()) else None

    def _checked_table(self, name: str, key: str, what: str, check: bool) -> Table:
        """The table a lookup names, and its key checked when given (TableError otherwise)."""
        if self.lookups is None:
            raise TableError(f"{what}({name!r}): the app declares no tables")
        table = self.lookups.table(name, what)
        if check:
            check_lookup_key(table, key, self.owned.partition, self.lookups.partitions, what)
        return table

    def _stored_row(self, stored: str, is_global: bool) -> bytes | None:
        """A row from the store (remembered); a store that fails stops the worker."""
        try:
            if is_global:
                assert self.lookups is not None and self.lookups.global_tables is not None
                return self.lookups.global_tables.load(stored)
            raw = self.owned.store.get(keys.TABLES_NAMESPACE, stored)
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc
        self.owned.adopt_rows({stored: raw})
        return raw

    @property
    def windows(self) -> PartitionWindows:
        windows = self.owned.windows
        assert windows is not None, "a window aggregation runs only where the app declares windows"
        return windows

    @property
    def timers(self) -> PartitionTimers | None:
        return self.owned.timers

    def failure(self, name: str) -> Failure | None:
        if name in self.failures:
            return self.failures[name]
        return self.owned.failures.get(name)

    def commit(self, outcomes: list[StreamOutcome]) -> float | None:
        """Write the batch in ONE store transaction; the seconds it took, None if nothing to write.

        Then the committed values, bookkeeping and checkpoints become the partition's own.
        """
        checkpoints = {o.cursor.topic: o.checkpoint for o in outcomes if o.checkpoint is not None}
        foreign_done = [
            entry_name(o.cursor.topic, entry_id)
            for o in outcomes
            if o.cursor.foreign
            for entry_id in o.finished
            if entry_id in o.cursor.foreign
        ]
        time_writes = self._time_writes()
        rows = self.table_writes.final()
        history, history_left = self._table_history(rows) if self.lookups is not None else ({}, None)
        writes = (self.overlay, self.failures, self.dead, self.emitted, time_writes, rows, history)
        if not (checkpoints or foreign_done or any(writes)):
            return None
        # Superseded marks the new checkpoints pass: at or below a checkpoint an entry is done.
        superseded_passed = {
            o.cursor: o.cursor.superseded.passed(checkpoints[o.cursor.topic])
            for o in outcomes
            if o.checkpoint is not None and o.cursor.superseded
        }
        owned = self.owned
        page, page_writes = owned.outbox.page_for(self.emitted) if self.emitted else (None, {})
        started = time.perf_counter()
        with owned.store.transaction() as tx:
            tx.put(keys.STATE_NAMESPACE, self.overlay)
            tx.put(keys.TABLES_NAMESPACE, rows)
            tx.put(keys.TABLE_HISTORY_NAMESPACE, history)
            for (namespace, key), value in (*page_writes.items(), *time_writes.items()):
                tx.put(namespace, {key: value})  # None deletes
            tx.put(keys.FAILURES_NAMESPACE, {n: _encode(f) for n, f in self.failures.items()})
            tx.put(keys.DEAD_NAMESPACE, {n: _encode(f) for n, f in self.dead.items()})
            for name in foreign_done:
                tx.delete(keys.FOREIGN_NAMESPACE, name)
            moved_passed = _moved_passed(outcomes)
            _forget_marks(tx, superseded_passed, moved_passed)
            for topic, entry_id in checkpoints.items():
                tx.set_checkpoint(topic, entry_id)
        took = time.perf_counter() - started
        for keeper in (owned.windows, owned.timers):
            if keeper is not None:
                keeper.committed()
        if page is not None:
            owned.outbox.committed(page, page_writes)
        self._adopt(outcomes, superseded_passed)
        for cursor in moved_passed:
            cursor.moved, cursor.moved_until = {}, None
        owned.adopt_rows(rows, history_left)
        return took

    def _time_writes(self) -> dict[tuple[str, str], bytes | None]:
        """What windows, schedules, timers and expiry wrote since the last commit."""
        windows, timers = self.owned.windows, self.owned.timers
        writes = windows.writes() if windows is not None else {}
        if timers is not None and timers.dirty:
            writes.update(timers.writes())
        return writes

    def _adopt(
        self, outcomes: list[StreamOutcome], superseded_passed: dict[StreamCursor, list[bytes]]
    ) -> None:
        """After the commit: the committed values, bookkeeping and checkpoints become the partition's."""
        for cursor, done_ids in superseded_passed.items():
            cursor.superseded.forget(done_ids)
        self.owned.adopt(self.overlay, self.failures, self.dead)
        for o in outcomes:
            if o.checkpoint is not None:
                o.cursor.checkpoint = o.checkpoint


class Acknowledger(Protocol):
    """What acknowledging needs of the broker (``Acknowledging.ack``; ``TestApp`` has its own)."""

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]: ...


class SendsAcks(Acknowledger, Protocol):
    """An acknowledger that can send a call and have its reply read later (``Broker.ack_sent``)."""

    def ack_sent(self, requests: Sequence[AckRequest]) -> AckInFlight: ...


class Acknowledged(NamedTuple):
    """What one acknowledgement came to."""

    #: partition -> (stream, why) of each partition whose lease (or backup) refused the call
    lost: dict[int, tuple[str, LeaseLost]]
    dead_lettered: int

    def merged(self, other: Acknowledged) -> Acknowledged:
        return Acknowledged({**self.lost, **other.lost}, self.dead_lettered + other.dead_lettered)


class _InFlight(NamedTuple):
    """An acknowledgement whose reply is still to be read (``Durability.settle``)."""

    sent: AckInFlight
    requests: list[AckRequest]
    of: dict[str, tuple[OwnedPartition, StreamCursor]]
    partitions: list[OwnedPartition]
    #: the seconds its sending took
    sending_s: float


_NOTHING = Acknowledged({}, 0)


class Durability:
    """Makes committed batches durable: commit, fenced acknowledgement with the backup, confirm."""

    def __init__(
        self,
        acknowledger: Acknowledger,
        group: str,
        hooks: ProcessorHooks,
        tracing: Tracing | None = None,
        sends: SendsAcks | None = None,
    ) -> None:
        self.acknowledger = acknowledger
        self.group = group
        self.hooks = hooks
        #: a span per commit; None: no tracer provider configured (``tracing.configured``)
        self.tracing = tracing
        #: with it, an acknowledgement's reply is read by the next one (``settle``), not waited for
        self.sends = sends
        self._in_flight: _InFlight | None = None

    def commit(self, batch: PartitionBatch, outcomes: list[StreamOutcome]) -> float | None:
        """Step 5 for one partition; the seconds it took, None when there was nothing to write."""
        tracing = self.tracing
        started_ns = 0 if tracing is None else time.time_ns()
        took = batch.commit(outcomes)
        if took is not None:
            call_hook(self.hooks.on_commit, batch.owned.partition, took)
            if tracing is not None:
                topics = sorted({o.cursor.topic for o in outcomes})
                counts = [(o.handled, o.skipped, len(o.dead)) for o in outcomes]
                totals = (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts))
                tracing.commit(batch.owned.partition, topics, totals, started_ns)
        for o in outcomes:  # with nothing to write, the entries done are reported all the same
            if took is not None or o.handled or o.skipped:
                c = o.cursor
                call_hook(self.hooks.on_batch_committed, c.topic, c.partition, o.handled, o.skipped)
        return took

    def commit_alone(self, batch: PartitionBatch) -> tuple[str, LeaseLost] | None:
        """Commit a batch of no entries (time's work) and flush it: ``flush``'s answer.

        Only once ``settle`` read the acknowledgement in flight.
        """
        if self.commit(batch, []) is None:
            return None
        return flush(batch.owned)

    def acknowledge(self, done: list[tuple[PartitionBatch, list[StreamOutcome]]]) -> Acknowledged:
        """Step 6: acknowledge committed batches; each backup's update travels with the first call.

        Per partition, the call of the backup's stream carries the backup update (also with
        nothing to acknowledge). Where an app reads several topics, the other topics' calls go in
        a second round trip, only for the partitions whose backup call succeeded. The outbox rows
        of a partition whose first call succeeded are confirmed in between.

        With ``sends``, a call of one round trip is sent and its reply left to the next
        ``acknowledge`` (or ``settle``), so the server applies it while the next batch is read
        and handled; what is returned then is the previous call's outcome. The next call is
        built only once the previous reply is read: the backup's updates stay in order.
        """
        settled = self.settle()
        done = [(batch, outcomes) for batch, outcomes in done if batch.owned.partition not in settled.lost]
        merged: dict[str, tuple[list[bytes], list[tuple[bytes, Fields]]]] = {}
        for _, stream_outcomes in done:
            for o in stream_outcomes:
                ids, dead = merged.setdefault(o.cursor.stream, ([], []))
                ids += o.ack_ids
                dead += o.dead
        first: list[AckRequest] = []
        then: list[AckRequest] = []
        of: dict[str, tuple[OwnedPartition, StreamCursor]] = {}
        for batch, _ in done:
            owned = batch.owned
            backup = owned.backup
            for c in owned.streams.values():
                of[c.stream] = (owned, c)
                ids, dead = merged.get(c.stream, ([], []))
                if backup is not None and c.stream == backup.stream:
                    first.append(backup.request(ids, c.dlq, dead))
                elif ids or dead:
                    request = AckRequest(c.stream, self.group, c.lease_key, c.lease_value, ids, c.dlq, dead)
                    (then if backup is not None else first).append(request)
        first = [r for r in first if r.ids or r.dead or r.backup is not None]
        if not first and not then:
            return settled
        call_hook(self.hooks.on_acknowledging, {r.stream: len(r.ids) + len(r.dead) for r in [*first, *then]})
        started = time.perf_counter()
        sends = self.sends
        if sends is not None and not then:
            sent = self._sent(first, of, partial(sends.ack_sent, first))
            partitions = [batch.owned for batch, _ in done]
            self._in_flight = _InFlight(sent, first, of, partitions, time.perf_counter() - started)
            return settled
        acked = self._send(first, of, backups=True)
        for batch, _ in done:
            if batch.owned.partition not in acked.lost:  # its rows are in the backup, under the lease
                batch.owned.outbox.confirm()
        more = self._send([r for r in then if of[r.stream][0].partition not in acked.lost], of)
        call_hook(self.hooks.on_ack, time.perf_counter() - started)
        return settled.merged(acked).merged(more)

    def settle(self) -> Acknowledged:
        """Read the acknowledgement in flight, if any: its outcome, its outbox rows confirmed.

        Called before anything else is sent for the partitions (a flush, a hand-over, the end).
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return _NOTHING
        started = time.perf_counter()
        replies = self._sent(in_flight.requests, in_flight.of, in_flight.sent.result)
        acked = self._outcome(in_flight.requests, replies, in_flight.of)
        for owned in in_flight.partitions:
            if owned.partition not in acked.lost:  # its rows are in the backup, under the lease
                owned.outbox.confirm()
        call_hook(self.hooks.on_ack, in_flight.sending_s + time.perf_counter() - started)
        return acked

    def abandon(self) -> None:
        """Leave the acknowledgement in flight unread (a lost connection, the end): it may have run."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.sent.abandon()
            _not_sent(in_flight.requests, in_flight.of)

    def _send(
        self,
        requests: list[AckRequest],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
        backups: bool = False,
    ) -> Acknowledged:
        """One pipelined round trip of acknowledging calls."""
        if not requests:
            return _NOTHING
        call = partial(self.acknowledger.ack, requests)
        replies = self._sent(requests, of, call) if backups else call()
        return self._outcome(requests, replies, of)

    def _sent(
        self,
        requests: list[AckRequest],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
        call: Callable[[], _T],
    ) -> _T:
        """``call``'s answer; if it fails, the calls may not have run: their backup writes go again."""
        try:
            return call()
        except BaseException:
            _not_sent(requests, of)
            raise

    def _outcome(
        self,
        requests: list[AckRequest],
        replies: list[tuple[int, int] | LeaseLost],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
    ) -> Acknowledged:
        """What the calls' replies come to: the partitions refused, the DLQ moves confirmed."""
        lost: dict[int, tuple[str, LeaseLost]] = {}
        dead_lettered = 0
        for request, reply in zip(requests, replies, strict=True):
            owned, cursor = of[request.stream]
            backup = owned.backup
            if isinstance(reply, BackupDamaged) and backup is not None:
                reply = backup.repaired(request)
            if isinstance(reply, LeaseLost):
                lost[owned.partition] = (request.stream, reply)
                continue
            if request.backup is not None and backup is not None:
                backup.sent()
            if request.dead:
                dead_lettered += reply[1]
                self._forget_dead(owned, cursor.topic, request.dead)
        return Acknowledged(lost, dead_lettered)

    def _forget_dead(self, owned: OwnedPartition, topic: str, dead: Sequence[tuple[bytes, Fields]]) -> None:
        """The DLQ moves are confirmed: drop their records (a crash first only repeats a no-op)."""
        with owned.store.transaction() as tx:
            for entry_id, fields in dead:
                tx.delete(keys.DEAD_NAMESPACE, entry_name(topic, entry_id))
                owned.dead.pop(entry_name(topic, entry_id), None)
                log.error(
                    "entry moved to the DLQ topic=%s partition=%s id=%s error=%s",
                    topic,
                    owned.partition,
                    entry_id.decode(),
                    fields.get(b"error_type", b"").decode(),
                )
                call_hook(self.hooks.on_dead_letter, DeadLetter.from_fields(fields))


def _not_sent(requests: list[AckRequest], of: dict[str, tuple[OwnedPartition, StreamCursor]]) -> None:
    """The calls may not have run: their backups send their writes again with the next call."""
    for request in requests:
        backup = of[request.stream][0].backup
        if request.backup is not None and backup is not None:
            backup.not_sent()


def flush(owned: OwnedPartition) -> tuple[str, LeaseLost] | None:
    """Make what the partition's store committed durable without acknowledging anything.

    Its journaled writes go to the state backup under the lease, then its outbox rows may be
    published. Returns (stream, why) when the lease (or the backup) refused: the store is then
    ahead of the backup, and the partition's next owner reconciles them.
    """
    backup = owned.backup
    if backup is not None:
        try:
            backup.flush()
        except LeaseLost as exc:
            return backup.stream, exc
    owned.outbox.confirm()
    return None


def _encode(value: Any) -> bytes | None:
    return None if value is None else msgspec.msgpack.encode(value)


def iter_state(store: StateStore, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every key's decoded state in one store, in key order."""
    for key, raw in store.items(keys.STATE_NAMESPACE, prefix):
        yield key, codec.state_decoder.decode(raw)


def _moved_passed(outcomes: list[StreamOutcome]) -> list[StreamCursor]:
    """The streams whose new checkpoint passes the last entry a repartition moved there."""
    return [
        o.cursor
        for o in outcomes
        if o.cursor.moved_until is not None
        and o.checkpoint is not None
        and o.checkpoint >= o.cursor.moved_until
    ]


def _forget_marks(
    tx: StoreTransaction, superseded_passed: dict[StreamCursor, list[bytes]], moved_passed: list[StreamCursor]
) -> None:
    """Delete the marks a commit's checkpoints pass: superseded entries, a repartition's old positions."""
    for cursor, passed in superseded_passed.items():
        for done_id in passed:
            tx.delete(keys.SUPERSEDED_NAMESPACE, entry_name(cursor.topic, done_id))
    for cursor in moved_passed:
        for name in (*map(str, cursor.moved), "until"):
            tx.delete(keys.MOVED_NAMESPACE, f"{cursor.topic}/{name}")
