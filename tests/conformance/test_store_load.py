"""``StateStore.load``, a whole restore, on every engine: pages of names as the backup holds them.

A restore hands the store the backup hash's (name, value) pairs unsplit; each engine splits the
names (or not) its own way, so every engine must give back exactly what ``split_field`` says the
names mean, put large values where its reads look for them, leave nothing of the cleared
namespaces, and never let the restore's identity outlive the values loaded before it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pspf.errors import BrokerUnavailable
from pspf.keys import (
    BACKUP_IDENTITY,
    BACKUP_NAMESPACE,
    OUTBOX_NAMESPACE,
    STATE_NAMESPACE,
    STORE_NAMESPACES,
    StreamId,
)
from pspf.state_stores import StateStore, engines, open_store
from pspf.state_stores.base import field, split_field

#: The engines PSPF ships, from the registry (the JSON engine of the tests is not one to load into).
SHIPPED = {name: engine for name, engine in engines().items() if engine.store_class.startswith("pspf.")}
ENGINES = list(SHIPPED)
FILE_ENGINES = [name for name, engine in SHIPPED.items() if engine.suffix is not None]
IDENTITY = (BACKUP_NAMESPACE, BACKUP_IDENTITY)


@pytest.fixture(params=ENGINES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    engine = SHIPPED[request.param]
    s: StateStore = engine.load()() if engine.suffix is None else open_store(engine.name, tmp_path, "g", 0)
    yield s
    s.close()


def _rows(store: StateStore) -> list[tuple[str, str, bytes]]:
    return sorted(store.dump()[1])


def test_load_splits_every_name_as_split_field_does(store: StateStore) -> None:
    names = [
        field(STATE_NAMESPACE, "plain"),
        field(STATE_NAMESPACE, ""),
        field(STATE_NAMESPACE, "a\x00b"),  # a key with NUL in it: split at the first
        field(STATE_NAMESPACE, "clé ünïcødé ✓"),
        field("__failures", "t/1-0"),
        b"no separator",  # not written by PSPF, but split all the same: (name, "")
        field("other", "k"),
    ]
    store.load(STORE_NAMESPACES, {"t": StreamId(9, 1)}, [[(name, b"v" + name) for name in names]])

    assert _rows(store) == sorted((*split_field(name), b"v" + name) for name in names)
    assert store.get(STATE_NAMESPACE, "a\x00b") == b"v" + field(STATE_NAMESPACE, "a\x00b")
    assert dict(store.items(STATE_NAMESPACE, "cl")) == {"clé ünïcødé ✓": b"v" + names[3]}
    assert store.get("no separator", "") == b"vno separator"
    assert store.checkpoints() == {"t": StreamId(9, 1)}


def test_load_clears_first_and_takes_pages_of_any_size_and_order(store: StateStore) -> None:
    with store.transaction() as tx:
        for i in range(50):
            tx.set(STATE_NAMESPACE, f"old{i}", b"old")
            tx.set(OUTBOX_NAMESPACE, f"{i:020}", b"old row")
        tx.set(*IDENTITY, b"3-7")
        tx.set("kept", "x", b"not cleared")
        tx.set_checkpoint("t", StreamId(50, 0))
        tx.set_checkpoint("gone", StreamId(5, 0))
    values = {field(STATE_NAMESPACE, f"k{i:05}"): b"%d" % i for i in range(3_000)}
    values[field(STATE_NAMESPACE, "old7")] = b"new"
    values[field(OUTBOX_NAMESPACE, f"{7:020}")] = b"R" * 10_000  # a large value: its own table in SQLite
    pairs = sorted(values.items(), key=lambda pair: pair[0][::-1])  # an order unlike the keys'
    # Sizes around SQLite's rows per staging statement, and an empty page.
    sizes = [1, 498, 499, 500, 0, 998, 1_001]
    pages, at = [], 0
    for size in sizes:
        pages.append(pairs[at : at + size])
        at += size
    pages.append(pairs[at:])

    store.load(STORE_NAMESPACES, {"t": StreamId(10, 0), "gone": None}, iter(pages))

    assert _rows(store) == sorted(
        [*((*split_field(n), v) for n, v in values.items()), ("kept", "x", b"not cleared")]
    )
    assert store.get(*IDENTITY) is None  # cleared: a restore sets it only once the values are in
    assert store.get(OUTBOX_NAMESPACE, f"{7:020}") == b"R" * 10_000
    assert list(store.items(OUTBOX_NAMESPACE)) == [(f"{7:020}", b"R" * 10_000)]
    assert store.get(OUTBOX_NAMESPACE, f"{8:020}") is None and store.get(STATE_NAMESPACE, "old8") is None
    assert store.get_many(STATE_NAMESPACE, ["old7", "k00042", "nope"]) == {"old7": b"new", "k00042": b"42"}
    assert store.checkpoints() == {"t": StreamId(10, 0)}
    # The store takes batches as before: a value set, one deleted, both tables.
    with store.transaction() as tx:
        tx.set(STATE_NAMESPACE, "k00001", b"after")
        tx.delete(OUTBOX_NAMESPACE, f"{7:020}")
    assert store.get(STATE_NAMESPACE, "k00001") == b"after"
    assert list(store.items(OUTBOX_NAMESPACE)) == []


def test_a_name_that_comes_twice_keeps_one_of_its_values(store: StateStore) -> None:
    """A scan of a hash that changes meanwhile may yield a field twice (the log sets it after)."""
    name = field(STATE_NAMESPACE, "twice")
    store.load(STORE_NAMESPACES, {}, [[(name, b"1"), (field(STATE_NAMESPACE, "a"), b"a")], [(name, b"2")]])
    assert store.get(STATE_NAMESPACE, "twice") in (b"1", b"2")
    assert [key for key, _ in store.items(STATE_NAMESPACE)] == ["a", "twice"]


def test_a_load_whose_pages_fail_raises_their_error_and_sets_no_identity(store: StateStore) -> None:
    """The reader's error (a lost connection) reaches the caller as it is, not as a store error."""
    with store.transaction() as tx:
        tx.set(*IDENTITY, b"3-7")

    def pages() -> Iterator[list[tuple[bytes, bytes]]]:
        yield [(field(STATE_NAMESPACE, "first"), b"1")]
        raise BrokerUnavailable("cannot reach Redis")

    with pytest.raises(BrokerUnavailable):
        store.load(STORE_NAMESPACES, {}, pages())
    assert store.get(*IDENTITY) is None
    # The store goes on: the next restore loads it whole.
    store.load(STORE_NAMESPACES, {}, [[(field(STATE_NAMESPACE, "k"), b"v")]])
    assert _rows(store) == [(STATE_NAMESPACE, "k", b"v")]


