"""One suite over every registered state store engine: the same behaviour from each.

The engines come from the registry, so a new engine runs here once it is registered; the JSON
engine of the tests (tests/support/json_store.py) is registered by the one line below.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import Settings, keys
from pspf.broker import Broker
from pspf.codec import StateDecoder
from pspf.errors import CheckpointRegression, StateError, StoreLocked
from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, STORE_NAMESPACES, StreamId
from pspf.partition.backup import CHUNK, PartitionBackup, Restored, split_field
from pspf.state_stores import Engine, StateStore, TxStatus, engines, open_store, register_engine
from pspf.state_stores.base import Journal
from tests.conftest import Names

register_engine("json", "tests.support.json_store:JsonStore", suffix=".json")

ENGINES = list(engines())
FILE_ENGINES = [name for name, engine in engines().items() if engine.suffix is not None]


def _open(engine: str, directory: Path) -> StateStore:
    if engines()[engine].suffix is None:
        return engines()[engine].load()()
    return open_store(engine, directory, "g", 0)


def _registered(engine: str) -> str:
    """The lines that register ``engine`` in a subprocess as this module did here."""
    found: Engine = engines()[engine]
    return (
        "from pspf.state_stores import register_engine\n"
        f"register_engine({found.name!r}, {found.store_class!r}, {found.suffix!r}, {found.extra!r})\n"
    )


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
            f"{_registered(engine)}"
            "from pspf.state_stores import open_store\n"
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


def test_large_values_read_write_clear_and_dump_like_any_other(store: StateStore) -> None:
    """A namespace of large values (SQLite keeps them in a table of their own) behaves the same."""
    (large,) = keys.LARGE_VALUE_NAMESPACES
    page = bytes(range(256)) * 300  # a batch's outbox rows are tens of kilobytes
    with store.transaction() as tx:
        tx.set(large, "0001", page)
        tx.set(large, "0002", b"small")
        tx.set("ns", "0001", b"not large")
        tx.set_checkpoint("t", StreamId(1, 0))
    assert store.get(large, "0001") == page and store.get("ns", "0001") == b"not large"
    assert store.get_many(large, ["0001", "0003"]) == {"0001": page}
    assert list(store.items(large)) == [("0001", page), ("0002", b"small")]
    assert list(store.items(large, "0002")) == [("0002", b"small")]
    _, rows = store.dump()
    assert [(ns, key) for ns, key, _ in rows] == sorted([(large, "0001"), (large, "0002"), ("ns", "0001")])
    with store.transaction() as tx:
        tx.delete(large, "0001")
    assert store.get(large, "0001") is None and store.get(large, "0002") == b"small"
    store.rewind({large}, {"t": StreamId(1, 0)}, {(large, "0009"): page})
    assert list(store.items(large)) == [("0009", page)] and store.get("ns", "0001") == b"not large"


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
    ("source", "target"),
    [(source, target) for source in ENGINES for target in FILE_ENGINES if source != target],
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
        "from pspf.state_stores import open_store\n"
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


# -- the journal, the batch identity and a restore from the state backup -------------------------

IDENTITY = (BACKUP_NAMESPACE, BACKUP_IDENTITY)


def _without_identity(updates: dict[tuple[str, str], bytes | None]) -> dict[tuple[str, str], bytes | None]:
    """A journal's writes apart from the batch identity (the backup never copies it)."""
    return {name: value for name, value in updates.items() if name != IDENTITY}


def _dump(store: StateStore) -> tuple[dict[str, StreamId], list[tuple[str, str, bytes]]]:
    checkpoints, rows = store.dump()
    return checkpoints, sorted(rows)


def test_a_journal_records_exactly_the_committed_transactions_merged_by_key(store: StateStore) -> None:
    assert store.journal is None  # no journal unless one is given
    journal = Journal("7")
    store.journal = journal
    assert not journal
    with store.transaction() as tx:
        tx.set("state", "a", b"1")
        tx.set("state", "b", b"2")
        tx.set("__failures", "t/1-0", b"f")
        tx.set_checkpoint("t", StreamId(1, 0))
    assert store.get(*IDENTITY) == b"7-1"
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.set("state", "a", b"rolled back")
        tx.set("state", "x", b"rolled back")
        tx.set_checkpoint("t", StreamId(9, 0))
        raise RuntimeError("handler blew up")
    tx = store.transaction()
    tx.set("state", "y", b"rolled back")
    tx.set_checkpoint("v", StreamId(9, 0))
    tx.rollback()
    with pytest.raises(CheckpointRegression), store.transaction() as tx:
        tx.set("state", "z", b"rolled back")
        tx.set_checkpoint("t", StreamId(0, 5))
    with store.transaction() as tx:
        tx.set("state", "a", b"3")
        tx.delete("state", "b")
        tx.delete("__failures", "t/1-0")
        tx.delete("state", "never-there")
        tx.set("state", "c", b"4")
        tx.set_checkpoint("t", StreamId(2, 0))
        tx.set_checkpoint("u", StreamId(5, 5))

    assert journal
    assert _without_identity(journal.updates) == {
        ("state", "a"): b"3",
        ("state", "b"): None,
        ("__failures", "t/1-0"): None,
        ("state", "never-there"): None,
        ("state", "c"): b"4",
    }
    assert journal.checkpoints == {"t": StreamId(2, 0), "u": StreamId(5, 5)}
    # Each commit was stamped with the next identity, the rolled-back ones with none.
    assert journal.updates[IDENTITY] == store.get(*IDENTITY) == b"7-2"
    # What it holds is what the store holds.
    for (namespace, key), value in journal.updates.items():
        assert store.get(namespace, key) == value
    assert store.checkpoints() == journal.checkpoints


