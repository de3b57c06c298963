"""State store engines behind one interface; ``open_store`` picks one by name.

The engines are listed in ``registry`` (one ``register_engine`` line each); a new engine is one
module here plus its line there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pspf.errors import ConfigError, NotFound, StoreLocked
from pspf.state_stores.base import Durability, StateStore, StoreTransaction, TxStatus
from pspf.state_stores.memory import MemoryStore
from pspf.state_stores.registry import Engine, engines, file_engine, file_engines, register_engine
from pspf.state_stores.sqlite import SQLiteStore

__all__ = [
    "Durability",
    "Engine",
    "MemoryStore",
    "SQLiteStore",
    "StateStore",
    "StoreTransaction",
    "TxStatus",
    "engines",
    "file_engines",
    "missing_state",
    "open_globals_readonly",
    "open_globals_store",
    "open_store",
    "register_engine",
    "stored_globals",
    "stored_partitions",
]

#: Worker processes that may share a state dir, each with its own store of the global tables.
GLOBALS_SLOTS = 64


def store_path(directory: Path, engine: str, group: str, partition: int) -> Path:
    """Where the store of (group, partition) lives under the state directory."""
    return Path(directory) / group / f"p{partition}{_suffix(engine)}"


def _suffix(engine: str) -> str:
    suffix = file_engine(engine).suffix
    assert suffix is not None  # file_engine() names only engines with files
    return suffix


def open_store(
    engine: str,
    directory: Path | str,
    group: str,
    partition: int,
    durability: Durability = "normal",
    readonly: bool = False,
) -> StateStore:
    """Open the store of (group, partition); ``readonly`` opens without taking the lock.

    Raises:
        NotFound: ``readonly`` was asked and the store does not exist.
        StoreLocked: another process has the store open for writing.
        StateError: the files cannot be created or opened.
    """
    path = store_path(Path(directory), engine, group, partition)
    if readonly and not path.exists():
        raise NotFound(missing_state(engine, directory, group, partition))
    return _open(engine, path, durability, readonly)


def open_globals_store(
    engine: str, directory: Path | str, group: str, durability: Durability = "normal"
) -> StateStore:
    """A worker's store of the app's global tables: the first one no other worker holds open.

    Workers sharing a state dir take one each; a restarted worker finds its rows again.
    """
    for slot in range(GLOBALS_SLOTS):
        path = _globals_path(directory, engine, group, slot)
        try:
            return _open(engine, path, durability, readonly=False)
        except StoreLocked:
            continue
    raise ConfigError(f"{GLOBALS_SLOTS} workers of app {group!r} hold global table stores under {directory}")


def _globals_path(directory: Path | str, engine: str, group: str, slot: int) -> Path:
    """Where the global table store of one worker slot of ``group`` lives under the state directory."""
    return store_path(Path(directory), engine, group, 0).with_name(f"globals-{slot}{_suffix(engine)}")


def stored_globals(engine: str, directory: Path | str, group: str) -> list[Path]:
    """The global table stores of ``group`` under ``directory``, one per worker slot, by slot."""
    found = [_globals_path(directory, engine, group, slot) for slot in range(GLOBALS_SLOTS)]
    return [path for path in found if path.exists()]


def open_globals_readonly(engine: str, path: Path) -> StateStore:
    """A worker's global table store (a ``stored_globals`` path), opened without taking its lock.

    Raises:
        NotFound: it holds nothing yet (its worker is creating it).
    """
    return _open(engine, path, "normal", readonly=True)


def _open(engine: str, path: Path, durability: Durability, readonly: bool) -> StateStore:
    store_class: Any = file_engine(engine).load()  # a file engine's class takes (path, durability, readonly)
    store: StateStore = store_class(path, durability=durability, readonly=readonly)
    return store


def stored_partitions(engine: str, directory: Path | str, group: str) -> list[int]:
    """The partitions of ``group`` that have a store under ``directory``."""
    folder = Path(directory) / group
    found_engine = engines().get(engine)
    suffix = (found_engine.suffix if found_engine else None) or ""
    if not folder.is_dir():
        return []
    found = [p.name[1 : -len(suffix)] for p in folder.glob(f"p*{suffix}")]
    return sorted(int(n) for n in found if n.isdigit())


def missing_state(engine: str, directory: Path | str, group: str, partition: int | None = None) -> str:
    """Why no ``engine`` state of ``group`` (or of one partition) was found under ``directory``.

    Names a store of another engine found there: a directory written with ``--store rocksdb``
    and read without it looks empty otherwise.
    """
    which = "" if partition is None else f" partition {partition}"
    text = f"no {engine} state for app {group!r}{which} under {directory}"
    others = [
        other
        for other in file_engines()
        if other != engine
        and (
            stored_partitions(other, directory, group)
            if partition is None
            else store_path(Path(directory), other, group, partition).exists()
        )
    ]
    if others:
        text += f"; a {others[0]} store is there: add --store {others[0]}"
    return text
