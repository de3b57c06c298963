"""One partition's batch: the overlay handlers see and its ONE commit.

Handlers see the batch's own writes first (the overlay), then the values this worker committed
(a cache: the store is ours alone while we own the partition), then the store. The commit is one
store transaction holding the state writes, the new checkpoints, the outbox rows and the retry
bookkeeping of every stream of the partition (step 5 of the cycle). ``pspf.partition.durability``
makes a committed batch durable (the fenced acknowledgement with the backup's update).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import codec, keys
from pspf.broker import Fields
from pspf.codec import StateDecoder
from pspf.errors import StateError
from pspf.failures import Failure
from pspf.keys import StreamId, entry_name
from pspf.outbox.emit import Emitted, Emitter
from pspf.outbox.views import ViewWrite, bind
from pspf.partition.owned import OwnedPartition, StreamCursor
from pspf.tables import versions
from pspf.tables.lookups import Lookups, check_lookup_key
from pspf.tables.table import MISSING, RowCache, Table, TableError, TableWrites, add_history, row_then
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import PartitionTimers

if TYPE_CHECKING:
    from pspf.state_stores import StateStore
    from pspf.state_stores.base import StoreTransaction

log = logging.getLogger("pspf.batch")


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
        "_global_rows",
        "_global_table_rows",
        "_table_rows",
        "_tables",
        "broken",
        "dead",
        "emitted",
        "emitter",
        "failures",
        "fetched",
        "lookups",
        "overlay",
        "owned",
        "state_decoder",
        "table_writes",
        "ttl_ms",
        "viewed",
        "views",
        "windows",
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
        #: what a lookup reads first, bound once per batch (``table_row``): the tables by name, the
        #: global tables' rows in memory
        self._tables = {} if lookups is None else lookups.tables
        global_tables = None if lookups is None else lookups.global_tables
        self._global_rows = RowCache() if global_tables is None else global_tables.cache
        #: the rows ``table_row`` may copy at once, by table: the global tables', and the
        #: partition's tables' unless rows are kept for parked entries (its history)
        self._global_table_rows = self._global_rows.rows
        self._table_rows = owned.table_cache.rows if lookups is not None and owned.history is False else {}
        #: the batch's table updates, each with its entry's id
        self.table_writes = TableWrites()
        self.overlay: dict[str, bytes | None] = {}
        #: values read ahead for the batch (``prefetch``) that the cache had no room for
        self.fetched: dict[str, bytes | None] = {}
        #: entries emitted by the attempts that returned, in the order they ran
        self.emitted: list[Emitted] = []
        #: view writes of the attempts that returned, in the order they ran
        self.viewed: list[ViewWrite] = []
        #: the app's views by name (``ctx.view``), appending to ``viewed``
        self.views = bind({} if owned.views is None else owned.views.kinds, self.viewed)
        #: the partition's open windows (None: the app has none), read by each windowed entry twice:
        #: an attribute, not a property
        self.windows: PartitionWindows | None = owned.windows
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
        owned = self.owned
        cache = owned.cache
        value = cache.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value = self.fetched.get(key, _MISSING)
        if value is not _MISSING:
            return value
        owned.misses += 1
        with self._reading():
            value = owned.store.get(keys.STATE_NAMESPACE, key)
        if len(cache) < owned.cache_limit:
            cache[key] = value
        return value

    def prefetch(self, entries: Iterable[tuple[bytes, Fields]]) -> None:
        """Read the state of the entries' keys not in memory in one store query.

        A key not in memory costs a store read of its own (about 13 µs in SQLite, more than
        handling the entry); many at once cost a fraction each. Only while batches find keys
        to read (or read one alone): when every key is in memory, as in a steady run over few
        keys, the batch pays nothing.
        """
        owned = self.owned
        if not owned.misses:
            return
        cache, overlay = owned.cache, self.overlay
        wanted: set[str] = set()
        for _, fields in entries:
            raw = fields.get(codec.KEY)
            if raw is None or type(raw) is not bytes:
                continue
            try:
                key = raw.decode()
            except UnicodeDecodeError:
                continue  # refused when its entry runs
            if key not in cache and key not in overlay:
                wanted.add(key)
        owned.misses = len(wanted)  # the next batch reads ahead while this one found keys to read
        if len(wanted) < 2:
            return
        with self._reading():
            found = owned.store.get_many(keys.STATE_NAMESPACE, wanted)
        room = owned.cache_limit - len(cache)
        for key in wanted:
            if room > 0:
                cache[key] = found.get(key)
                room -= 1
            else:
                self.fetched[key] = found.get(key)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """A store read that fails under a handler stops the worker (``broken``), never the entry."""
        try:
            yield
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc

    def table_row(
        self, name: str, key: str, before: bytes | None, what: str, check: bool, at: int | None = None
    ) -> Any:
        """``ctx.table``'s row as of the entry ``before`` (None: the latest), decoded (``pspf.tables.table``).

        A table's row comes from the batch's updates up to that entry, then the partition's
        committed rows, then its store; a global table's from the worker's global store. ``check``:
        the key was given, so it must belong here. Runs per lookup: a row kept decoded in memory
        is copied at once when nothing else can hold a newer one (the common lookups: a table by
        the entry's key, a global table by a text key); every other lookup takes ``_table_row``.
        """
        rows = (self._global_table_rows if check else self._table_rows).get(name)
        if rows is not None and at is None and type(key) is str and not self.table_writes.versions:
            found = rows.get(key)
            if type(found) is tuple:  # kept decoded: a copy of its own for the handler
                return found[1].copy()
        return self._table_row(name, key, before, what, check, at)

    def _table_row(
        self, name: str, key: str, before: bytes | None, what: str, check: bool, at: int | None
    ) -> Any:
        """``table_row`` the longer way: checked first unless it is one of the two common lookups."""
        table = self._tables.get(name)
        if table is None or at is not None or check is not table.is_global or type(key) is not str:
            return self._table_row_checked(name, key, before, what, check, at)
        if check:  # a global table's row
            cache = self._global_rows
        else:
            if self.table_writes.versions or (before is not None and self.owned.history is not False):
                raw = self._row_before(name, key, before)
                if raw is not MISSING:
                    return None if raw is None else table.decode(raw)
            cache = self.owned.table_cache
        rows = cache.rows.get(name)
        found = MISSING if rows is None else rows.get(key, MISSING)
        if type(found) is tuple:
            return found[1].copy()
        if found is MISSING:
            found = self._stored_row(keys.table_key(name, key), check)
        return cache.decode(table, key, found)

    def _row_before(self, name: str, key: str, before: bytes | None) -> Any:
        """A table's row as the batch's updates before the entry, or the kept history, say; else MISSING."""
        stored = keys.table_key(name, key)
        raw = self.table_writes.find(stored, before) if self.table_writes.versions else MISSING
        if raw is MISSING and before is not None and self.owned.history is not False:
            raw = self._row_then(name, stored, before)
        return raw

    def _table_row_checked(
        self, name: str, key: str, before: bytes | None, what: str, check: bool, at: int | None
    ) -> Any:
        """``table_row`` off the short way, checked first.

        An undeclared table, a table's key given (it must be of this partition), a global table
        without a key or with one that is not text, a versioned lookup (``at``).
        """
        table = self._checked_table(name, key, what, check)
        if table.is_global and not check:
            raise TableError(
                f"{what}({name!r}): {name!r} is a global table: give the row's key, {what}({name!r}, key=...)"
            )
        if at is not None:
            return self._row_at(table, f"{name}/{key}", before, at, what)
        return self.table_row(name, key, before, what, False)  # a table's key, checked: the short way

    def _row_at(self, table: Table, stored: str, before: bytes | None, at: int, what: str) -> Any:
        """A versioned table's row current at event time ``at``, as of the entry ``before``."""
        if table.versioned_ms is None:
            raise TableError(
                f"{what}({table.name!r}, at=...): table {table.name!r} is not versioned: declare it "
                f"with app.table({table.name!r}, versioned=timedelta(...))"
            )
        try:
            stored_versions = self.owned.store.get(keys.TABLE_VERSIONS_NAMESPACE, stored)
        except Exception as exc:
            self.broken = exc if isinstance(exc, StateError) else StateError(f"cannot read the store: {exc}")
            raise self.broken from exc
        pending = self.table_writes.timed.get(stored, ())
        seen_before = None if before is None else StreamId.parse(before)
        found = versions.as_of([*versions.decode(stored_versions), *pending], at, seen_before)
        return None if found is None else table.decode(found)

    def _table_versions(self) -> dict[str, bytes | None]:
        """The versions this commit writes: each key's, with the batch's added and the old dropped."""
        assert self.lookups is not None
        out = {}
        for stored, new in self.table_writes.timed.items():
            retention = self.lookups.tables[stored.partition("/")[0]].versioned_ms
            assert retention is not None
            kept = self.owned.store.get(keys.TABLE_VERSIONS_NAMESPACE, stored)
            out[stored] = versions.merged(kept, new, retention)
        return out

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
            committed = owned.table_cache.get(stored)
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
        timed = self._table_versions() if self.table_writes.timed else {}
        owned = self.owned
        views = owned.views if self.viewed or (owned.views is not None and owned.views.obsolete) else None
        latest, view_rows = views.staged(self.viewed) if views is not None else ({}, {})
        time_writes.update(view_rows)
        writes = (self.overlay, self.failures, self.dead, self.emitted, time_writes, rows, history, timed)
        if not (checkpoints or foreign_done or any(writes)):
            return None
        # Superseded marks the new checkpoints pass: at or below a checkpoint an entry is done.
        superseded_passed = {
            o.cursor: o.cursor.superseded.passed(checkpoints[o.cursor.topic])
            for o in outcomes
            if o.checkpoint is not None and o.cursor.superseded
        }
        page, page_writes = owned.outbox.page_for(self.emitted) if self.emitted else (None, {})
        started = time.perf_counter()
        with owned.store.transaction() as tx:
            tx.put(keys.STATE_NAMESPACE, self.overlay)
            tx.put(keys.TABLES_NAMESPACE, rows)
            tx.put(keys.TABLE_HISTORY_NAMESPACE, history)
            tx.put(keys.TABLE_VERSIONS_NAMESPACE, timed)
            tx.update(page_writes)
            tx.update(time_writes)
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
        if views is not None:
            views.committed(latest)
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
