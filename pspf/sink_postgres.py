"""The PostgreSQL sink: a topic into a table, each entry's row once (psycopg 3).

Two modes. ``rows``: one row per entry, unique by (partition, entry_id); a row written again
is skipped (``ON CONFLICT DO NOTHING``). ``upsert``: one row per key holding the value of its
latest entry; an older entry never overwrites a newer one (the row keeps the entry id it came
from and is replaced only by a later id), so a replay, a redrive or a late writer changes nothing.

Beside the table, three tables of its own, shared by every sink of the database and keyed by the
sink's name and partition: ``pspf_sink_owners`` (a generation per partition: ``claim`` raises it,
each commit locks the row and writes only while it is still its own, so a worker that was taken
over writes nothing), ``pspf_sink_state`` (the processor's bookkeeping: attempts, dead entries,
the consumers that applied entries) and ``pspf_sink_checkpoints``. A batch's rows, bookkeeping and
checkpoints are one transaction: the checkpoint is written with the data it covers.

Writes are batched: a batch's rows go in ONE statement, a column of values per parameter.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import msgspec

from pspf.context import Context
from pspf.errors import ConfigError, SinkUnavailable
from pspf.keys import StreamId, check_name
from pspf.settings import mask_url
from pspf.sink import RowsRefused, Sink, SinkPartition, SinkRecord, SinkRefused, Updates

try:
    import psycopg
    from psycopg import sql
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the PostgreSQL sink needs psycopg 3: pip install 'pspf[postgres]'") from exc

log = logging.getLogger(__name__)

Mode = Literal["rows", "upsert"]

#: the columns a sink table has, by mode (name, type as information_schema spells it)
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "rows": [
        ("partition", "integer"),
        ("entry_id", "text"),
        ("key", "text"),
        ("value", "jsonb"),
        ("headers", "jsonb"),
    ],
    "upsert": [
        ("key", "text"),
        ("partition", "integer"),
        ("entry_id", "text"),
        ("value", "jsonb"),
        ("headers", "jsonb"),
    ],
}

_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS pspf_sink_owners (
    sink text NOT NULL, partition integer NOT NULL, generation bigint NOT NULL,
    PRIMARY KEY (sink, partition));
CREATE TABLE IF NOT EXISTS pspf_sink_state (
    sink text NOT NULL, partition integer NOT NULL, namespace text NOT NULL, key text NOT NULL,
    value bytea NOT NULL, PRIMARY KEY (sink, partition, namespace, key));
CREATE TABLE IF NOT EXISTS pspf_sink_checkpoints (
    sink text NOT NULL, partition integer NOT NULL, topic text NOT NULL,
    ms bigint NOT NULL, seq bigint NOT NULL, PRIMARY KEY (sink, partition, topic));
"""

#: the advisory lock that ``prepare`` holds while it creates tables
_PREPARE_LOCK = 0x70737066_73696E6B  # "pspfsink"

#: an entry id as a comparable pair, in SQL
_ORDER = "(split_part({0}.entry_id, '-', 1)::bigint, split_part({0}.entry_id, '-', 2)::bigint)"

#: errors that belong to the rows (SQLSTATE classes 22, data, and 23, constraints)
_REFUSALS = (psycopg.errors.DataError, psycopg.errors.IntegrityError)


