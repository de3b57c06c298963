"""RocksDB engine (rocksdict): one instance per (group, partition), one WriteBatch per batch.

Values live under ``s<namespace>NUL<key>`` and checkpoints under ``c<topic>``, so one WriteBatch
holds a batch's state, checkpoints and bookkeeping and RocksDB applies it atomically. ``normal``
durability writes the WAL without syncing (survives a killed process); ``fsync`` syncs the WAL on
every batch (survives power loss). RocksDB's own LOCK file keeps a second process out.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from rocksdict import AccessType, Options, Rdict, WriteBatch, WriteOptions

from pspf.errors import NotFound, StateError, StoreLocked
from pspf.keys import StreamId
from pspf.state_stores.base import Durability, Pages, StateStore, apply_checkpoints

_READONLY_OPEN_ATTEMPTS = 5
#: Memtable size (RocksDB's default), and the options a restore changes while it loads (``load``).
_WRITE_BUFFER = 64 << 20
_LOADING = {"write_buffer_size": str(8 << 20), "disable_auto_compactions": "true"}
_RUNNING = {"write_buffer_size": str(_WRITE_BUFFER), "disable_auto_compactions": "false"}
#: Level-0 files a load may leave to RocksDB's own compactions (its compaction trigger).
_LEVEL0_FILES = 4
_STATE = b"s"
_CHECKPOINT = b"c"


def _state_key(namespace: str, key: str) -> bytes:
    return _prefix(namespace) + key.encode()


#: Each namespace's key prefix, made once: a batch writes hundreds of keys of a few namespaces.
_PREFIXES: dict[str, bytes] = {}


def _prefix(namespace: str) -> bytes:
    prefix = _PREFIXES.get(namespace)
    if prefix is None:
        prefix = _PREFIXES[namespace] = _STATE + namespace.encode() + b"\x00"
    return prefix


class RocksDBStore(StateStore):
    """State of one (group, partition) in one RocksDB directory."""

    def __init__(self, path: Path, durability: Durability = "normal", readonly: bool = False) -> None:
        self.path = path
        options = Options(raw_mode=True)
        options.create_if_missing(not readonly)
        options.set_write_buffer_size(_WRITE_BUFFER)
        if readonly and not (path / "CURRENT").exists():
            raise NotFound(f"state store {path} holds no state yet")
        self._db = self._open(path, options, readonly)
        if not readonly:
            self._remember_identity()
        self._write_options = WriteOptions()
        self._write_options.sync = durability == "fsync"
        self._checkpoints = {
            key[1:].decode(): StreamId.parse(value) for key, value in self._scan(_CHECKPOINT)
        }

    @staticmethod
    def _open(path: Path, options: Options, readonly: bool) -> Rdict:
        # A read-only open can race the owner's compaction deleting files it just listed: retry.
        attempts = _READONLY_OPEN_ATTEMPTS if readonly else 1
        for attempt in range(1, attempts + 1):
            try:
                if readonly:
                    return Rdict(str(path), options=options, access_type=AccessType.read_only())
                path.parent.mkdir(parents=True, exist_ok=True)
                return Rdict(str(path), options=options)
            except Exception as exc:
                text = str(exc)
                if "/LOCK: " in text:
                    raise StoreLocked(f"state store {path} is in use by another process") from None
                if attempt == attempts:
                    raise StateError(f"cannot open state store {path}: {text}") from exc
                time.sleep(0.05 * attempt)
        raise AssertionError("unreachable")

    def _scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            key = it.key()
            if not key.startswith(prefix):
                return
            yield key, it.value()
            it.next()
        try:
            it.status()  # an invalid iterator is the end of the data, or damage: tell them apart
        except Exception as exc:
            raise StateError(f"state store {self.path} is damaged: {exc}") from exc

    def get(self, namespace: str, key: str) -> bytes | None:
        try:
            value = self._db.get(_state_key(namespace, key))
        except Exception as exc:
            raise StateError(f"cannot read state store {self.path}: {exc}") from exc
        return None if value is None else bytes(value)

    def get_many(self, namespace: str, keys: Iterable[str]) -> dict[str, bytes]:
        wanted = list(keys)
        try:
            values = self._db.get([_state_key(namespace, key) for key in wanted]) or []
        except Exception as exc:
            raise StateError(f"cannot read state store {self.path}: {exc}") from exc
        return {key: bytes(value) for key, value in zip(wanted, values, strict=True) if value is not None}

    def items(self, namespace: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        head = _STATE + namespace.encode() + b"\x00"
        for key, value in self._scan(head + prefix.encode()):
            yield key[len(head) :].decode(), bytes(value)

    def checkpoints(self) -> dict[str, StreamId]:
        return dict(self._checkpoints)

    def write(
        self,
        updates: Mapping[tuple[str, str], bytes | None],
        checkpoints: Mapping[str, StreamId],
    ) -> None:
        batch = WriteBatch(raw_mode=True)
        put, prefixes = batch.put, _PREFIXES
        for (namespace, key), value in updates.items():
            prefix = prefixes.get(namespace) or _prefix(namespace)
            if value is None:
                batch.delete(prefix + key.encode())
            else:
                put(prefix + key.encode(), value)
        for topic, entry_id in checkpoints.items():
            batch.put(_CHECKPOINT + topic.encode(), str(entry_id).encode())
        self._write(batch, self._write_options, "commit")
        self._checkpoints.update(checkpoints)

    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        batch = WriteBatch(raw_mode=True)
        for namespace in clear:
            for key, _ in self._scan(_state_key(namespace, "")):
                batch.delete(key)
        for (namespace, name), value in (values or {}).items():
            batch.put(_state_key(namespace, name), value)  # after the deletes: the batch keeps order
        for topic, entry_id in checkpoints.items():
            if entry_id is None:
                batch.delete(_CHECKPOINT + topic.encode())
            else:
                batch.put(_CHECKPOINT + topic.encode(), str(entry_id).encode())
        self._write(batch, self._write_options, "rewind")
        apply_checkpoints(self._checkpoints, checkpoints)

    def load(self, clear: Collection[str], checkpoints: Mapping[str, StreamId | None], pages: Pages) -> None:
        """A bulk load: a batch per page, unlogged, into small memtables; one compaction at the end.

        The names are the keys' tails already (``_state_key``). Without the WAL a crash loses
        what is not flushed yet, which a restore may: the rewind (with the WAL) dropped the
        identity, and the identity is written only after the flush. Memtables of a few MB take
        inserts twice as fast as the usual 64 MB (and keep the restore's memory small); compacting
        while loading random keys rewrote the whole first level again and again, and one
        compaction at the end leaves the store as its batches expect it (no pile of level-0 files;
        a few are left to RocksDB).
        """
        self.rewind(clear, checkpoints)
        unlogged = WriteOptions()
        unlogged.disable_wal = True  # type: ignore[method-assign, assignment]  # a property, typed as a method
        self._options(_LOADING, "restore")
        try:
            for page in pages:
                batch = WriteBatch(raw_mode=True)
                for name, value in page:
                    # A name without NUL splits into (name, ""), as ``split_field`` says.
                    batch.put(_STATE + name if b"\x00" in name else _STATE + name + b"\x00", value)
                self._write(batch, unlogged, "restore")
            try:
                self._db.flush(wait=True)
                if (self._db.property_int_value("rocksdb.num-files-at-level0") or 0) > _LEVEL0_FILES:
                    self._db.compact_range(None, None)
            except Exception as exc:
                raise StateError(f"cannot restore state store {self.path}: {exc}") from exc
        finally:
            self._options(_RUNNING, "restore")

    def dump(self) -> tuple[dict[str, StreamId], Iterator[tuple[str, str, bytes]]]:
        # A read-only open sees the files as they were when it opened: already a snapshot.
        def rows() -> Iterator[tuple[str, str, bytes]]:
            for key, value in self._scan(_STATE):
                namespace, _, name = key[1:].partition(b"\x00")
                yield namespace.decode(), name.decode(), bytes(value)

        return dict(self._checkpoints), rows()

    def integrity_check(self) -> str:
        """Read every key and value back (RocksDB verifies block checksums): ``ok`` when sound."""
        try:
            for _ in self._scan(b""):
                pass
        except Exception as exc:
            return f"corrupt: {exc}"
        return "ok"

    def close(self) -> None:
        self._db.close()

    def _write(self, batch: WriteBatch, options: WriteOptions, what: str) -> None:
        try:
            self._db.write(batch, options)
        except Exception as exc:
            raise StateError(f"cannot {what} state store {self.path}: {exc}") from exc

    def _options(self, options: dict[str, str], what: str) -> None:
        try:
            self._db.set_options(options)
        except Exception as exc:
            raise StateError(f"cannot {what} state store {self.path}: {exc}") from exc
