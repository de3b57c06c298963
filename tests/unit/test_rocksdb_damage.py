"""A damaged RocksDB store must be reported as damaged: never as empty, "no state" or "in use".

THESE TESTS FAIL NOW: they show production bugs in ``state_stores/rocksdb.py``.

1. ``RocksDBStore._scan`` stops when ``it.valid()`` turns False and never asks ``it.status()``.
   RocksDB ends an iteration at a corrupt block exactly like at the end of the data, so a
   checksum error reads as "no more keys": ``integrity_check()`` says ``ok``, ``items()`` returns
   a silent prefix (``pspf state export``/``list`` too), and a corrupt first block opens as an
   EMPTY store (no checkpoints): a worker then treats the partition as fresh.
2. ``__init__`` maps any open error whose text contains "lock" to ``StoreLocked``; "block
   checksum mismatch" contains "b-lock", so a store with a corrupt index block is "in use by
   another process", and a worker retries it for ever at INFO level.
3. A read-only open maps any error that says "No such file" to ``NotFound`` ("holds no state
   yet"); RocksDB says so for a missing SST file too (and, transiently, when a read-only open
   races the running worker's compaction deleting files it just listed).

Each test builds a store with a checkpoint and 2,000 values in one SST file, then damages it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pspf.errors import StateError
from pspf.keys import StreamId
from pspf.state_stores import open_store, store_path

pytest.importorskip("rocksdict")

KEYS = 2_000
CHECKPOINT = StreamId(5, 0)


def _store_in_one_table(directory: Path) -> Path:
    """A store with KEYS random 50-byte values and a checkpoint, flushed into one SST; that file."""
    rng = random.Random(1)
    with open_store("rocksdb", directory, "g", 0) as store, store.transaction() as tx:
        for i in range(KEYS):
            tx.set("ns", f"k{i:05d}", rng.randbytes(50))
        tx.set_checkpoint("t", CHECKPOINT)
    open_store("rocksdb", directory, "g", 0).close()  # the reopen flushes the WAL into an SST
    tables = list(store_path(directory, "rocksdb", "g", 0).glob("*.sst"))
    assert len(tables) == 1, tables
    return tables[0]


def _flip(path: Path, start: int, length: int = 40) -> None:
    """Invert ``length`` bytes from ``start`` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    first = start % len(data)
    for i in range(first, first + length):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_missing_table_file_is_a_state_error_not_no_state(tmp_path: Path, readonly: bool) -> None:
    _store_in_one_table(tmp_path).unlink()
    # Now: the read-only open raises NotFound("... holds no state yet").
    with pytest.raises(StateError, match="cannot open state store"):
        open_store("rocksdb", tmp_path, "g", 0, readonly=readonly).close()


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_corrupt_index_block_is_a_state_error_not_store_locked(tmp_path: Path, readonly: bool) -> None:
    _flip(_store_in_one_table(tmp_path), -200)  # the index block, near the end of the file
    # Now: StoreLocked("... is in use by another process"), a StateError whose message misleads.
    with pytest.raises(StateError, match="cannot open state store"):
        open_store("rocksdb", tmp_path, "g", 0, readonly=readonly).close()


def test_corrupt_data_block_fails_the_integrity_check_and_reads(tmp_path: Path) -> None:
    table = _store_in_one_table(tmp_path)
    _flip(table, table.stat().st_size // 2)  # a data block in the middle
    with open_store("rocksdb", tmp_path, "g", 0, readonly=True) as store:
        assert store.get("ns", "k00000") is not None  # the first block is sound
        # Now: "ok", and items() ends at the corrupt block (960 of 2000 keys), silently.
        assert store.integrity_check() != "ok"
        with pytest.raises(StateError):
            list(store.items("ns"))


@pytest.mark.parametrize("readonly", [False, True], ids=["writable", "readonly"])
def test_corrupt_first_block_does_not_open_as_an_empty_store(tmp_path: Path, readonly: bool) -> None:
    _flip(_store_in_one_table(tmp_path), 20)  # the first data block holds the checkpoint
    try:
        store = open_store("rocksdb", tmp_path, "g", 0, readonly=readonly)
    except StateError:
        return  # reported: fine
    with store:
        # Now: it opens with no checkpoints, no values and integrity "ok": a fresh store.
        assert store.checkpoints() == {"t": CHECKPOINT}, "a damaged store opened as an empty one"