def test_a_journaled_commit_is_stamped_whatever_identity_it_wrote(store: StateStore) -> None:
    """The identity is the journal's to give: equal identities must mean equal contents."""
    with store.transaction() as tx:  # no journal: a value like any other
        tx.set(*IDENTITY, b"3-9")
    assert store.get(*IDENTITY) == b"3-9"
    store.journal = Journal("12", 344)
    with store.transaction() as tx:
        tx.set(*IDENTITY, b"3-10")
        tx.set("state", "k", b"v")
    assert store.get(*IDENTITY) == b"12-345"
    with store.transaction() as tx:  # also a transaction with nothing else in it
        pass
    assert store.get(*IDENTITY) == b"12-346"
    assert (BACKUP_NAMESPACE, BACKUP_IDENTITY, b"12-346") in _dump(store)[1]


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_a_commit_that_fails_is_not_journaled(engine: str, tmp_path: Path) -> None:
    store = open_store(engine, tmp_path, "g", 0)
    moved = tmp_path / "g" / "moved"
    try:
        store.journal = Journal()
        with store.transaction() as tx:
            tx.set("state", "a", b"1")
        store.journal.take()
        assert store.path is not None and store.path.with_name("moved") == moved
        store.path.rename(moved)  # the write lands in the moved files; the check after it fails
        tx = store.transaction()
        tx.set("state", "a", b"lost")
        tx.set_checkpoint("t", StreamId(3, 0))
        with pytest.raises(StateError, match="deleted or replaced"):
            tx.commit()
        assert tx.status is TxStatus.FAILED
        assert not store.journal
    finally:
        if store.path is not None and moved.exists():
            moved.rename(store.path)
        store.close()


def test_journal_take_empties_it_and_give_back_restores_under_newer_writes(store: StateStore) -> None:
    journal = Journal("5")
    store.journal = journal
    with store.transaction() as tx:
        tx.set("state", "a", b"1")
        tx.set("state", "b", b"2")
        tx.set_checkpoint("t", StreamId(1, 0))
        tx.set_checkpoint("u", StreamId(1, 0))
    taken = journal.take()
    assert taken == (
        {("state", "a"): b"1", ("state", "b"): b"2", IDENTITY: b"5-1"},
        {"t": StreamId(1, 0), "u": StreamId(1, 0)},
    )
    assert not journal and journal.updates == {} and journal.checkpoints == {}
    assert journal.take() == ({}, {})

    # The copy may not have happened: the writes come back, under those committed since.
    with store.transaction() as tx:
        tx.set("state", "a", b"5")
        tx.delete("state", "c")
        tx.set_checkpoint("t", StreamId(2, 0))
    journal.give_back(*taken)
    want = {("state", "a"): b"5", ("state", "b"): b"2", ("state", "c"): None, IDENTITY: b"5-2"}
    assert journal.updates == want
    assert journal.checkpoints == {"t": StreamId(2, 0), "u": StreamId(1, 0)}
    for (namespace, key), value in journal.updates.items():
        assert store.get(namespace, key) == value
    assert journal.take() == (want, {"t": StreamId(2, 0), "u": StreamId(1, 0)})
    assert not journal


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_the_batch_identity_survives_close_and_reopen(engine: str, tmp_path: Path) -> None:
    with open_store(engine, tmp_path, "g", 0) as s:
        s.journal = Journal("12", 344)
        with s.transaction() as tx:
            tx.set("state", "k", b"v")
            tx.set_checkpoint("t", StreamId(3, 0))
    with open_store(engine, tmp_path, "g", 0, readonly=True) as s:
        assert s.get(*IDENTITY) == b"12-345"
    with open_store(engine, tmp_path, "g", 0) as s:
        assert s.journal is None  # a journal belongs to an owner, not to the files
        assert _dump(s) == (
            {"t": StreamId(3, 0)},
            [(BACKUP_NAMESPACE, BACKUP_IDENTITY, b"12-345"), ("state", "k", b"v")],
        )


