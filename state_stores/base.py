"""The state store interface: a store per (group, partition) and a transaction per batch.

A store keeps values by (namespace, key) and, in the same atomic write, one checkpoint per topic:
the id of the last entry of that topic partition whose effects are committed. Engines implement
four small primitives (read one, read many, iterate, write atomically); the transaction logic,
read-your-own-writes and the checkpoint guard live here once.
"""

from __future__ import annotations

import enum
import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

from pspf.errors import CheckpointRegression, StateError
from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, StreamId

Durability = Literal["normal", "fsync"]
#: Values to ``load``: pages of (name, value), each name ``field(namespace, key)``.
Pages = Iterable[Sequence[tuple[bytes, bytes]]]


def field(namespace: str, key: str) -> bytes:
    """A value's (namespace, key) as one name, ``namespace NUL key``: the state backup's field."""
    return namespace.encode() + b"\x00" + key.encode()


def split_field(raw: bytes) -> tuple[str, str]:
    namespace, _, key = raw.partition(b"\x00")
    return namespace.decode(), key.decode()


class Journal:
    """Committed writes not yet copied elsewhere (to the state backup), merged by key.

    A store with a journal stamps every transaction it commits with a new identity (the owner's
    fencing token and a sequence number, under ``BACKUP_NAMESPACE``/``BACKUP_IDENTITY``), in the
    same write, and records the transaction here: a store and its backup with the same identity
    hold the same values. ``take`` hands the writes over; ``give_back`` returns them, under newer
    ones, when the copy may not have happened.
    """

    __slots__ = ("checkpoints", "seq", "token", "updates")

    def __init__(self, token: str = "0", seq: int = 0) -> None:
        self.token = token
        self.seq = seq
        self.updates: dict[tuple[str, str], bytes | None] = {}
        self.checkpoints: dict[str, StreamId] = {}

    def __bool__(self) -> bool:
        return bool(self.updates or self.checkpoints)

    def stamp(self, updates: dict[tuple[str, str], bytes | None]) -> None:
        """Add the identity of a transaction about to commit to its writes."""
        self.seq += 1
        updates[(BACKUP_NAMESPACE, BACKUP_IDENTITY)] = f"{self.token}-{self.seq}".encode()

    def record(
        self, updates: Mapping[tuple[str, str], bytes | None], checkpoints: Mapping[str, StreamId]
    ) -> None:
        self.updates.update(updates)
        self.checkpoints.update(checkpoints)

    def take(self) -> tuple[dict[tuple[str, str], bytes | None], dict[str, StreamId]]:
        taken = self.updates, self.checkpoints
        self.updates, self.checkpoints = {}, {}
        return taken

    def give_back(
        self, updates: dict[tuple[str, str], bytes | None], checkpoints: dict[str, StreamId]
    ) -> None:
        self.updates = {**updates, **self.updates}
        self.checkpoints = {**checkpoints, **self.checkpoints}


