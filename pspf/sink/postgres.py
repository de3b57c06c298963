"""The PostgreSQL sink: a topic into a table, each entry's row once (psycopg 3).

Two modes. ``rows``: one row per entry, unique by (partition, entry_id); a row written again
is skipped (``ON CONFLICT DO NOTHING``). ``upsert``: one row per key holding the value of its
latest entry; an older entry never overwrites a newer one (the row keeps the entry id it came
from and is replaced only by a later id), so a replay, a redrive or a late writer changes nothing.

Beside the table, four tables of its own, shared by every sink of the database and keyed by the
sink's name (and partition): ``pspf_sink_owners`` (a generation per partition: ``claim`` raises it,
each commit locks the row and writes only while it is still its own, so a worker that was taken
over writes nothing), ``pspf_sink_state`` (the processor's bookkeeping: attempts, dead entries,
the consumers that applied entries), ``pspf_sink_checkpoints`` and ``pspf_sink_targets`` (the
table the checkpoints describe: its name, oid and relfilenode). A batch's rows, bookkeeping and
checkpoints are one transaction: the checkpoint is written with the data it covers.

The table's identity is checked at start and in each commit, under a lock that a DROP or a
TRUNCATE waits for: a dropped, replaced or truncated table (each changes the oid or the
relfilenode) no longer holds what the checkpoints say was delivered, so the sink refuses it
(``SinkTargetChanged``) until ``pspf sink reset`` (``forget``) starts it afresh.

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
from pspf.errors import (
    ConfigError,
    ParameterError,
    SinkDatabaseRefused,
    SinkTargetChanged,
    SinkUnavailable,
    StateError,
)
from pspf.keys import StreamId, check_name
from pspf.settings import mask_url
from pspf.sink.base import RowsRefused, SinkPartition, SinkRecord, SinkRefused, TransactionalSink, Updates

try:
    import psycopg
    from psycopg import sql
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the PostgreSQL sink needs psycopg 3: pip install 'pspf[postgres]'") from exc

log = logging.getLogger("pspf.sink_postgres")

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
CREATE TABLE IF NOT EXISTS pspf_sink_targets (
    sink text PRIMARY KEY, table_name text NOT NULL, table_oid oid NOT NULL, relfilenode oid NOT NULL);
"""

#: words of a refused connection that a wait can change (the server starting, stopping, full)
_PASSING = ("starting up", "shutting down", "not yet accepting", "in recovery", "too many clients")

#: the advisory lock that ``prepare`` holds while it creates tables
_PREPARE_LOCK = 0x70737066_73696E6B  # "pspfsink"

#: an entry id as a comparable pair, in SQL
_ORDER = "(split_part({0}.entry_id, '-', 1)::bigint, split_part({0}.entry_id, '-', 2)::bigint)"

#: errors that belong to the rows (SQLSTATE classes 22, data, and 23, constraints)
_REFUSALS = (psycopg.errors.DataError, psycopg.errors.IntegrityError)