def test_rewinding_every_store_namespace_clears_the_identity_too(store: StateStore) -> None:
    """What a restore from the backup does first: nothing of the old store, identity included."""
    store.journal = Journal("3")
    with store.transaction() as tx:
        for namespace in STORE_NAMESPACES:
            tx.set(namespace, "t/1-0", b"old")
        tx.set("other", "kept", b"x")
        tx.set_checkpoint("t", StreamId(50, 0))
        tx.set_checkpoint("u", StreamId(60, 0))
    assert store.get(*IDENTITY) == b"3-1"

    store.rewind(STORE_NAMESPACES, {"t": StreamId(10, 0), "u": None})
    assert _dump(store) == ({"t": StreamId(10, 0)}, [("other", "kept", b"x")])
    assert store.get(*IDENTITY) is None

    # With values, they are set after the clearing: a new identity stays.
    store.rewind(STORE_NAMESPACES, {}, {IDENTITY: b"4-1", ("state", "k"): b"v"})
    assert _dump(store) == (
        {"t": StreamId(10, 0)},
        [(BACKUP_NAMESPACE, BACKUP_IDENTITY, b"4-1"), ("other", "kept", b"x"), ("state", "k", b"v")],
    )


# -- reconciling a store with its backup in a real Redis ------------------------------------------


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    b = Broker(Settings.load({"PSPF_BROKER": redis_url}, environ={}).redis)
    yield b
    b.close()


def _owner(broker: Broker, topic: str, group: str, owner: str) -> PartitionBackup:
    """Take partition 0's lease as ``owner``: its backup, as a worker's takeover makes it."""
    lease = keys.lease_key(topic, 0, group)
    value = broker.leases.acquire_lease(lease, keys.fence_key(topic, 0, group), owner, 60_000)
    assert value is not None, "the lease is held"
    return PartitionBackup(broker.acks, group, topic, 0, lease, value)


def _give_up(broker: Broker, backup: PartitionBackup) -> None:
    broker.leases.release_leases([(backup.lease_key, backup.lease_value)])


def _take_over(backup: PartitionBackup, store: StateStore, topics: list[str], action: str) -> Restored:
    """Reconcile as a takeover does (uploading the store where the backup is missing, as a
    takeover does once the store is known not to be behind); the store then journals for this owner."""
    done = backup.reconcile(store, topics)
    if done.action == "missing":
        done = backup.upload(store)
    assert done.action == action, done
    store.journal = backup.journal
    return done


def _batch(
    store: StateStore,
    backup: PartitionBackup | None,
    topic: str,
    checkpoint: StreamId,
    sets: dict[tuple[str, str], bytes],
    deletes: tuple[tuple[str, str], ...] = (),
    send: bool = True,
) -> None:
    """Commit a batch, then send it as the acknowledging call does (the store journals it).

    Without ``send`` the owner dies between its local commit and the acknowledging call.
    """
    with store.transaction() as tx:
        for (namespace, key), value in sets.items():
            tx.set(namespace, key, value)
        for namespace, key in deletes:
            tx.delete(namespace, key)
        tx.set_checkpoint(topic, checkpoint)
    if backup is not None and send:
        backup.flush()


def _backup_as_rows(rclient: redis.Redis, backup: PartitionBackup) -> list[tuple[str, str, bytes]]:
    return sorted((*split_field(name), value) for name, value in rclient.hgetall(backup.keys.values).items())


def _backup_as_dump(rclient: redis.Redis, broker: Broker, backup: PartitionBackup) -> Any:
    """The backup as a store's dump would show it: its checkpoints, values and identity.

    The values hash holds the identity too, the same as its meta's (so a values hash deleted on
    its own is noticed).
    """
    meta = broker.acks.backup_meta(backup.keys.meta)
    checkpoints = {name[3:]: StreamId.parse(value) for name, value in meta.items() if name.startswith("cp:")}
    rows = _backup_as_rows(rclient, backup)
    assert (BACKUP_NAMESPACE, BACKUP_IDENTITY, meta[BACKUP_IDENTITY].encode()) in rows
    return checkpoints, rows


