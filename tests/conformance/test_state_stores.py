"""One suite over every state store engine: the same behaviour from memory and SQLite."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from pspf.codec import StateDecoder
from pspf.errors import CheckpointRegression, StateError, StoreLocked
from pspf.keys import StreamId
from state_stores import MemoryStore, StateStore, TxStatus, open_store

ENGINES = ["memory", "sqlite", "rocksdb"]
FILE_ENGINES = ["sqlite", "rocksdb"]


def _open(engine: str, directory: Path) -> StateStore:
    if engine == "memory":
        return MemoryStore()
    return open_store(engine, directory, "g", 0)


@pytest.fixture(params=ENGINES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    s = _open(request.param, tmp_path)
    yield s
    s.close()


def test_get_set_delete(store: StateStore) -> None:
    with store.transaction() as tx:
        tx.set("ns", "a", b"1")
        tx.set("ns", "b", b"2")
    assert store.get("ns", "a") == b"1"
    assert store.get("other", "a") is None
    with store.transaction() as tx:
        tx.delete("ns", "a")
        tx.set("ns", "b", b"3")
    assert store.get("ns", "a") is None
    assert store.get_many("ns", ["a", "b", "c"]) == {"b": b"3"}


def test_read_your_own_writes_before_commit(store: StateStore) -> None:
    tx = store.transaction()
    tx.set("ns", "k", b"v")
    assert tx.get("ns", "k") == b"v"
    assert store.get("ns", "k") is None  # not visible outside until commit
    tx.delete("ns", "k")
    assert tx.get("ns", "k") is None
    tx.commit()
    assert tx.status is TxStatus.COMMITTED


def test_a_failed_batch_leaves_nothing(store: StateStore) -> None:
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.set("ns", "k", b"v")
        tx.set_checkpoint("t", StreamId(5, 0))
        raise RuntimeError("handler blew up")
    assert tx.status is TxStatus.ROLLED_BACK
    assert store.get("ns", "k") is None
    assert store.checkpoints() == {}
    with pytest.raises(StateError, match="rolled back"):
        tx.set("ns", "k", b"v")


def test_checkpoint_commits_with_the_data_and_never_moves_back(store: StateStore) -> None:
    with store.transaction() as tx:
        tx.set("ns", "k", b"v")
        tx.set_checkpoint("t", StreamId(10, 2))
    assert store.checkpoints() == {"t": StreamId(10, 2)}
    tx = store.transaction()
    with pytest.raises(CheckpointRegression, match="would move back"):
        tx.set_checkpoint("t", StreamId(9, 99))
    tx.set_checkpoint("t", StreamId(10, 10))  # (10,10) > (10,2) although "10-10" < "10-2"
    tx.commit()
    assert store.checkpoints()["t"] == StreamId(10, 10)


def test_rewind_clears_namespaces_and_moves_checkpoints_back(store: StateStore) -> None:
    with store.transaction() as tx:
        for i in range(300):
            tx.set("state", f"k{i}", b"v")
            tx.set("failures", f"t/{i}-0", b"f")
        tx.set("other", "keep", b"x")
        tx.set_checkpoint("a", StreamId(50, 1))
        tx.set_checkpoint("b", StreamId(60, 0))
        tx.set_checkpoint("c", StreamId(70, 0))

    store.rewind({"state", "failures"}, {"a": None, "b": StreamId(10, 5)})

    assert list(store.items("state")) == []
    assert list(store.items("failures")) == []
    assert store.get("other", "keep") == b"x"
    assert store.checkpoints() == {"b": StreamId(10, 5), "c": StreamId(70, 0)}
    # The next batch goes on from the rewound checkpoint.
    with store.transaction() as tx:
        tx.set_checkpoint("b", StreamId(11, 0))
    assert store.checkpoints()["b"] == StreamId(11, 0)


def test_rewind_sets_values_after_clearing_in_the_same_write(store: StateStore) -> None:
    """A replay's marks go into a namespace the same rewind clears: the new ones stay, old go."""
    with store.transaction() as tx:
        tx.set("marks", "t/1-0", b"old")
        tx.set("marks", "t/2-0", b"old")
        tx.set("state", "k", b"v")
        tx.set_checkpoint("t", StreamId(9, 0))

    values = {("marks", "t/2-0"): b"new", ("marks", "t/3-0"): b"new", ("other", "x"): b"1"}
    store.rewind({"marks", "state"}, {"t": None}, values)

    assert list(store.items("marks")) == [("t/2-0", b"new"), ("t/3-0", b"new")]
    assert store.get("other", "x") == b"1"
    assert list(store.items("state")) == []
    assert store.checkpoints() == {}
    store.rewind({"other"}, {})  # without values: only clears
    assert store.get("other", "x") is None and store.get("marks", "t/3-0") == b"new"


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_rewind_values_survive_a_reopen(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0) as s:
        s.rewind({"marks"}, {"t": StreamId(5, 0)}, {("marks", "t/6-0"): b"7-0"})
    with open_store(engine, tmp_path, "g", 0) as s:
        assert s.get("marks", "t/6-0") == b"7-0"
        assert s.checkpoints() == {"t": StreamId(5, 0)}


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_checkpoints_keep_the_largest_stream_ids(engine: str, tmp_path: Path) -> None:
    """A regression test: SQLite refused sequence numbers over 2**63 (its INTEGER is signed),
    which Redis allows (``XADD key 5-18446744073709551615``) and a replay to a time uses."""
    largest = StreamId(2**48, 2**64 - 1)
    with open_store(engine, tmp_path, "g", 0) as s:
        with s.transaction() as tx:
            tx.set_checkpoint("a", StreamId(7, 2**63))
            tx.set_checkpoint("b", largest)
        s.rewind(set(), {"c": StreamId(1, 2**64 - 2)})
    with open_store(engine, tmp_path, "g", 0) as s:
        assert s.checkpoints() == {"a": StreamId(7, 2**63), "b": largest, "c": StreamId(1, 2**64 - 2)}
        assert s.dump()[0] == s.checkpoints()


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_rewind_survives_a_reopen(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0) as s, s.transaction() as tx:
        tx.set("state", "k", b"v")
        tx.set_checkpoint("t", StreamId(9, 0))
    with open_store(engine, tmp_path, "g", 0) as s:
        s.rewind({"state"}, {"t": None})
    with open_store(engine, tmp_path, "g", 0) as s:
        assert s.get("state", "k") is None
        assert s.checkpoints() == {}