class PostgresSink(TransactionalSink):
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
        #: the table's (oid, relfilenode) as ``prepare`` found and recorded it
        self.target = (0, 0)

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
        """A connection to the sink's database (``connect``)."""
        return connect(self.dsn)

    def prepare(self) -> None:
        """Create the sink's tables when missing; refuse a data table with other columns.

        Under a lock held to the end of the transaction: sinks started together would otherwise
        race on CREATE TABLE IF NOT EXISTS (PostgreSQL then refuses all but one). A table that
        is not the one the sink's checkpoints describe is refused, never created again.
        """
        with self.connect() as conn, _translated(self.table):
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PREPARE_LOCK,))
            conn.execute(_BOOKKEEPING)
            recorded = conn.execute(
                "SELECT table_name, table_oid, relfilenode FROM pspf_sink_targets WHERE sink = %s",
                (self.name,),
            ).fetchone()
            found = self._columns(conn)
            if not found:
                if recorded is not None or self._delivered(conn):
                    raise self.changed("it was dropped" if recorded is None else self._other(recorded[0]))
                self._create(conn)
            elif found != dict(COLUMNS[self.mode]):
                wanted = ", ".join(f"{n} {t}" for n, t in COLUMNS[self.mode])
                has = ", ".join(f"{n} {t}" for n, t in found.items())
                raise ConfigError(
                    f"table {self.table} exists with other columns: a {self.mode} sink needs "
                    f"({wanted}), it has ({has})"
                )
            self._check_unique(conn)
            self._record_target(conn, recorded)

    def _record_target(self, conn: psycopg.Connection[Any], recorded: tuple[Any, ...] | None) -> None:
        """Record the table's identity for a sink without one; refuse a table other than its own."""
        oid, relfilenode = self._identity(conn)
        if recorded is None:
            self.target = (oid, relfilenode)
            conn.execute(
                "INSERT INTO pspf_sink_targets VALUES (%s, %s, %s, %s)", (self.name, self.table, *self.target)
            )
            return
        self.target = (int(recorded[1]), int(recorded[2]))
        if oid != self.target[0]:
            raise self.changed(self._other(recorded[0]))
        self.check_target(relfilenode)

    def _other(self, recorded: str) -> str:
        """What happened to a table whose oid is not the recorded one."""
        if recorded != self.table:
            return f"its checkpoints are of table {recorded}"
        return "it was dropped and created again"

    def _delivered(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the sink has checkpoints (it delivered something; from before targets were kept)."""
        found = conn.execute("SELECT 1 FROM pspf_sink_checkpoints WHERE sink = %s LIMIT 1", (self.name,))
        return found.fetchone() is not None

    def _identity(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        """The table's oid and relfilenode: a DROP changes the first, a TRUNCATE the second."""
        found = conn.execute(
            "SELECT oid, relfilenode FROM pg_class WHERE oid = %s::regclass",
            (self._identifier.as_string(conn),),
        ).fetchone()
        assert found is not None  # the cast raised UndefinedTable otherwise
        return int(found[0]), int(found[1])

    def lock_target(self, cur: psycopg.Cursor[Any]) -> None:
        """In a commit's transaction: lock the table (by name) against a DROP and a TRUNCATE.

        A table that is gone raises UndefinedTable, which ``PostgresPartition.commit`` reports.
        """
        cur.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(self._identifier))

    def check_target(self, relfilenode: int | None) -> None:
        """Refuse the locked table unless its oid still has the recorded relfilenode."""
        if relfilenode is None:
            raise self.changed("it was dropped and created again")
        if relfilenode != self.target[1]:
            raise self.changed("it was truncated or rewritten: TRUNCATE, VACUUM FULL, CLUSTER")

    def changed(self, what: str) -> SinkTargetChanged:
        """The refusal of a table the checkpoints do not describe, saying what to do."""
        return SinkTargetChanged(
            f"table {self.table} is not the one sink {self.name} delivered into ({what}): its "
            "checkpoints would skip the entries delivered before. Deliver the topic again from its "
            f"first entry with `pspf sink reset {self.name} --dsn DSN`, or into this table under "
            "a new --name"
        )

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

    def describe(self) -> str:
        return f"PostgreSQL table {self.table}"


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
                self.sink.lock_target(cur)
                self._fence(cur)
                if records:
                    cur.execute(self.sink.insert, self.sink.columns(records))
                self._bookkeeping(cur, updates, checkpoints)
        except psycopg.errors.UndefinedTable:
            raise self.sink.changed("it was dropped") from None
        except _REFUSALS:
            raise RowsRefused(self._refused(records)) from None
        except psycopg.Error as exc:
            raise StateError(
                f"PostgreSQL refused the commit of sink {self.sink.name}: {_first_line(exc)}"
            ) from None

    def _fence(self, cur: psycopg.Cursor[Any]) -> None:
        """Lock the partition's owner row; write nothing if another worker claimed it since.

        Also checks the table locked before: a DROP or TRUNCATE committed since the last commit
        changed its identity; one that comes later waits for this transaction.
        """
        cur.execute(
            "SELECT generation, (SELECT relfilenode FROM pg_class WHERE oid = %s) FROM pspf_sink_owners "
            "WHERE sink = %s AND partition = %s FOR UPDATE OF pspf_sink_owners",
            (self.sink.target[0], self.sink.name, self.partition),
        )
        found = cur.fetchone()
        if found is None or found[0] != self.generation:
            raise SinkUnavailable(
                f"partition {self.partition} of sink {self.sink.name} was taken over by another "
                "worker: this one writes nothing more"
            )
        self.sink.check_target(None if found[1] is None else int(found[1]))

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


