"""SQLite engine: one WAL database file per (group, partition), one transaction per batch.

Values live in a WITHOUT ROWID table ordered by (namespace, key): small values (a key's state)
sit in the B-tree's pages themselves. Namespaces of large values (``keys.LARGE_VALUE_NAMESPACES``,
a batch's outbox rows) have a table of their own with rowids, whose values overflow into pages of
their own: in the WITHOUT ROWID table each commit of one got slower as the table grew.

``normal`` durability (WAL, synchronous=NORMAL) survives a killed process: a committed
transaction is in the WAL file before ``COMMIT`` returns. ``fsync`` (synchronous=FULL) also
survives power loss. An exclusive lock file keeps a second process out while the store is open.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import sqlite3
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from pspf.errors import NotFound, StateError, StoreLocked
from pspf.keys import LARGE_VALUE_NAMESPACES, StreamId
from pspf.state_stores.base import Durability, Pages, StateStore, apply_checkpoints

_SCHEMA = """
BEGIN;
CREATE TABLE IF NOT EXISTS state (
    ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS large (
    ns TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ns, key)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    topic TEXT PRIMARY KEY, ms INTEGER NOT NULL, seq INTEGER NOT NULL
);
COMMIT;
"""
_MANY_CHUNK = 500
# 256 rows of 3 parameters stay under the 999 parameters older SQLite builds allow.
_ROWS_PER_INSERT = 256
_MULTI_INSERT = "INSERT OR REPLACE INTO state (ns, key, value) VALUES " + ",".join(
    ["(?, ?, ?)"] * _ROWS_PER_INSERT
)
_TABLES = ("state", "large")
# A restore's staging rows per statement: 2 parameters each, under the 999 of older builds.
_STAGE_ROWS = 499
_STAGE = "INSERT INTO staging (name, value) VALUES " + ",".join(["(?, ?)"] * _STAGE_ROWS)
# Staged names split into (namespace, key) as ``base.split_field`` does, in SQL. Keys compare
# as their bytes (BINARY), so ordering by the name orders by (namespace, key).
_SPLIT = """
SELECT CAST(CASE WHEN at THEN substr(name, 1, at - 1) ELSE name END AS TEXT) AS ns,
       CAST(CASE WHEN at THEN substr(name, at + 1) ELSE x'' END AS TEXT) AS key,
       value, name
FROM (SELECT name, instr(name, x'00') AS at, value FROM staging)
"""


def _to_row(entry_id: StreamId) -> tuple[int, int]:
    """(ms, seq) as SQLite's signed 64-bit integers: seq may use all 64 bits unsigned."""
    return entry_id.ms, entry_id.seq - 2**64 if entry_id.seq >= 2**63 else entry_id.seq


def _from_row(ms: int, seq: int) -> StreamId:
    return StreamId(ms, seq + 2**64 if seq < 0 else seq)