class PostgresSink(Sink):
    """Deliver a topic into the table ``table`` of the PostgreSQL database at ``dsn``.

    ``name`` is the sink's consumer group (default ``sink-postgres-<table>``). The table is
    created when missing; one with other columns is refused.
    """

    def __init__(self, dsn: str, table: str, mode: Mode = "rows", name: str | None = None) -> None:
        if mode not in COLUMNS:
            raise ConfigError(f"unknown sink mode {mode!r}: rows or upsert")
        parts = table.split(".")
        if not 1 <= len(parts) <= 2 or not all(parts):
            raise ConfigError(f"invalid table name {table!r}: NAME or SCHEMA.NAME")
        self.dsn = dsn
        self.table = table
        self.mode: Mode = mode
        self.name = name or f"sink-postgres-{table}"
        check_name("sink name", self.name)
        self._identifier = sql.Identifier(*parts)
        self.insert = self._insert_statement()

    def _insert_statement(self) -> sql.Composed:
        """One statement for a whole batch: a column of values per parameter, ``unnest`` into rows."""
        columns = COLUMNS[self.mode]
        names = [name for name, _ in columns]
        insert = sql.SQL("INSERT INTO {} ({}) SELECT * FROM unnest({})").format(
            self._identifier,
            sql.SQL(", ").join(map(sql.Identifier, names)),
            sql.SQL(", ").join(sql.SQL("%s::{}[]").format(sql.SQL(kind)) for _, kind in columns),
        )
        if self.mode == "rows":
            return insert + sql.SQL(" ON CONFLICT (partition, entry_id) DO NOTHING")
        updated = sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in names if n != "key"
        )
        newer = sql.SQL(_ORDER.format("{0}") + " < " + _ORDER.format("EXCLUDED")).format(self._identifier)
        return insert + sql.SQL(" ON CONFLICT (key) DO UPDATE SET {} WHERE {}").format(updated, newer)

    def columns(self, records: Sequence[SinkRecord]) -> tuple[list[Any], ...]:
        """The insert's parameters: one list per column.

        An upsert keeps each key's last record: one statement may not update a row twice.
        """
        if self.mode == "upsert":
            records = list({r.key: r for r in records}.values())
        partitions = [r.partition for r in records]
        ids = [r.entry_id for r in records]
        keys = [r.key for r in records]
        values = [_json(r.value) for r in records]
        headers = [_json(r.headers) for r in records]
        if self.mode == "rows":
            return (partitions, ids, keys, values, headers)
        return (keys, partitions, ids, values, headers)

    def record(self, value: Any, ctx: Context) -> SinkRecord:
        if self.mode == "upsert" and not ctx.key:
            raise SinkRefused("the entry has no key: an upsert sink keeps one row per key")
        return super().record(value, ctx)

    def connect(self) -> psycopg.Connection[Any]:
        """A connection; one that cannot be made is a ConfigError naming the masked DSN."""
        try:
            return psycopg.connect(self.dsn, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise SinkUnavailable(
                f"cannot reach PostgreSQL at {mask_dsn(self.dsn)}: {_first_line(exc)}"
            ) from None

    def prepare(self) -> None:
        """Create the sink's tables when missing; refuse a data table with other columns.

        Under a lock held to the end of the transaction: sinks started together would otherwise
        race on CREATE TABLE IF NOT EXISTS (PostgreSQL then refuses all but one).
        """
        with self.connect() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PREPARE_LOCK,))
            conn.execute(_BOOKKEEPING)
            found = self._columns(conn)
            if not found:
                self._create(conn)
            elif found != dict(COLUMNS[self.mode]):
                wanted = ", ".join(f"{n} {t}" for n, t in COLUMNS[self.mode])
                has = ", ".join(f"{n} {t}" for n, t in found.items())
                raise ConfigError(
                    f"table {self.table} exists with other columns: a {self.mode} sink needs "
                    f"({wanted}), it has ({has})"
                )
            self._check_unique(conn)

    def _columns(self, conn: psycopg.Connection[Any]) -> dict[str, str]:
        schema, _, name = self.table.rpartition(".")
        rows = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = %s "
            "AND table_schema = COALESCE(NULLIF(%s, ''), current_schema()) ORDER BY ordinal_position",
            (name, schema),
        ).fetchall()
        return {column: kind for column, kind in rows}

    def _create(self, conn: psycopg.Connection[Any]) -> None:
        columns = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in COLUMNS[self.mode]
        )
        unique = "(partition, entry_id)" if self.mode == "rows" else "(key)"
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY {})").format(
                self._identifier, columns, sql.SQL(unique)
            )
        )
        log.info("created table %s for the %s sink %s", self.table, self.mode, self.name)

    def _check_unique(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a table without the unique key the writes rely on (EXPLAIN plans, writes nothing)."""
        params = self.columns(
            [SinkRecord(topic="", partition=0, entry_id="0-0", key="k", value=None, headers={})]
        )
        try:
            with conn.transaction():
                conn.execute(sql.SQL("EXPLAIN ") + self.insert, params)
        except psycopg.errors.InvalidColumnReference:
            unique = "(partition, entry_id)" if self.mode == "rows" else "(key)"
            raise ConfigError(
                f"table {self.table} has no unique key on {unique}: the sink needs one"
            ) from None

    def partition(self, partition: int) -> SinkPartition:
        return PostgresPartition(self, partition)


class PostgresPartition(SinkPartition):
    """One partition's connection: claims the partition, then commits batches under its generation."""

    def __init__(self, sink: PostgresSink, partition: int) -> None:
        self.sink = sink
        self.partition = partition
        self.generation = 0
        self._conn: psycopg.Connection[Any] | None = None

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction; a lost connection (or a server that is going away) is SinkUnavailable."""
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self.sink.connect()
            with self._conn.transaction(), self._conn.cursor() as cursor:
                yield cursor
        except (psycopg.OperationalError, psycopg.errors.AdminShutdown) as exc:
            self.close()
            raise SinkUnavailable(f"PostgreSQL: {_first_line(exc)}") from None

    def claim(self) -> tuple[dict[tuple[str, str], bytes], dict[str, StreamId]]:
        key = (self.sink.name, self.partition)
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO pspf_sink_owners VALUES (%s, %s, 1) ON CONFLICT (sink, partition) "
                "DO UPDATE SET generation = pspf_sink_owners.generation + 1 RETURNING generation",
                key,
            )
            (self.generation,) = cur.fetchone() or (0,)
            cur.execute(
                "SELECT namespace, key, value FROM pspf_sink_state WHERE sink = %s AND partition = %s", key
            )
            values = {(ns, k): bytes(v) for ns, k, v in cur.fetchall()}
            cur.execute(
                "SELECT topic, ms, seq FROM pspf_sink_checkpoints WHERE sink = %s AND partition = %s", key
            )
            checkpoints = {topic: StreamId(ms, seq) for topic, ms, seq in cur.fetchall()}
        return values, checkpoints

    def commit(
        self, records: Sequence[SinkRecord], updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> None:
        try:
            with self._transaction() as cur:
                self._fence(cur)
                if records:
                    cur.execute(self.sink.insert, self.sink.columns(records))
                self._bookkeeping(cur, updates, checkpoints)
        except _REFUSALS:
            raise RowsRefused(self._refused(records)) from None

    def _fence(self, cur: psycopg.Cursor[Any]) -> None:
        """Lock the partition's owner row; write nothing if another worker claimed it since."""
        cur.execute(
            "SELECT generation FROM pspf_sink_owners WHERE sink = %s AND partition = %s FOR UPDATE",
            (self.sink.name, self.partition),
        )
        found = cur.fetchone()
        if found is None or found[0] != self.generation:
            raise SinkUnavailable(
                f"partition {self.partition} of sink {self.sink.name} was taken over by another "
                "worker: this one writes nothing more"
            )

    def _bookkeeping(
        self, cur: psycopg.Cursor[Any], updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> None:
        key = (self.sink.name, self.partition)
        gone = [(*key, ns, k) for (ns, k), v in updates.items() if v is None]
        kept = [(*key, ns, k, v) for (ns, k), v in updates.items() if v is not None]
        if gone:
            cur.executemany(
                "DELETE FROM pspf_sink_state "
                "WHERE sink = %s AND partition = %s AND namespace = %s AND key = %s",
                gone,
            )
        if kept:
            cur.executemany(
                "INSERT INTO pspf_sink_state VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (sink, partition, namespace, key) DO UPDATE SET value = EXCLUDED.value",
                kept,
            )
        if checkpoints:
            cur.executemany(
                "INSERT INTO pspf_sink_checkpoints VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (sink, partition, topic) DO UPDATE SET ms = EXCLUDED.ms, seq = EXCLUDED.seq",
                [(*key, topic, c.ms, c.seq) for topic, c in checkpoints.items()],
            )

    def _refused(self, records: Sequence[SinkRecord]) -> dict[tuple[str, str], str]:
        """Each record's row alone, in order, in a transaction rolled back: those refused, and why."""
        refused: dict[tuple[str, str], str] = {}
        try:
            with self._transaction() as cur:
                for record in records:
                    try:
                        with cur.connection.transaction():  # a savepoint per row
                            cur.execute(self.sink.insert, self.sink.columns([record]))
                    except _REFUSALS as exc:
                        refused[(record.topic, record.entry_id)] = (
                            f"PostgreSQL refused the row: {_first_line(exc)}"
                        )
                raise _RollBack
        except _RollBack:
            pass
        if not refused:
            raise SinkUnavailable("PostgreSQL refused the batch but no row alone: trying it again")
        return refused

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


class _RollBack(Exception):
    """Leaves a probing transaction without committing it."""


def mask_dsn(dsn: str) -> str:
    """A DSN safe to print: a URL's credentials masked, a key=value string's password hidden."""
    if "://" in dsn:
        return mask_url(dsn)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