def test_prefix_iteration_in_key_order(store: StateStore) -> None:
    with store.transaction() as tx:
        for key in ("user:2", "user:10", "order:1", "user:1"):
            tx.set("ns", key, key.encode())
        tx.set("other", "user:3", b"x")
    assert [k for k, _ in store.items("ns", "user:")] == ["user:1", "user:10", "user:2"]
    assert len(list(store.items("ns"))) == 4


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_reopen_after_close_keeps_everything(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 3) as s, s.transaction() as tx:
        tx.set("ns", "k", b"v")
        tx.set_checkpoint("t", StreamId(1, 1))
    with open_store(engine, tmp_path, "g", 3) as s:
        assert s.get("ns", "k") == b"v"
        assert s.checkpoints() == {"t": StreamId(1, 1)}
    assert (tmp_path / "g" / f"p3.{engine}").exists()


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_second_process_fails_fast_with_a_clear_error(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0):
        code = (
            "import sys\n"
            "from state_stores import open_store\n"
            "from pspf.errors import StoreLocked\n"
            "try:\n"
            f"    open_store({engine!r}, {str(tmp_path)!r}, 'g', 0)\n"
            "except StoreLocked as exc:\n"
            "    print(exc); sys.exit(7)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7, done.stderr
    assert "is in use by" in done.stdout
    # Released on close: the next open succeeds.
    open_store(engine, tmp_path, "g", 0).close()


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_same_process_second_open_is_refused_too(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0), pytest.raises(StoreLocked):
        open_store(engine, tmp_path, "g", 0)


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_readonly_open_does_not_take_the_lock(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0) as writer:
        with writer.transaction() as tx:
            tx.set("ns", "k", b"v")
        with open_store(engine, tmp_path, "g", 0, readonly=True) as reader:
            assert reader.get("ns", "k") == b"v"


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_unwritable_state_dir_is_a_state_error(engine: str, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateError, match="cannot open state store"):
        open_store(engine, blocker, "g", 0)


def test_large_batches_write_every_row(store: StateStore) -> None:
    with store.transaction() as tx:
        for i in range(1_000):
            tx.set("ns", f"k{i:04}", str(i).encode())
    with store.transaction() as tx:  # overwrite some, delete some, in one batch
        for i in range(0, 1_000, 3):
            tx.set("ns", f"k{i:04}", b"new")
        for i in range(1, 1_000, 3):
            tx.delete("ns", f"k{i:04}")
    got = dict(store.items("ns"))
    assert len(got) == 1_000 - len(range(1, 1_000, 3))
    assert all(got[f"k{i:04}"] == b"new" for i in range(0, 1_000, 3))
    assert all(got[f"k{i:04}"] == str(i).encode() for i in range(2, 1_000, 3))


def test_dump_is_the_checkpoints_and_every_value(store: StateStore) -> None:
    with store.transaction() as tx:
        tx.set("state", "b", b"2")
        tx.set("state", "a", b"1")
        tx.set("__failures", "t/1-1", b"f")
        tx.set_checkpoint("t", StreamId(7, 1))
    checkpoints, rows = store.dump()
    assert checkpoints == {"t": StreamId(7, 1)}
    assert sorted(rows) == [("__failures", "t/1-1", b"f"), ("state", "a", b"1"), ("state", "b", b"2")]


@pytest.mark.parametrize(
    ("source", "target"), [("sqlite", "rocksdb"), ("rocksdb", "sqlite"), ("memory", "sqlite")]
)
def test_export_then_import_into_another_engine_gives_equal_state(
    source: str, target: str, tmp_path: Path
) -> None:
    with _open(source, tmp_path / "a") as src:
        with src.transaction() as tx:
            for i in range(300):
                tx.set("state", f"k{i}", msgspec.msgpack.encode({"n": i, "b": bytes([i % 256])}))
            tx.set_checkpoint("orders", StreamId(1_700_000_000_000, 12))
        checkpoints, rows = src.dump()
        exported = (checkpoints, list(rows))
    with open_store(target, tmp_path / "b", "g", 0) as dst:
        with dst.transaction() as tx:
            for namespace, key, value in exported[1]:
                tx.set(namespace, key, value)
            for topic, entry_id in exported[0].items():
                tx.set_checkpoint(topic, entry_id)
        checkpoints, rows = dst.dump()
        assert (checkpoints, list(rows)) == exported
        assert msgspec.msgpack.decode(dst.get("state", "k7") or b"") == {"n": 7, "b": b"\x07"}


class Totals(msgspec.Struct):
    total: int
    tags: list[str]


def test_typed_values_round_trip_and_a_mismatch_names_the_key(store: StateStore) -> None:
    with store.transaction() as tx:
        tx.set("state", "u1", msgspec.msgpack.encode({"totals": Totals(3, ["a"])}))
        tx.set("state", "u2", msgspec.msgpack.encode({"totals": {"total": "not a number"}}))
    typed = StateDecoder(Totals)
    assert typed.decode("u1", store.get("state", "u1") or b"") == {"totals": Totals(3, ["a"])}
    with pytest.raises(StateError, match="stored state of key 'u2' does not match"):
        typed.decode("u2", store.get("state", "u2") or b"")


def test_rocksdb_missing_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['rocksdict'] = None\n"
        "from state_stores import open_store\n"
        "from pspf.errors import ConfigError\n"
        "try:\n"
        f"    open_store('rocksdb', {str(tmp_path)!r}, 'g', 0)\n"
        "except ConfigError as exc:\n"
        "    print(exc); sys.exit(7)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "pip install 'pspf[rocksdb]'" in done.stdout


def test_sqlite_full_disk_reports_the_cause_and_keeps_the_last_commit(tmp_path: Path) -> None:
    """A full disk (here: the file's page limit) fails the commit with SQLite's own reason."""
    store = open_store("sqlite", tmp_path, "g", 0)
    try:
        with store.transaction() as tx:
            tx.set("ns", "kept", b"1")
            tx.set_checkpoint("t", StreamId(1, 0))
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]  # type: ignore[attr-defined]
        store._db.execute(f"PRAGMA max_page_count = {pages + 2}")  # type: ignore[attr-defined]
        tx = store.transaction()
        for i in range(200):
            tx.set("ns", f"big{i}", b"x" * 4096)
        tx.set_checkpoint("t", StreamId(2, 0))
        with pytest.raises(StateError, match="database or disk is full") as failed:
            tx.commit()
        assert "no transaction is active" not in str(failed.value)
        assert tx.status is TxStatus.FAILED
        assert store.get("ns", "kept") == b"1" and store.get("ns", "big0") is None
        assert store.checkpoints() == {"t": StreamId(1, 0)}
    finally:
        store.close()
