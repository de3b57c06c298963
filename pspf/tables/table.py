"""Tables: state built from a topic, looked up by handlers with ``ctx.table``.

A table's topic is a changelog: an entry with a key sets that key's row to its value, an entry
whose value is JSON ``null`` deletes the row. Rows are stored msgpack-encoded and decoded into
the table's ``value_type`` when looked up.

A **table** (``App.table``) has the app's partition count. Its topic is read like the app's
other topics, in the same batches, by an internal handler (``Table.apply``); its rows live in the
partition's store (namespace ``__tables``) and follow the partition through the state backup. In
a batch the table's entries run first, and each update is kept with its entry's id
(``TableWrites``): a lookup sees the updates with an id up to its own entry's (ids of
different streams may be equal: the update comes first), never a later one, so a replay after a
crash sees the same rows (``pspf.cycle.ordering`` holds back the entries a later read could still
precede).

An entry parked for a deferred retry is tried again after later entries, table updates among
them, were committed: its lookup must still see the rows as of its own id. So while an entry waits
parked, a commit that replaces a row with an update after it keeps the replaced row with that
update's id (``TABLE_HISTORY_NAMESPACE``, one value per row: ``add_history``), and a lookup whose
entry comes before the table's checkpoint finds there the row its id saw (``row_then``). What no
parked entry can look up any more is dropped; the whole history once nothing waits parked.

A **global table** (``App.global_table``): any partition count; every worker holds all of it in
a store of its own under the state dir, with its read position per stream
(``GlobalTables``). A worker reads every global table to the end of its streams before it
handles an entry, then follows them between batches: a lookup sees the row as of the worker's
position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import keys
from pspf.codec import ValueDecoder
from pspf.errors import ConfigError, NonRetryableError
from pspf.keys import StreamId

if TYPE_CHECKING:
    from pspf.context import Context
    from pspf.tables.versions import Version

log = logging.getLogger("pspf.tables")

#: Not among a batch's versions of a row (a row may be None: deleted).
MISSING: Any = object()
#: Rows of the global tables kept in memory per worker (its store holds them all).
GLOBAL_CACHE_LIMIT = 100_000
#: Entries read per global stream and round trip.
GLOBAL_READ_COUNT = 5000

_encode_row = msgspec.msgpack.Encoder().encode
#: a row's history: (ms, seq) of each update after a parked entry, and the row it replaced
_History = list[tuple[int, int, bytes | None]]
_decode_history = msgspec.msgpack.Decoder(_History).decode


class TableError(ConfigError, NonRetryableError):
    """A lookup the app cannot make: an undeclared table, another partition's key, no key.

    A global table needs a key. Trying the entry again cannot help: it goes to the DLQ at once.
    """


class Table:
    """A declared table: its name (its topic's), whether global, and how its rows decode."""

    __slots__ = (
        "_row_decoder",
        "_timestamp",
        "decode",
        "is_global",
        "name",
        "value_decoder",
        "value_type",
        "versioned_ms",
    )

    def __init__(
        self,
        name: str,
        value_type: Any,
        is_global: bool,
        versioned_ms: int | None = None,
        timestamp: Callable[[Any, Context], int] | None = None,
    ) -> None:
        self.name = keys.check_name("table", name)
        self.value_type = Any if value_type is None else value_type
        self.is_global = is_global
        #: a versioned table's retention of event time (``pspf.tables.versions``); None: not one
        self.versioned_ms = versioned_ms
        #: a versioned table's event time of an update (a delete: its entry's id time)
        self._timestamp = timestamp
        try:
            #: what an entry of the topic decodes into: a row, or None (JSON null) to delete it
            self.value_decoder = ValueDecoder(self.value_type | None)
            self._row_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(self.value_type)
            #: a stored row, decoded
            self.decode = self._row_decoder.decode
        except TypeError as exc:
            raise ConfigError(
                f"table {name!r}: msgspec cannot decode its rows into {value_type!r}: {exc}"
            ) from None

    def row(self, raw: bytes | None) -> Any:
        """A stored row, decoded (None for no row)."""
        return None if raw is None else self._row_decoder.decode(raw)

    def apply(self, value: Any, ctx: Context) -> None:
        """The handler of a table's topic: the entry sets (or, with null, deletes) its key's row."""
        writes: TableWrites = ctx.source.table_writes  # type: ignore[attr-defined] # a batch: sync handler
        row = None if value is None else _encode_row(value)
        stored = keys.table_key(self.name, ctx.key)
        writes.write(stored, ctx.entry_id, row)
        if self.versioned_ms is not None:
            at = StreamId.parse(ctx.entry_id)
            event_ms = at.ms if value is None or self._timestamp is None else self._timestamp(value, ctx)
            writes.write_version(stored, (event_ms, at.ms, at.seq, row))

    def __repr__(self) -> str:
        kind = "global table" if self.is_global else "versioned table" if self.versioned_ms else "table"
        return f"<{kind} {self.name!r}>"


#: The types of a decoded row's values that let the row be kept decoded (its copy is a new row).
_FLAT = frozenset({str, int, float, bool, type(None)})


class RowCache:
    """Committed table rows in memory, by table and key: what a lookup reads before the store.

    A lookup reads it with two dict gets, without building the row's store key. A row that
    decodes into a flat dict (values str, int, float, bool or None) is kept decoded in its place,
    as (the stored row, the decoded row), and later lookups get a copy instead of decoding it
    again: each handler has a row of its own to change. A newer stored row replaces it. Past
    the limit ``put`` is given, it starts again empty.
    """

    __slots__ = ("rows", "size")

    def __init__(self) -> None:
        #: table name -> key -> the row as stored (None: no row), or (as stored, decoded)
        self.rows: dict[str, dict[str, Any]] = {}
        self.size = 0

    def get(self, stored: str) -> bytes | None:
        """A row as stored, by its ``keys.table_key``; MISSING when not in memory."""
        name, _, key = stored.partition("/")
        rows = self.rows.get(name)
        found = MISSING if rows is None else rows.get(key, MISSING)
        return found[0] if type(found) is tuple else found  # type: ignore[no-any-return]

    def put(self, rows: dict[str, bytes | None], limit: int) -> None:
        """Rows by ``keys.table_key``, after dropping all when they would pass ``limit``."""
        if self.size + len(rows) > limit:  # emptied in place: a batch reads ``rows`` as bound
            self.rows.clear()
            self.size = 0
        for stored, raw in rows.items():
            name, _, key = stored.partition("/")
            kept = self.rows.get(name)
            if kept is None:
                kept = self.rows[name] = {}
            if key not in kept:
                self.size += 1
            kept[key] = raw

    def refresh(self, rows: dict[str, bytes | None]) -> None:
        """Newer values of the rows among ``rows`` that are in memory (others are read when looked up)."""
        for stored, raw in rows.items():
            name, _, key = stored.partition("/")
            kept = self.rows.get(name)
            if kept is not None and key in kept:
                kept[key] = raw

    def decode(self, table: Table, key: str, raw: bytes | None) -> Any:
        """Row ``raw`` of ``key`` decoded, and kept decoded when it is flat and still the cached one."""
        if raw is None:
            return None
        row = table.decode(raw)
        if type(row) is dict and all(type(v) in _FLAT for v in row.values()):
            rows = self.rows.get(table.name)
            if rows is not None and rows.get(key) is raw:
                rows[key] = (raw, row.copy())
        return row


class TableWrites:
    """One batch's table updates, each kept with its entry's id (a lookup sees the earlier ones)."""

    __slots__ = ("timed", "versions")

    def __init__(self) -> None:
        #: table_key -> [(entry id, row or None)], in id order
        self.versions: dict[str, list[tuple[StreamId, bytes | None]]] = {}
        #: a versioned table's updates by table_key, with their event times (``pspf.tables.versions``)
        self.timed: dict[str, list[Version]] = {}

    def write(self, name: str, entry_id: bytes, row: bytes | None) -> None:
        self.versions.setdefault(name, []).append((StreamId.parse(entry_id), row))

    def write_version(self, name: str, version: Version) -> None:
        self.timed.setdefault(name, []).append(version)

    def find(self, name: str, before: bytes | None) -> bytes | None:
        """The row as of the entry ``before`` (its id; None: the latest), MISSING when untouched."""
        versions = self.versions.get(name)
        if versions is None:
            return MISSING  # type: ignore[no-any-return]
        if before is None:
            return versions[-1][1]
        at = StreamId.parse(before)
        found = MISSING
        for written_at, row in versions:
            if written_at > at:  # an update with the entry's own id (another stream's) comes first
                break
            found = row
        return found  # type: ignore[no-any-return]

    def drop_after(self, at: StreamId) -> None:
        """Forget the updates of entries after ``at``: they leave the batch (``pspf.cycle.ordering``)."""
        for name in list(self.versions):
            kept = [v for v in self.versions[name] if v[0] <= at]
            if kept:
                self.versions[name] = kept
            else:
                del self.versions[name]
        for name in list(self.timed):
            timed = [v for v in self.timed[name] if (v[1], v[2]) <= at]
            if timed:
                self.timed[name] = timed
            else:
                del self.timed[name]

    def replaced(self, name: str, committed: bytes | None) -> list[tuple[StreamId, bytes | None]]:
        """Each update of the batch to ``name`` with the row it replaced (first: ``committed``)."""
        out = []
        for at, row in self.versions[name]:
            out.append((at, committed))
            committed = row
        return out

    def final(self) -> dict[str, bytes | None]:
        """What the batch commits: each row's last version."""
        return {name: versions[-1][1] for name, versions in self.versions.items()}


def row_then(history: bytes | None, at: StreamId) -> Any:
    """The row a lookup at ``at`` sees by a row's history (None: no row then).

    That is the row the first update after ``at`` replaced; MISSING when none came after it.
    """
    if history is not None:
        for ms, seq, row in _decode_history(history):
            if (ms, seq) > at:
                return row
    return MISSING


def add_history(
    history: bytes | None, replaced: list[tuple[StreamId, bytes | None]], floor: StreamId
) -> bytes | None:
    """A row's history with ``replaced`` added (None: nothing is left to keep).

    It keeps what an entry parked at or after ``floor`` may look up: the updates after it.
    """
    kept = [] if history is None else [h for h in _decode_history(history) if (h[0], h[1]) > floor]
    kept += [(at.ms, at.seq, row) for at, row in replaced if at > floor]
    return _encode_row(kept) if kept else None
