"""The state backup: each partition's state kept in Redis, so it follows the partition anywhere.

The contract:

- Keys (``keys.backup_key`` and ``keys.backup_meta_key``), on the hash tag of the app's FIRST
  topic's partition: a hash of every value the partition's store holds (field
  ``namespace NUL key``; the memory it takes is about the encoded state's size) and a meta hash
  with the batch identity and the checkpoint of every topic (``cp:TOPIC``).
- Order per batch: the local commit holds the batch's writes, checkpoints and identity
  (``token-seq``: the owner's fencing token and the batch's sequence number); then ONE Lua call
  per partition (``lua/ack.lua``) checks the lease, updates the backup with every write the store
  journaled since the last call, sets the identity, acknowledges the batch and moves its dead
  entries to the DLQ. Nothing is acknowledged before the backup holds the batch's effects, and an
  ex-owner whose lease moved can change neither.
- A crash between the two leaves the local store ahead of the backup with the entries still
  pending. At takeover (``reconcile``) the store's identity is compared with the backup's: equal,
  the store is used as it is; different or missing (a new machine, a store behind, one ahead by
  a batch whose call never ran, or one from another owner's history), the store is rebuilt from
  the backup before any entry is applied. The backup is the truth. With no backup yet (a first
  run, or one after the backup was off), the store is uploaded.
- An app that reads several topics keeps one store per partition, so one backup: the call for
  its first topic carries it, and the other topics' acknowledgements are sent only once that
  call succeeded (a second round trip, needed because their streams can be on other nodes), so
  nothing of theirs is acknowledged before the backup holds it either.
- Writes outside a batch (takeover bookkeeping, confirmed DLQ moves) go with the next call; those
  that must reach the backup before Redis changes (entries marked before they are claimed) are
  sent at once (``flush``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from pspf import keys
from pspf.broker import AckRequest, BackupUpdate, Broker, Fields
from pspf.errors import LeaseLost
from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, StreamId
from state_stores.base import Journal

if TYPE_CHECKING:
    from state_stores import StateStore

log = logging.getLogger(__name__)

#: Values per Lua call when a whole store is uploaded, and per transaction when one is restored.
CHUNK = 5_000


def field(namespace: str, key: str) -> bytes:
    return namespace.encode() + b"\x00" + key.encode()


def split_field(raw: bytes) -> tuple[str, str]:
    namespace, _, key = raw.partition(b"\x00")
    return namespace.decode(), key.decode()


class Restored(NamedTuple):
    """What reconciling a store with the backup did."""

    action: str  # "in sync", "restored", "uploaded", "fresh"
    values: int
    seconds: float


class PartitionBackup:
    """The backup of one owned partition: the sequence of its batches and its next update."""

    def __init__(
        self, broker: Broker, group: str, topic: str, partition: int, lease_key: str, lease_value: str
    ) -> None:
        self.broker = broker
        self.group = group
        self.topic = topic
        self.stream = keys.stream_key(topic, partition)
        self.key = keys.backup_key(topic, partition, group)
        self.meta_key = keys.backup_meta_key(topic, partition, group)
        self.lease_key = lease_key
        self.lease_value = lease_value
        self.token = lease_value.rpartition("|")[2]
        self.seq = 0
        #: the identity the next call sets ("" when no batch committed since the last one)
        self.identity = ""
        self.journal = Journal()
        self._last: tuple[dict[tuple[str, str], bytes | None], dict[str, StreamId], str] = ({}, {}, "")

    # -- per batch ------------------------------------------------------------------------------

    def next_identity(self) -> str:
        """The identity of a batch about to commit: this owner's token, the next sequence number."""
        self.seq += 1
        self.identity = f"{self.token}-{self.seq}"
        return self.identity

    def update(self) -> BackupUpdate | None:
        """The writes journaled since the last call, as a backup update (None when nothing)."""
        if not self.journal and not self.identity:
            return None
        updates, checkpoints = self.journal.take()
        sets = [
            (field(ns, key), value)
            for (ns, key), value in updates.items()
            if value is not None and ns != BACKUP_NAMESPACE
        ]
        deletes = [
            field(ns, key) for (ns, key), value in updates.items() if value is None and ns != BACKUP_NAMESPACE
        ]
        update = BackupUpdate(
            self.key, self.meta_key, self.identity, {t: str(c) for t, c in checkpoints.items()}, sets, deletes
        )
        self.identity = ""
        self._last = (updates, checkpoints, update.identity)
        return update

    def not_sent(self) -> None:
        """The last update's call may not have run: its writes go again with the next one."""
        updates, checkpoints, identity = self._last
        self.journal.give_back(updates, checkpoints)
        self.identity = self.identity or identity

    def request(
        self, ids: Sequence[bytes] = (), dlq: str = "", dead: Sequence[tuple[bytes, Fields]] = ()
    ) -> AckRequest:
        """The acknowledging call of the backup's stream, carrying the backup update."""
        return AckRequest(
            self.stream, self.group, self.lease_key, self.lease_value, ids, dlq, dead, self.update()
        )

    def flush(self) -> None:
        """Send the journaled writes now (before Redis changes in a way that depends on them)."""
        if not self.journal and not self.identity:
            return
        request = self.request()
        try:
            self._send(request)
        except BaseException:
            self.not_sent()
            raise

    # -- at takeover ----------------------------------------------------------------------------

    def reconcile(self, store: StateStore, topics: Iterable[str]) -> Restored:
        """Make the store equal to the backup (or the backup to the store, when there is none)."""
        started = time.perf_counter()
        meta = self.broker.backup_meta(self.meta_key)
        backup_identity = meta.get(BACKUP_IDENTITY, "")
        local = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
        local_identity = "" if local is None else local.decode()
        if not backup_identity:
            values = self._upload(store)
            action = "uploaded" if values or store.checkpoints() else "fresh"
            return Restored(action, values, time.perf_counter() - started)
        self.seq = int(backup_identity.rpartition("-")[2])
        if local_identity == backup_identity:
            return Restored("in sync", 0, time.perf_counter() - started)
        values = self._restore(store, meta, backup_identity, topics)
        return Restored("restored", values, time.perf_counter() - started)

    def _restore(self, store: StateStore, meta: dict[str, str], identity: str, topics: Iterable[str]) -> int:
        checkpoints: dict[str, StreamId | None] = {t: None for t in [*topics, *store.checkpoints()]}
        checkpoints.update({k[3:]: StreamId.parse(v) for k, v in meta.items() if k.startswith("cp:")})
        # Cleared first, identity last: a crash in between leaves no identity, so the next
        # takeover restores again.
        store.rewind(keys.STORE_NAMESPACES, checkpoints)
        values = 0
        for page in self.broker.backup_values(self.key, CHUNK):
            with store.transaction() as tx:
                for raw, value in page:
                    namespace, key = split_field(raw)
                    tx.set(namespace, key, value)
            values += len(page)
        with store.transaction() as tx:
            tx.set(BACKUP_NAMESPACE, BACKUP_IDENTITY, identity.encode())
        return values

    def _upload(self, store: StateStore) -> int:
        """Copy a whole store into an empty backup under a new identity (the store's first)."""
        identity = self.next_identity()
        self.identity = ""
        with store.transaction() as tx:
            tx.set(BACKUP_NAMESPACE, BACKUP_IDENTITY, identity.encode())
        checkpoints, rows = store.dump()
        pages: list[list[tuple[bytes, bytes]]] = [[]]
        for namespace, key, value in rows:  # consumed before the first call: the store is free
            if namespace != BACKUP_NAMESPACE:
                if len(pages[-1]) == CHUNK:
                    pages.append([])
                pages[-1].append((field(namespace, key), value))
        for index, page in enumerate(pages):
            last = index == len(pages) - 1
            update = BackupUpdate(
                self.key,
                self.meta_key,
                identity if last else "",  # set last: a backup without one is uploaded again
                {t: str(c) for t, c in checkpoints.items()} if last else {},
                page,
                [],
                replace=index == 0,
            )
            self._send(
                AckRequest(self.stream, self.group, self.lease_key, self.lease_value, [], "", (), update)
            )
        return sum(len(page) for page in pages)

    def _send(self, request: AckRequest) -> None:
        (reply,) = self.broker.ack([request])
        if isinstance(reply, LeaseLost):
            raise reply


def delete_backup(broker: Broker, topic: str, partition: int, group: str) -> None:
    """Forget a partition's backup (it would go stale while the backup is off)."""
    broker.delete_backup(
        keys.backup_key(topic, partition, group), keys.backup_meta_key(topic, partition, group)
    )
