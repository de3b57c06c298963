"""One suite over every state store engine: the same behaviour from memory and SQLite."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pspf.errors import CheckpointRegression, StateError, StoreLocked
from pspf.keys import StreamId
from state_stores import MemoryStore, StateStore, TxStatus, open_store

ENGINES = ["memory", "sqlite"]


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


def test_prefix_iteration_in_key_order(store: StateStore) -> None:
    with store.transaction() as tx:
        for key in ("user:2", "user:10", "order:1", "user:1"):
            tx.set("ns", key, key.encode())
        tx.set("other", "user:3", b"x")
    assert [k for k, _ in store.items("ns", "user:")] == ["user:1", "user:10", "user:2"]
    assert len(list(store.items("ns"))) == 4


def test_sqlite_reopen_after_close_keeps_everything(tmp_path: Path) -> None:
    with open_store("sqlite", tmp_path, "g", 3) as s, s.transaction() as tx:
        tx.set("ns", "k", b"v")
        tx.set_checkpoint("t", StreamId(1, 1))
    with open_store("sqlite", tmp_path, "g", 3) as s:
        assert s.get("ns", "k") == b"v"
        assert s.checkpoints() == {"t": StreamId(1, 1)}
    assert (tmp_path / "g" / "p3.sqlite").exists()


def test_second_process_fails_fast_with_a_clear_error(tmp_path: Path) -> None:
    with open_store("sqlite", tmp_path, "g", 0):
        code = (
            "import sys\n"
            "from state_stores import open_store\n"
            "from pspf.errors import StoreLocked\n"
            "try:\n"
            f"    open_store('sqlite', {str(tmp_path)!r}, 'g', 0)\n"
            "except StoreLocked as exc:\n"
            "    print(exc); sys.exit(7)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 7, done.stderr
    assert "in use by process" in done.stdout
    # Released on close: the next open succeeds.
    open_store("sqlite", tmp_path, "g", 0).close()


def test_same_process_second_open_is_refused_too(tmp_path: Path) -> None:
    with open_store("sqlite", tmp_path, "g", 0), pytest.raises(StoreLocked):
        open_store("sqlite", tmp_path, "g", 0)


def test_readonly_open_does_not_take_the_lock(tmp_path: Path) -> None:
    with open_store("sqlite", tmp_path, "g", 0) as writer:
        with writer.transaction() as tx:
            tx.set("ns", "k", b"v")
        with open_store("sqlite", tmp_path, "g", 0, readonly=True) as reader:
            assert reader.get("ns", "k") == b"v"


def test_unwritable_state_dir_is_a_state_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StateError, match="cannot open state store"):
        open_store("sqlite", blocker, "g", 0)


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