class StateStore(ABC):
    """The committed state of one (group, partition)."""

    #: Records every committed transaction when set (the state backup sets it).
    journal: Journal | None = None

    #: Where the engine keeps its files (None for the memory engine).
    path: Path | None = None
    #: (device, inode) of ``path`` when a writer opened it; see ``check_in_place``.
    _identity: tuple[int, int] | None = None

    def _remember_identity(self) -> None:
        assert self.path is not None
        found = os.stat(self.path)
        self._identity = (found.st_dev, found.st_ino)

    def check_in_place(self) -> None:
        """Raise StateError when the store's files were deleted or replaced since it was opened.

        Writes into deleted files succeed and then vanish: a worker that went on would
        acknowledge entries whose effects no restart can find.
        """
        if self._identity is None or self.path is None:
            return
        try:
            found = os.stat(self.path)
        except OSError:
            found = None
        if found is None or (found.st_dev, found.st_ino) != self._identity:
            raise StateError(
                f"state store {self.path} was deleted or replaced while in use: nothing more is "
                "committed or acknowledged; restore the state directory before starting again"
            )

    @abstractmethod
    def get(self, namespace: str, key: str) -> bytes | None:
        """The committed value of ``key``, or None."""

    @abstractmethod
    def get_many(self, namespace: str, keys: Iterable[str]) -> dict[str, bytes]:
        """The committed values of those ``keys`` that exist."""

    @abstractmethod
    def items(self, namespace: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        """Committed (key, value) pairs whose key starts with ``prefix``, in key order."""

    @abstractmethod
    def checkpoints(self) -> dict[str, StreamId]:
        """The committed checkpoint of each topic."""

    @abstractmethod
    def write(
        self,
        updates: Mapping[tuple[str, str], bytes | None],
        checkpoints: Mapping[str, StreamId],
    ) -> None:
        """Apply value updates (None deletes) and checkpoints in ONE atomic, durable write."""

    @abstractmethod
    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        """Clear namespaces, set values and set checkpoints, also backwards, in ONE atomic write.

        Deletes every value of the ``clear`` namespaces, then sets ``values`` by (namespace,
        key), so a replay's bookkeeping starts with the rewound checkpoints; a None checkpoint
        is deleted. Only a replay, with the app stopped, moves checkpoints back.
        """

    def load(self, clear: Collection[str], checkpoints: Mapping[str, StreamId | None], pages: Pages) -> None:
        """Rewind (``clear``, ``checkpoints``), then write every page of values: a whole restore.

        Pages hold (``field(namespace, key)``, value) pairs as the state backup's hash yields
        them: in any order, a name maybe twice (either value may stay), so an engine splits the
        names only if it must. An engine may load them faster sorted, or unsynced, as long as no
        crash keeps the next ``write`` (the restore's identity) without every loaded value.
        """
        self.rewind(clear, checkpoints)
        for page in pages:
            self.write({split_field(name): value for name, value in page}, {})

    @abstractmethod
    def dump(self) -> tuple[dict[str, StreamId], Iterator[tuple[str, str, bytes]]]:
        """A consistent snapshot: the checkpoints and every (namespace, key, value) with them.

        Consume the iterator before using the store for anything else.
        """

    @abstractmethod
    def integrity_check(self) -> str:
        """The engine's own verdict on its files: ``ok`` when they are sound."""

    @abstractmethod
    def close(self) -> None:
        """Release files and locks; the store must not be used afterwards."""

    def transaction(self) -> StoreTransaction:
        """Start a transaction; commit it, or use it as a context manager."""
        return StoreTransaction(self)

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def apply_checkpoints(cache: dict[str, StreamId], checkpoints: Mapping[str, StreamId | None]) -> None:
    """Mirror a rewind's checkpoints in an engine's in-memory copy (None deletes one)."""
    for topic, entry_id in checkpoints.items():
        if entry_id is None:
            cache.pop(topic, None)
        else:
            cache[topic] = entry_id


class TxStatus(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"
    FAILED = "failed"


class StoreTransaction:
    """Buffered writes and checkpoints of one batch, applied by ``commit`` in one store write.

    Reads see the transaction's own writes first. Any failure while committing marks the
    transaction failed; a failed or finished transaction refuses further use.
    """

    __slots__ = ("_checkpoints", "_store", "_updates", "status")

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._updates: dict[tuple[str, str], bytes | None] = {}
        self._checkpoints: dict[str, StreamId] = {}
        self.status = TxStatus.OPEN

    def _check_open(self) -> None:
        if self.status is not TxStatus.OPEN:
            raise StateError(f"the transaction is {self.status.value}")

    def get(self, namespace: str, key: str) -> bytes | None:
        self._check_open()
        try:
            return self._updates[(namespace, key)]
        except KeyError:
            return self._store.get(namespace, key)

    def set(self, namespace: str, key: str, value: bytes) -> None:
        self._check_open()
        self._updates[(namespace, key)] = value

    def delete(self, namespace: str, key: str) -> None:
        self._check_open()
        self._updates[(namespace, key)] = None

    def put(self, namespace: str, values: Mapping[str, bytes | None]) -> None:
        """Set every key of ``values`` (None deletes it): a batch's writes in one call."""
        self._check_open()
        self._updates.update({(namespace, key): value for key, value in values.items()})

    def update(self, writes: Mapping[tuple[str, str], bytes | None]) -> None:
        """Set every (namespace, key) of ``writes`` (None deletes it), whatever their namespaces."""
        self._check_open()
        self._updates.update(writes)

    def set_checkpoint(self, topic: str, entry_id: StreamId) -> None:
        """Record that every entry of ``topic`` up to ``entry_id`` is applied by this transaction."""
        self._check_open()
        current = self._checkpoints.get(topic) or self._store.checkpoints().get(topic)
        if current is not None and entry_id < current:
            raise CheckpointRegression(
                f"checkpoint of topic {topic!r} would move back from {current} to {entry_id}"
            )
        self._checkpoints[topic] = entry_id

    def commit(self) -> None:
        self._check_open()
        journal = self._store.journal
        try:
            if journal is not None:
                journal.stamp(self._updates)
            self._store.write(self._updates, self._checkpoints)
            self._store.check_in_place()
        except BaseException:
            self.status = TxStatus.FAILED
            raise
        self.status = TxStatus.COMMITTED
        if journal is not None:
            journal.record(self._updates, self._checkpoints)

    def rollback(self) -> None:
        if self.status is TxStatus.OPEN:
            self.status = TxStatus.ROLLED_BACK
        self._updates.clear()
        self._checkpoints.clear()

    def __enter__(self) -> StoreTransaction:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and self.status is TxStatus.OPEN:
            self.commit()
        else:
            self.rollback()
