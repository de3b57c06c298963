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

import ast
import inspect
import logging
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import codec, keys
from pspf.codec import ValueDecoder
from pspf.errors import ConfigError, DecodeError, NonRetryableError
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
#: a row's history: (ms, seq) of each update after a parked entry, and the row it replaced
_History = list[tuple[int, int, bytes | None]]
_decode_history = msgspec.msgpack.Decoder(_History).decode


class TableError(ConfigError, NonRetryableError):
    """A lookup the app cannot make: an undeclared table, another partition's key, no key.

    A global table needs a key. Trying the entry again cannot help: it goes to the DLQ at once.
    """


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

    def drop_after(self, at: StreamId) -> None:
        """Forget the updates of entries after ``at``: they leave the batch (``pspf.cycle.ordering``)."""
        for name in list(self.versions):
            kept = [v for v in self.versions[name] if v[0] <= at]
            if kept:
                self.versions[name] = kept
            else:
                del self.versions[name]

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


def check_lookup_names(app: str, declared: Iterable[str], functions: Iterable[Callable[..., Any]]) -> None:
    """Refuse, before any entry, a function that looks up a table the app does not declare.

    Only literal names are seen (``ctx.table("name")`` on one of its parameters); other names are
    checked when looked up, and functions whose source cannot be read are not checked.
    """
    names = set(declared)
    for func in functions:
        try:
            lines, first = inspect.getsourcelines(func)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        for name, line in _literal_lookups(tree):
            if name not in names:
                tables = ", ".join(repr(n) for n in sorted(names)) or "none"
                where = f"{inspect.getsourcefile(func)}:{first + line - 1}"
                raise ConfigError(
                    f"{func.__qualname__} ({where}) looks up table {name!r}, which app {app!r} does "
                    f"not declare (its tables: {tables}): declare it with app.table({name!r}) or "
                    f"app.global_table({name!r})"
                )


def _literal_lookups(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(name, line) of each ``PARAM.table("name", ...)`` in a function's source."""
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        return
    params = {a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "table"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in params
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


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