_LOAD_THEN_DIE = """
import os, sys
from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, STORE_NAMESPACES
from pspf.state_stores import open_store
from pspf.state_stores.base import field
store = open_store(sys.argv[1], sys.argv[2], "g", 0)
page = [(field("state", f"k{i}"), b"%d" % i) for i in range(2_000)]
store.load(STORE_NAMESPACES, {}, [page])
store.write({(BACKUP_NAMESPACE, BACKUP_IDENTITY): b"5-1"}, {})
os._exit(0)  # killed: no close, nothing flushed on the way out
"""


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_the_identity_written_after_a_load_never_survives_a_kill_without_the_values(
    engine: str, tmp_path: Path
) -> None:
    """Cleared first, identity last: an engine that loads unlogged must make the values durable
    before the write that follows (RocksDB flushes its memtables)."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_THEN_DIE, engine, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    with open_store(engine, tmp_path, "g", 0) as store:
        assert store.get(*IDENTITY) == b"5-1"
        assert len(list(store.items(STATE_NAMESPACE))) == 2_000
        assert store.get(STATE_NAMESPACE, "k1999") == b"1999"


def _rocksdb_options(store: StateStore) -> dict[str, str]:
    """The options RocksDB runs with now: its newest OPTIONS file (written by every change)."""
    assert store.path is not None
    newest = max(store.path.glob("OPTIONS-*"), key=lambda file: int(file.name.split("-")[1]))
    pairs = (line.strip().partition("=") for line in newest.read_text().splitlines())
    return {
        name: value for name, _, value in pairs if name in ("write_buffer_size", "disable_auto_compactions")
    }


def test_rocksdb_runs_as_before_after_a_load_with_its_level0_compacted(tmp_path: Path) -> None:
    """The bulk load's settings (small memtables, no compaction) last only while it loads, also
    when its pages fail: a store left without compaction would pile up level-0 files for ever."""
    running = {"write_buffer_size": str(64 << 20), "disable_auto_compactions": "false"}
    with open_store("rocksdb", tmp_path, "g", 0) as store:
        assert _rocksdb_options(store) == running
        # About eight 8 MB memtables: more level-0 files than RocksDB's own compactions leave.
        pages = [
            [(field(STATE_NAMESPACE, f"k{p}-{i}"), b"%0100d" % i) for i in range(5_000)] for p in range(100)
        ]
        store.load(STORE_NAMESPACES, {}, pages)
        assert _rocksdb_options(store) == running
        assert store._db.property_int_value("rocksdb.num-files-at-level0") == 0  # type: ignore[attr-defined]

        def failing() -> Iterator[list[tuple[bytes, bytes]]]:
            yield pages[0]
            raise BrokerUnavailable("cannot reach Redis")

        with pytest.raises(BrokerUnavailable):
            store.load(STORE_NAMESPACES, {}, failing())
        assert _rocksdb_options(store) == running