class SQLiteStore(StateStore):
    """State of one (group, partition) in one SQLite file."""

    def __init__(self, path: Path, durability: Durability = "normal", readonly: bool = False) -> None:
        self.path = path
        self._lock_fd: int | None = None
        try:
            if readonly:
                self._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
                if not self._has_schema():
                    # A worker is creating this store right now: it holds no state yet.
                    self._db.close()
                    raise NotFound(f"state store {path} holds no state yet")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._lock_fd = _lock(path.with_suffix(".lock"))
                self._db = sqlite3.connect(path, isolation_level=None)
                sync = "FULL" if durability == "fsync" else "NORMAL"
                self._db.execute(f"PRAGMA synchronous={sync}")  # first: the switch to WAL obeys it
                self._db.execute("PRAGMA journal_mode=WAL")
                if self._tables() < set(_TABLES) | {"checkpoints"}:  # a write only where one is missing
                    self._db.executescript(_SCHEMA)
                self._remember_identity()
            #: where large values are: in a store an older version made (read only), with the rest
            self._large = "large" if self._has_table("large") else "state"
            self._checkpoints = {
                topic: _from_row(ms, seq)
                for topic, ms, seq in self._db.execute("SELECT topic, ms, seq FROM checkpoints")
            }
        except (sqlite3.Error, OSError) as exc:
            self._unlock()
            raise StateError(f"cannot open state store {path}: {exc}") from exc

    def _table(self, namespace: str) -> str:
        return self._large if namespace in LARGE_VALUE_NAMESPACES else "state"

    def _has_schema(self) -> bool:
        return self._has_table("checkpoints")

    def _has_table(self, name: str) -> bool:
        return name in self._tables()

    def _tables(self) -> set[str]:
        return {name for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Name the store in a failed read: damage is the store's fault, not the caller's."""
        try:
            yield
        except sqlite3.Error as exc:
            raise StateError(f"cannot read state store {self.path}: {exc}") from exc

    def get(self, namespace: str, key: str) -> bytes | None:
        with self._reading():
            row = self._db.execute(
                f"SELECT value FROM {self._table(namespace)} WHERE ns = ? AND key = ?", (namespace, key)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def get_many(self, namespace: str, keys: Iterable[str]) -> dict[str, bytes]:
        wanted = list(keys)
        found: dict[str, bytes] = {}
        for start in range(0, len(wanted), _MANY_CHUNK):
            chunk = wanted[start : start + _MANY_CHUNK]
            marks = ",".join("?" * len(chunk))
            with self._reading():
                found.update(
                    self._db.execute(
                        f"SELECT key, value FROM {self._table(namespace)} WHERE ns = ? AND key IN ({marks})",
                        (namespace, *chunk),
                    )
                )
        return found

    def items(self, namespace: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        with self._reading():
            table = self._table(namespace)
            cursor = self._db.execute(
                f"SELECT key, value FROM {table} WHERE ns = ? AND substr(key, 1, ?) = ? ORDER BY key",
                (namespace, len(prefix), prefix),
            )
            for key, value in cursor:
                yield key, bytes(value)

    def checkpoints(self) -> dict[str, StreamId]:
        return dict(self._checkpoints)

    def write(
        self,
        updates: Mapping[tuple[str, str], bytes | None],
        checkpoints: Mapping[str, StreamId],
    ) -> None:
        # Values as bytearrays, bound as they are (see ``_stage``).
        rows = [(ns, key, bytearray(value)) for (ns, key), value in updates.items() if value is not None]
        with self._atomic("commit") as db:
            _upsert(db, rows)
            gone = [nk for nk, value in updates.items() if value is None] if len(rows) < len(updates) else []
            for table in _TABLES if gone else ():  # deletes are rare: most batches skip them
                db.executemany(
                    f"DELETE FROM {table} WHERE ns = ? AND key = ?",
                    [nk for nk in gone if self._table(nk[0]) == table],
                )
            db.executemany(
                "INSERT OR REPLACE INTO checkpoints (topic, ms, seq) VALUES (?, ?, ?)",
                [(topic, *_to_row(cid)) for topic, cid in checkpoints.items()],
            )
        self._checkpoints.update(checkpoints)

    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        with self._atomic("rewind") as db:
            for table in _TABLES:
                db.executemany(
                    f"DELETE FROM {table} WHERE ns = ?", [(ns,) for ns in clear if self._table(ns) == table]
                )
            _upsert(db, [(ns, key, value) for (ns, key), value in (values or {}).items()])
            gone = [(topic,) for topic, cid in checkpoints.items() if cid is None]
            db.executemany("DELETE FROM checkpoints WHERE topic = ?", gone)
            db.executemany(
                "INSERT OR REPLACE INTO checkpoints (topic, ms, seq) VALUES (?, ?, ?)",
                [(t, *_to_row(cid)) for t, cid in checkpoints.items() if cid is not None],
            )
        apply_checkpoints(self._checkpoints, checkpoints)

    def load(self, clear: Collection[str], checkpoints: Mapping[str, StreamId | None], pages: Pages) -> None:
        """One transaction; the pages are staged as they come and copied in key order.

        Rows inserted in the order a Redis hash yields them land all over the B-tree: at a
        million keys that is ten times slower than one sorted copy. The names are staged whole,
        hundreds of rows to a statement, and split by SQL in the copy: splitting them in Python
        and one statement per row took about half of a restore's time.
        """
        self.rewind(clear, checkpoints)
        with self._atomic("restore") as db:
            db.execute("CREATE TEMP TABLE IF NOT EXISTS staging (name BLOB, value BLOB)")
            db.execute("DELETE FROM staging")
            for page in pages:
                _stage(db, page)
            db.execute(f"INSERT OR REPLACE INTO state SELECT ns, key, value FROM ({_SPLIT}) ORDER BY name")
            db.execute("DELETE FROM staging")
            # Large values go to their own table (see ``_table``): a range of the primary key each.
            marks = ",".join("?" * len(LARGE_VALUE_NAMESPACES))
            large = tuple(LARGE_VALUE_NAMESPACES)
            db.execute(f"INSERT OR REPLACE INTO large SELECT * FROM state WHERE ns IN ({marks})", large)
            db.execute(f"DELETE FROM state WHERE ns IN ({marks})", large)

    @contextmanager
    def _atomic(self, what: str) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends, rolled back when it raises."""
        db = self._db
        try:
            db.execute("BEGIN")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                # SQLite may have rolled back already (a full disk does): then ROLLBACK fails,
                # and its error must not hide the cause.
                with suppress(sqlite3.Error):
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StateError(f"cannot {what} state store {self.path}: {exc}") from exc

    def dump(self) -> tuple[dict[str, StreamId], Iterator[tuple[str, str, bytes]]]:
        db = self._db
        db.execute("BEGIN")  # one read transaction: a snapshot even while a worker commits
        try:
            checkpoints = {
                topic: _from_row(ms, seq)
                for topic, ms, seq in db.execute("SELECT topic, ms, seq FROM checkpoints")
            }
        except BaseException:
            db.execute("COMMIT")
            raise

        def rows() -> Iterator[tuple[str, str, bytes]]:
            try:
                every = "SELECT ns, key, value FROM state"
                if self._large == "large":
                    every += " UNION ALL SELECT ns, key, value FROM large"
                for namespace, key, value in db.execute(f"SELECT * FROM ({every}) ORDER BY ns, key"):
                    yield namespace, key, bytes(value)
            finally:
                db.execute("COMMIT")

        return checkpoints, rows()

    def integrity_check(self) -> str:
        """SQLite's own verdict on the file: ``ok`` when it is sound."""
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])

    def close(self) -> None:
        try:
            self._db.close()
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _upsert(db: sqlite3.Connection, rows: Sequence[tuple[str, str, bytes | bytearray]]) -> None:
    """Write rows with multi-row statements: per-statement overhead dominates one-row inserts."""
    large = [row for row in rows if row[0] in LARGE_VALUE_NAMESPACES]
    if large:
        rows = [row for row in rows if row[0] not in LARGE_VALUE_NAMESPACES]
    whole = len(rows) - len(rows) % _ROWS_PER_INSERT
    if whole:
        db.executemany(
            _MULTI_INSERT,
            [
                list(itertools.chain.from_iterable(rows[start : start + _ROWS_PER_INSERT]))
                for start in range(0, whole, _ROWS_PER_INSERT)
            ],
        )
    db.executemany("INSERT OR REPLACE INTO state (ns, key, value) VALUES (?, ?, ?)", rows[whole:])
    db.executemany("INSERT OR REPLACE INTO large (ns, key, value) VALUES (?, ?, ?)", large)


def _stage(db: sqlite3.Connection, page: Sequence[tuple[bytes, bytes]]) -> None:
    """Stage a page of (name, value) rows, ``_STAGE_ROWS`` to a statement.

    As bytearrays: sqlite3 binds those as they are, but looks for an adapter of every bytes
    first, which took half of the staging's time.
    """
    flat = list(map(bytearray, itertools.chain.from_iterable(page)))
    step = 2 * _STAGE_ROWS
    whole = len(flat) - len(flat) % step
    db.executemany(_STAGE, (flat[start : start + step] for start in range(0, whole, step)))
    rest = iter(flat[whole:])
    db.executemany("INSERT INTO staging (name, value) VALUES (?, ?)", zip(rest, rest, strict=False))


def _lock(path: Path) -> int:
    """Take an exclusive lock that the kernel drops when the process dies, or raise StoreLocked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLocked(
            f"state store {path.with_suffix('.sqlite')} is in use by process {holder}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