@pytest.mark.integration
@pytest.mark.parametrize("engine", ENGINES)
def test_reconcile_makes_any_store_equal_to_the_backup_in_redis(
    engine: str,
    tmp_path: Path,
    broker: Broker,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, group = make_topic(1), names.app()
    with (
        _open(engine, tmp_path / "a") as store_a,
        _open(engine, tmp_path / "b") as store_b,
        _open(engine, tmp_path / "c") as store_c,
    ):
        # Host a: no backup yet, an empty store: a fresh start.
        a = _owner(broker, topic, group, "host-a/1/aa")
        _take_over(a, store_a, [topic], "fresh")
        _batch(store_a, a, topic, StreamId(10, 0), {("state", f"k{i}"): b"%d" % i for i in range(120)})
        _batch(
            store_a,
            a,
            topic,
            StreamId(20, 0),
            {("state", "k1"): b"new", ("__failures", "t/19-0"): b"f", ("__consumers", "host-a"): b""},
            deletes=(("state", "k2"),),
        )
        with pytest.raises(RuntimeError), store_a.transaction() as tx:  # reaches nothing
            tx.set("state", "k3", b"rolled back")
            raise RuntimeError("handler blew up")
        a.flush()
        assert _backup_as_dump(rclient, broker, a) == _dump(store_a)
        assert rclient.hlen(a.keys.values) == 122  # 121 values and the identity
        # Host a dies between its local commit and the call: its store is a batch ahead.
        _batch(store_a, a, topic, StreamId(30, 0), {("state", "k5"): b"ahead"}, send=False)
        _give_up(broker, a)

        # Host b: empty stores are rebuilt from the backup, identity included.
        b = _owner(broker, topic, group, "host-b/2/bb")
        assert _take_over(b, store_c, [topic], "restored").amount == 121
        assert _take_over(b, store_b, [topic], "restored").amount == 121
        assert _dump(store_b) == _dump(store_c) == _backup_as_dump(rclient, broker, b)
        assert b.reconcile(store_b, [topic]).action == "in sync"
        for n in range(3):
            _batch(
                store_b,
                b,
                topic,
                StreamId(21 + n, 0),
                {("state", "k7"): b"b%d" % n},
                (("state", f"k{8 + n}"),),
            )
        assert _dump(store_b) == _backup_as_dump(rclient, broker, b)
        _give_up(broker, b)

        # Host a again, its store ahead by a batch of a history the backup never had, and
        # behind host b's: rolled back to the backup, a checkpoint the backup lacks dropped.
        store_a.journal = None
        with store_a.transaction() as tx:
            tx.set_checkpoint("other-topic", StreamId(5, 0))
        a2 = _owner(broker, topic, group, "host-a/1/aa")
        _take_over(a2, store_a, [topic, "other-topic"], "restored")
        assert _dump(store_a) == _dump(store_b)
        assert store_a.get("state", "k5") == b"5" and store_a.get("state", "k7") == b"b2"
        assert store_a.checkpoints() == {topic: StreamId(23, 0)}

        # A store some updates behind (host b's three batches) catches up from the log.
        store_c.journal = None
        assert _take_over(a2, store_c, [topic], "caught up").amount == 3
        assert _dump(store_c) == _dump(store_b)

        # The next owner's batches get identities no earlier owner used.
        _batch(store_a, a2, topic, StreamId(40, 0), {("state", "k9"): b"a2"})
        identities = [fields[b"id"] for _, fields in rclient.xrange(a2.keys.log)]
        assert len(set(identities)) == len(identities) == 6  # host a's 2, host b's 3, this one
        assert identities[-1] == store_a.get(*IDENTITY)
        assert _dump(store_a) == _backup_as_dump(rclient, broker, a2)


@pytest.mark.integration
@pytest.mark.parametrize("engine", ENGINES)
def test_a_store_without_a_backup_is_uploaded_and_restores_elsewhere_in_pages(
    engine: str,
    tmp_path: Path,
    broker: Broker,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """A store from before the backup (or from a time it was off) becomes the backup, whole."""
    topic, group = make_topic(1), names.app()
    many = CHUNK + 1_234  # more than one page each way
    with _open(engine, tmp_path / "a") as store_a, _open(engine, tmp_path / "b") as store_b:
        _batch(store_a, None, topic, StreamId(7, 7), {("state", f"k{i:05}"): b"%d" % i for i in range(many)})
        with store_a.transaction() as tx:
            tx.set("__failures", "t/7-1", b"f")
        a = _owner(broker, topic, group, "host-a/1/aa")
        assert _take_over(a, store_a, [topic], "uploaded").amount == many + 1
        identity = store_a.get(*IDENTITY)
        assert identity is not None and identity.decode().startswith(a.journal.token + "-")
        assert _backup_as_dump(rclient, broker, a) == _dump(store_a)
        assert a.reconcile(store_a, [topic]).action == "in sync"
        _give_up(broker, a)

        b = _owner(broker, topic, group, "host-b/2/bb")
        assert _take_over(b, store_b, [topic], "restored").amount == many + 1
        assert _dump(store_b) == _dump(store_a)
        _give_up(broker, b)
