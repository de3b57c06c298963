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
crash sees the same rows (``pspf.ordering`` holds back the entries a later read could still
precede).

A **global table** (``App.global_table``): any partition count; every worker holds all of it in
a store of its own under the state dir, with its read position per stream
(``GlobalTables``). A worker reads every global table to the end of its streams before it
handles an entry, then follows them between batches: a lookup sees the row as of the worker's
position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import codec, keys
from pspf.codec import ValueDecoder
from pspf.errors import ConfigError, DecodeError
from pspf.keys import StreamId

if TYPE_CHECKING:
    from pspf.broker import Broker, RawEntry
    from pspf.context import Context
    from pspf.state_stores import StateStore

log = logging.getLogger(__name__)

#: Not among a batch's versions of a row (a row may be None: deleted).
MISSING: Any = object()
#: Rows of the global tables kept in memory per worker (its store holds them all).
GLOBAL_CACHE_LIMIT = 100_000
#: Entries read per global stream and round trip.
GLOBAL_READ_COUNT = 5000

_encode_row = msgspec.msgpack.Encoder().encode


class TableError(ConfigError):
    """A lookup the app cannot make: an undeclared table, a key of another partition."""


class Table:
    """A declared table: its name (its topic's), whether global, and how its rows decode."""

    __slots__ = ("_row_decoder", "decode", "is_global", "name", "value_decoder", "value_type")

    def __init__(self, name: str, value_type: Any, is_global: bool) -> None:
        self.name = keys.check_name("table", name)
        self.value_type = Any if value_type is None else value_type
        self.is_global = is_global
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
        writes.write(keys.table_key(self.name, ctx.key), ctx.entry_id, row)

    def __repr__(self) -> str:
        kind = "global table" if self.is_global else "table"
        return f"<{kind} {self.name!r}>"


class TableWrites:
    """One batch's table updates, each kept with its entry's id (a lookup sees the earlier ones)."""

    __slots__ = ("versions",)

    def __init__(self) -> None:
        #: table_key -> [(entry id, row or None)], in id order
        self.versions: dict[str, list[tuple[StreamId, bytes | None]]] = {}

    def write(self, name: str, entry_id: bytes, row: bytes | None) -> None:
        self.versions.setdefault(name, []).append((StreamId.parse(entry_id), row))

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

    def final(self) -> dict[str, bytes | None]:
        """What the batch commits: each row's last version."""
        return {name: versions[-1][1] for name, versions in self.versions.items()}


def check_lookup_key(table: Table, key: Any, partition: int, partitions: int, what: str) -> str:
    """``key`` when a lookup of ``table`` may use it here; TableError naming both partitions if not."""
    if type(key) is not str:
        raise TableError(f"{what}: the key must be a string, not {type(key).__name__}")
    if not table.is_global:
        owner = keys.partition_for(codec.encode_text("key", key), partitions)
        if owner != partition:
            raise TableError(
                f"{what}: key {key!r} is in partition {owner} of table {table.name!r}, this "
                f"entry's partition is {partition}; a table is looked up by keys of the entry's "
                "partition (a global table by any key)"
            )
    return key


class Lookups:
    """What a worker's batches look rows up in: the app's tables, its partition count, the global tables."""

    __slots__ = ("global_tables", "partitions", "tables")

    def __init__(
        self, tables: dict[str, Table], partitions: int, global_tables: GlobalTables | None = None
    ) -> None:
        self.tables = tables
        self.partitions = partitions
        self.global_tables = global_tables

    def table(self, name: str, what: str) -> Table:
        table = self.tables.get(name)
        if table is None:
            declared = ", ".join(repr(n) for n in sorted(self.tables)) or "none"
            raise TableError(f"{what}({name!r}): the app has no table {name!r} (its tables: {declared})")
        return table


def check_table_partitions(app: str, tables: list[str], counts: dict[str, int]) -> None:
    """Refuse a table whose topic's partition count is not the app's other topics' (one line)."""
    others = {count for topic, count in counts.items() if topic not in tables}
    for table in tables:
        if others and counts[table] not in others:
            theirs = ", ".join(str(n) for n in sorted(others))
            raise ConfigError(
                f"table {table!r} of app {app!r} has {counts[table]} partitions, the app's other "
                f"topics have {theirs}: a table must have the app's partition count (a global "
                "table may have any)"
            )