def connect(dsn: str) -> psycopg.Connection[Any]:
    """A connection.

    Raises:
        ParameterError: the DSN is not one.
        SinkUnavailable: the database cannot be reached now (a wait may change that).
        SinkDatabaseRefused: the database refused the login, or does not exist.
    """
    try:
        return psycopg.connect(dsn, connect_timeout=10)
    except psycopg.ProgrammingError as exc:
        # libpq quotes the DSN's words, which may be a password's
        why = "" if "password" in dsn.lower() else f": {_first_line(exc)}"
        raise ParameterError.invalid("dsn", f"not a PostgreSQL DSN or URL{why}") from None
    except psycopg.OperationalError as exc:
        message = f"PostgreSQL at {mask_dsn(dsn)}: {_first_line(exc)}"
        if "FATAL:" in str(exc) and not any(words in str(exc) for words in _PASSING):
            raise SinkDatabaseRefused(f"{message} (refused)") from None
        raise SinkUnavailable(f"cannot reach {message}") from None


def forget(dsn: str, name: str, keep_checkpoints: bool = False) -> int:
    """Delete what sink ``name`` keeps in the database at ``dsn``, in one transaction.

    Its checkpoints, its bookkeeping and the record of its table go, and its partitions' owner
    generations rise (a worker still running writes nothing more): its next start delivers from
    wherever its groups are. With ``keep_checkpoints`` only the table record goes: the next start
    records the table as it is then (after a VACUUM FULL or a CLUSTER, which keep the rows).
    The partitions whose checkpoints were deleted.
    """
    check_name("sink name", name)
    with connect(dsn) as conn, _translated(name):
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PREPARE_LOCK,))
        conn.execute(_BOOKKEEPING)
        conn.execute("DELETE FROM pspf_sink_targets WHERE sink = %s", (name,))
        if keep_checkpoints:
            return 0
        conn.execute("UPDATE pspf_sink_owners SET generation = generation + 1 WHERE sink = %s", (name,))
        conn.execute("DELETE FROM pspf_sink_state WHERE sink = %s", (name,))
        deleted = conn.execute(
            "DELETE FROM pspf_sink_checkpoints WHERE sink = %s RETURNING partition", (name,)
        ).fetchall()
        return len({partition for (partition,) in deleted})


@contextmanager
def _translated(table: str) -> Iterator[None]:
    """PostgreSQL's refusals of what ``prepare`` (or ``forget``) does as one-line errors."""
    try:
        yield
    except psycopg.errors.InvalidSchemaName as exc:
        schema = table.rpartition(".")[0]
        raise ParameterError.invalid(
            "table", f"{_first_line(exc)}: create it first (CREATE SCHEMA {schema}) or name another"
        ) from None
    except psycopg.OperationalError as exc:
        raise SinkUnavailable(f"PostgreSQL: {_first_line(exc)}") from None
    except psycopg.Error as exc:
        raise StateError(f"PostgreSQL refused to prepare {table}: {_first_line(exc)}") from None


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