class GlobalTables:
    """The app's global tables, whole, in this worker's own store, and its position in each stream.

    ``bootstrap`` reads every stream to the end it had when called; ``follow`` reads what came
    since, between batches. Each read is applied in ONE store transaction with the new positions.
    """

    def __init__(
        self, tables: Iterable[Table], store: StateStore, broker: Broker | None, counts: dict[str, int]
    ) -> None:
        """Tables with their partition counts; ``broker`` reads their streams.

        Without a broker, entries come through ``apply`` only (``TestApp``).
        """
        self.tables = {t.name: t for t in tables}
        self.store = store
        self.broker = broker
        #: stream -> (table, checkpoint name in the store)
        self.streams: dict[str, tuple[Table, str]] = {}
        for table in self.tables.values():
            for partition in range(counts[table.name]):
                stream = keys.stream_key(table.name, partition)
                self.streams[stream] = (table, f"{table.name}/{partition}")
        saved = store.checkpoints()
        self.positions: dict[str, StreamId | None] = {
            stream: saved.get(name) for stream, (_, name) in self.streams.items()
        }
        self.cache: dict[str, bytes | None] = {}

    def row(self, name: str, key: str) -> bytes | None:
        """A row as stored (None: no row)."""
        stored = keys.table_key(name, key)
        raw = self.cache.get(stored, MISSING)
        return self.load(stored) if raw is MISSING else raw

    def load(self, stored: str) -> bytes | None:
        """A row from the store, remembered."""
        raw = self.store.get(keys.GLOBAL_TABLES_NAMESPACE, stored)
        if len(self.cache) >= GLOBAL_CACHE_LIMIT:
            self.cache.clear()
        self.cache[stored] = raw
        return raw

    def bootstrap(self) -> int:
        """Read every stream up to its end as of now; the entries applied."""
        assert self.broker is not None
        ends = {stream: self.broker.last_id(stream) for stream in self.streams}
        targets = {s: StreamId.parse(end) for s, end in ends.items() if end is not None}
        started = last_log = time.monotonic()
        applied = 0
        while True:
            behind = [s for s, end in targets.items() if (self.positions[s] or keys.ZERO_ID) < end]
            if not behind:
                break
            got = self.follow(behind)
            applied += got
            if got == 0:  # entries up to the end were deleted (trimmed): nothing more to read
                break
            if time.monotonic() - last_log >= 5:
                last_log = time.monotonic()
                log.info("global tables: %s entries read, %s streams behind", applied, len(behind))
        if self.streams:
            log.info(
                "global tables %s loaded: %s entries in %.1f s",
                sorted(self.tables),
                applied,
                time.monotonic() - started,
            )
        return applied

    def follow(self, streams: Iterable[str] | None = None) -> int:
        """Apply what the streams (all by default) have past their positions; the entries read."""
        after = {s: self.positions[s] for s in (self.streams if streams is None else streams)}
        if not after or self.broker is None:
            return 0
        return self.apply(self.broker.read_after(after, GLOBAL_READ_COUNT))

    def apply(self, read: list[tuple[str, list[RawEntry]]]) -> int:
        """Apply entries of the tables' streams with the new positions in ONE store transaction.

        ``read``: per stream, entries in id order. Returns how many were applied.
        """
        if not read:
            return 0
        rows: dict[str, bytes | None] = {}
        count = 0
        with self.store.transaction() as tx:
            for stream, entries in read:
                table, name = self.streams[stream]
                for entry_id, fields in entries:
                    self._apply(table, entry_id, fields, rows)
                count += len(entries)
                tx.set_checkpoint(name, StreamId.parse(entries[-1][0]))
            tx.put(keys.GLOBAL_TABLES_NAMESPACE, rows)
        for stream, entries in read:
            self.positions[stream] = StreamId.parse(entries[-1][0])
        cache = self.cache
        if cache:  # rows looked up before are refreshed; others are read when looked up
            for stored, row in rows.items():
                if stored in cache:
                    cache[stored] = row
        return count

    def _apply(self, table: Table, entry_id: bytes, fields: Any, rows: dict[str, bytes | None]) -> None:
        raw_key = None if fields is None else fields.get(codec.KEY)
        try:
            if raw_key is None:
                raise DecodeError("the entry has no key")
            value = table.value_decoder.decode(fields)
            key = raw_key.decode()
        except (DecodeError, UnicodeDecodeError) as exc:
            log.warning("global table %s: entry %s skipped: %s", table.name, entry_id.decode(), exc)
            return
        rows[keys.table_key(table.name, key)] = None if value is None else _encode_row(value)

    def lag(self) -> dict[str, int]:
        """Entries each table's streams hold past this worker's positions (up to a limit per stream)."""
        behind: dict[str, int] = {}
        assert self.broker is not None
        for stream, (table, _) in self.streams.items():
            position = self.positions[stream]
            count = self.broker.count_after(stream, str(position or keys.ZERO_ID))
            behind[table.name] = behind.get(table.name, 0) + count
        return behind

    def close(self) -> None:
        self.store.close()
