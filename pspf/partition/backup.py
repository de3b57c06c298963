"""The state backup: each partition's state kept in Redis, so it follows the partition anywhere.

The contract:

- Keys (``keys.backup_keys``), on the hash tag of the app's FIRST topic's partition: a hash of
  every value the partition's store holds (field ``namespace NUL key``; the memory it takes is
  about the encoded state's size), a meta hash with the identity and the checkpoint of every topic
  (``cp:TOPIC``), and a log: a stream of the last updates (about as many as hold as many values
  as the backup, from ``BACKUP_LOG_MIN`` to ``BACKUP_LOG_LENGTH``: ``acking.log_length``), each
  with the identity it follows, the one it sets and the update, packed in one field.
- Identity: every transaction an owner commits to its store is stamped with a new identity (its
  fencing token and a sequence number, ``state_stores.Journal``), in the same write. A store and
  a backup with the same identity hold the same values.
- Order per batch: the local commit holds the batch's writes, checkpoints and identity; then ONE
  atomic call checks the lease, updates the backup with every write the store journaled since the
  last call, sets the identity, logs the update, acknowledges the batch and moves its dead entries
  to the DLQ (``Acknowledging.ack``: a MULTI/EXEC under WATCHed leases, or ``lua/ack.lua``). Nothing is
  acknowledged before the backup holds the batch's effects, and an ex-owner whose lease moved can
  change none of it.
- A crash between the two leaves the local store ahead of the backup with the entries still
  pending. At takeover (``PartitionBackup.reconcile``) the store's identity is compared with the
  backup's: equal, the store is used as it is; one the log leads from (a store some updates
  behind), the store catches up from the log; any other (a new machine, a store ahead by a call
  that never ran, one from another owner's history, or too far behind), the store is rebuilt from
  the whole backup before any entry is applied. The backup is the truth. With no backup yet (a
  first run, or one after the backup was off), the store is uploaded.
- An app that reads several topics keeps one store per partition, so one backup: the call for
  its first topic carries it, and the other topics' acknowledgements are sent only once that
  call succeeded (a second round trip, needed because their streams can be on other nodes), so
  nothing of theirs is acknowledged before the backup holds it either.
- Writes outside a batch (takeover bookkeeping, confirmed DLQ moves) are stamped and journaled
  like a batch and go with the next call; those that must reach the backup before Redis changes
  (entries marked before they are claimed) are sent at once (``flush``).
- Readers that do not hold the lease (a warm standby, ``pspf state export``) read the whole
  backup, which its owner may change meanwhile, and then apply the log from the position read
  atomically with the meta before: every value the scan may have caught mid-change is set again
  by a later update (``LogReader``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from pspf import keys
from pspf.broker import Acknowledging, AckRequest, BackupUpdate, Fields
from pspf.errors import BackupDamaged, BrokerError, LeaseLost, StateError
from pspf.keys import (
    BACKUP_ADOPTED,
    BACKUP_BUCKETS,
    BACKUP_IDENTITY,
    BACKUP_MARK,
    BACKUP_MARKED,
    BACKUP_NAMESPACE,
    BACKUP_PARTITIONS,
    ZERO_ID,
    BackupKeys,
    StreamId,
)
from pspf.partition.adoption import adoption_of, refuse_later, trusted_identity
from pspf.state_stores.base import Journal
from pspf.state_stores.base import field as field
from pspf.state_stores.base import split_field as split_field

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.backup")

#: Values per Lua call when a whole store is uploaded, and per HSCAN page when a backup is read.
CHUNK = 5_000
#: Log entries per read.
LOG_PAGE = 200

Updates = dict[tuple[str, str], bytes | None]


def _order(identity: str) -> tuple[int, int] | None:
    """An owner's identity ``token-seq`` as numbers (later owners have larger tokens)."""
    token, _, seq = identity.rpartition("-")
    return (int(token), int(seq)) if token.isdigit() and seq.isdigit() else None


class Restored(NamedTuple):
    """What reconciling a store with the backup did."""

    #: "in sync", "caught up", "restored"; "missing" and "damaged" (the store is to be uploaded,
    #: once it is known not to be behind its group: ``PartitionBackup.upload``, which says
    #: "uploaded", or "fresh" for a store with nothing yet)
    action: str
    #: values restored or uploaded; updates applied when caught up
    amount: int
    seconds: float


class LogGap(Exception):
    """The log does not lead on from where a reader stands (trimmed, or the backup was replaced)."""


class LogUpdate(NamedTuple):
    """One update of the backup, as its log holds it: what a store applies to follow it."""

    identity: str
    checkpoints: dict[str, StreamId]
    #: (namespace, key) -> value, None deletes; includes the identity itself
    updates: Updates


_log_decoder = msgspec.msgpack.Decoder(tuple[dict[str, str], list[bytes], list[bytes]])


class _Entry(NamedTuple):
    prev: str
    identity: str
    data: bytes | None


def _entry(fields: Fields) -> _Entry:
    return _Entry(fields.get(b"prev", b"").decode(), fields.get(b"id", b"").decode(), fields.get(b"data"))


def _update(entry_id: bytes, entry: _Entry) -> LogUpdate:
    """A log entry's update (``broker.log_data``); LogGap when it has none it can read."""
    try:
        if entry.data is None:
            raise msgspec.DecodeError("no data")
        checkpoints, sets, deletes = _log_decoder.decode(entry.data)
    except msgspec.DecodeError as exc:  # e.g. written in another layout: restore instead
        raise LogGap(f"log entry {entry_id.decode()} cannot be read: {exc}") from None
    updates: Updates = {(BACKUP_NAMESPACE, BACKUP_IDENTITY): entry.identity.encode()}
    for k in range(0, len(sets), 2):
        updates[split_field(sets[k])] = sets[k + 1]
    for name in deletes:
        updates[split_field(name)] = None
    return LogUpdate(entry.identity, {t: StreamId.parse(c) for t, c in checkpoints.items()}, updates)


class LogReader:
    """Reads updates from a backup's log after a position, each checked to follow the last."""

    def __init__(self, acks: Acknowledging, log_key: str, after: bytes, identity: str) -> None:
        self.acks = acks
        self.log_key = log_key
        self.after = after
        #: the identity of the last update read (where the reader stands)
        self.identity = identity

    def read(self, count: int = LOG_PAGE) -> list[LogUpdate]:
        """The next updates (none when the log has nothing more yet); LogGap on a break."""
        done: list[LogUpdate] = []
        for entry_id, fields in self.acks.backup_log(self.log_key, self.after, count):
            entry = _entry(fields)
            if entry.prev != self.identity:
                raise LogGap(f"log entry {entry_id.decode()} follows {entry.prev!r}, not {self.identity!r}")
            done.append(_update(entry_id, entry))
            self.after = entry_id
            self.identity = entry.identity
        return done


def meta_checkpoints(meta: dict[str, str]) -> dict[str, StreamId]:
    """The checkpoints a backup's meta holds (``cp:TOPIC``)."""
    return {k[3:]: StreamId.parse(v) for k, v in meta.items() if k.startswith("cp:")}


def locate(acks: Acknowledging, backup: BackupKeys, identity: str) -> LogReader | None:
    """A reader of the log from where a store at ``identity`` stands; None when it cannot lead there."""
    meta, last = acks.backup_head(backup)
    current = meta.get(BACKUP_IDENTITY, "")
    if not identity or not current:
        return None
    if current == identity:
        return LogReader(acks, backup.log, last or str(ZERO_ID).encode(), identity)
    wanted = _order(identity)
    before: bytes | None = None
    while True:
        page = acks.backup_log_before(backup.log, before, LOG_PAGE)
        for entry_id, fields in page:
            entry = _entry(fields)
            if entry.identity == identity:
                return LogReader(acks, backup.log, entry_id, identity)
            if entry.prev == identity:
                return LogReader(
                    acks, backup.log, str(StreamId.parse(entry_id).previous()).encode(), identity
                )
            found = _order(entry.identity)
            if wanted is not None and found is not None and found < wanted:
                return None  # older than the store: the store is from a history the log left
        if len(page) < LOG_PAGE:
            return None
        before = page[-1][0]


def catch_up(store: StateStore, reader: LogReader, until: str | None = None, pages: int | None = None) -> int:
    """Apply the log's updates to the store, each in one write; the number applied.

    Reads until the log has no more, until the update that sets ``until``, or ``pages`` reads.
    """
    applied = 0
    while reader.identity != until and (pages is None or pages > 0):
        if pages is not None:
            pages -= 1
        updates = reader.read()
        if not updates:
            break
        for update in updates:
            store.write(update.updates, update.checkpoints)
            applied += 1
            if update.identity == until:
                break
    return applied


def restore(
    acks: Acknowledging,
    backup: BackupKeys,
    store: StateStore,
    topics: Iterable[str],
    go_on: Callable[[], bool] = lambda: True,
    *,
    owner: tuple[str, int] | None = None,
) -> tuple[int, LogReader] | None:
    """Rebuild the store from the whole backup: the values copied and a reader of the log after.

    ``go_on`` is called between pages (a long restore renews the leases there). None when there
    is no backup, or when ``go_on`` said to stop (the store then has no identity: it is restored
    again next time). When the owner wrote meanwhile, the store equals the backup once the
    reader's updates are applied. A store later than the state adopted after a loss is refused
    (``adoption.refuse_later``; ``owner``, the app and partition, names them in the message).
    """
    meta, last = acks.backup_head(backup)
    identity = meta.get(BACKUP_IDENTITY, "")
    if not identity:
        return None
    adoption = adoption_of(meta)
    if owner is None:
        refuse_later(store, adoption, f"the state backup {backup.values}")
    else:
        refuse_later(store, adoption, f"app {owner[0]!r} partition {owner[1]}", owner[0])
    checkpoints: dict[str, StreamId | None] = {t: None for t in [*topics, *store.checkpoints()]}
    checkpoints.update(meta_checkpoints(meta))
    values = 0
    stopped = False

    def pages() -> Iterator[list[tuple[bytes, bytes]]]:
        nonlocal values, stopped
        with closing(acks.backup_values(backup, CHUNK)) as scan:
            for page in scan:
                if not go_on():
                    stopped = True
                    return
                values += len(page)
                yield page  # as the hash holds it: the store splits the names only if it must

    # Cleared first, identity last: a crash in between leaves no identity, so the next takeover
    # restores again.
    store.load(keys.STORE_NAMESPACES, checkpoints, pages())
    if stopped:
        return None
    done: Updates = {(BACKUP_NAMESPACE, BACKUP_IDENTITY): identity.encode()}
    if adoption is not None:  # the store follows the adopted history from now on
        done[(BACKUP_NAMESPACE, BACKUP_ADOPTED)] = adoption.id.encode()
    store.write(done, {})
    return values, LogReader(acks, backup.log, last or str(ZERO_ID).encode(), identity)


class PartitionBackup:
    """The backup of one owned partition: its journal and its next update."""

    def __init__(
        self,
        acks: Acknowledging,
        group: str,
        topic: str,
        partition: int,
        lease_key: str,
        lease_value: str,
        partitions: int | None = None,
        buckets: int = 1,
    ) -> None:
        self.acks = acks
        self.group = group
        self.topic = topic
        self.partition = partition
        #: the partition count the state is built for, recorded in the meta by every upload
        self.partitions = partitions
        self.stream = keys.stream_key(topic, partition)
        self.keys = keys.backup_keys(topic, partition, group)
        self.lease_key = lease_key
        self.lease_value = lease_value
        #: the hashes the backup's values are spread over now (its meta says, at takeover), and
        #: how many an upload spreads them over
        self.buckets = 1
        self.wanted_buckets = buckets
        self.journal = Journal(lease_value.rpartition("|")[2])
        self._last: tuple[Updates, dict[str, StreamId]] = ({}, {})
        #: the identities the backup may hold now, as far as this owner knows: the last one sent,
        #: and those of calls that may or may not have run (empty before the takeover's reconcile)
        self.held: set[str] = set()
        self._pending = ""
        #: the owner's store (set when it is reconciled with the backup)
        self.store: StateStore | None = None

    # -- per batch ------------------------------------------------------------------------------

    def update(self) -> BackupUpdate | None:
        """The writes journaled since the last call, as a backup update (None when nothing)."""
        if not self.journal:
            return None
        updates, checkpoints = self.journal.take()
        stamped = updates.get((BACKUP_NAMESPACE, BACKUP_IDENTITY))
        sets: list[bytes] = []
        deletes: list[bytes] = []
        for (ns, key), value in updates.items():  # one pass: this runs for every batch
            if ns == BACKUP_NAMESPACE:
                continue
            name = f"{ns}\x00{key}".encode()
            if value is None:
                deletes.append(name)
            else:
                sets += (name, value)
        self._last = (updates, checkpoints)
        self._pending = "" if stamped is None else stamped.decode()
        return BackupUpdate(
            self.keys,
            self._pending,
            {t: str(c) for t, c in checkpoints.items()},
            sets,
            deletes,
            follows=frozenset(self.held),
            buckets=self.buckets,
        )

    def sent(self) -> None:
        """The last update's call ran: the backup holds its identity now."""
        if self._pending:
            self.held = {self._pending}
            self._pending = ""

    def not_sent(self) -> None:
        """The last update's call may not have run: its writes go again with the next one."""
        self.journal.give_back(*self._last)
        if self._pending:
            self.held.add(self._pending)
            self._pending = ""

    def went_back(self, last_id_up_to: Callable[[str, StreamId], bytes | None]) -> bool:
        """Whether the backup no longer holds what this owner sent it (a fail-over lost writes).

        A backup at a later owner's identity (a larger token: the lease expired and moved while
        this worker was cut off) went on, not back: the worker lost the partition, Redis nothing.
        A backup at an identity this owner sent may still be behind the store, by a call whose
        reply was never read or one not yet sent: its writes go again with the next call, which
        is right only while the server still holds the entries they came from. The entry a
        store's checkpoint names gone while earlier ones remain (``last_id_up_to``, the stream's
        last id at or before an id) means the server lost it with the call: that went back too.
        """
        meta = self.acks.backup_meta(self.keys.meta)
        identity = meta.get(BACKUP_IDENTITY, "")
        if not self.held:
            return False
        if identity in self.held:
            return self._lost_entries(meta_checkpoints(meta), last_id_up_to)
        order, token = _order(identity), self.journal.token
        return order is None or not token.isdigit() or order[0] <= int(token)

    def _lost_entries(
        self, backed: dict[str, StreamId], last_id_up_to: Callable[[str, StreamId], bytes | None]
    ) -> bool:
        """Whether an entry the store applied beyond the backup's checkpoint is gone from its stream."""
        if self.store is None:
            return False
        for topic, checkpoint in self.store.checkpoints().items():
            if topic in backed and backed[topic] >= checkpoint:
                continue
            found = last_id_up_to(keys.stream_key(topic, self.partition), checkpoint)
            if found is not None and StreamId.parse(found) != checkpoint:
                return True
        return False

    def request(
        self, ids: Iterable[bytes] = (), dlq: str = "", dead: Iterable[tuple[bytes, Fields]] = ()
    ) -> AckRequest:
        """The acknowledging call of the backup's stream, carrying the backup update."""
        return AckRequest(
            self.stream,
            self.group,
            self.lease_key,
            self.lease_value,
            list(ids),
            dlq,
            list(dead),
            self.update(),
        )

    def flush(self) -> None:
        """Send the journaled writes now (before Redis changes in a way that depends on them)."""
        if not self.journal:
            return
        request = self.request()
        try:
            self._send(request)
        except BaseException:
            self.not_sent()
            raise
        self.sent()

    # -- at takeover ----------------------------------------------------------------------------

    def reconcile(
        self, store: StateStore, topics: Iterable[str], keep_alive: Callable[[], None] = lambda: None
    ) -> Restored:
        """Make the store equal to the backup; "missing" or "damaged" when the store must be uploaded.

        Uploading is left to the caller: only a store known not to be behind its consumer group
        may become the backup (a refused takeover must not replace the only good copy). A damaged
        backup (its values hash gone, its meta kept) is refused unless this store is current: at
        the backup's identity or ahead of it in the same owner's history.
        ``keep_alive`` is called between the pages of a restore: one that lasts longer than the
        lease must renew it there (it raises LeaseLost when the lease is gone).
        """
        started = time.perf_counter()
        self.store = store
        meta = self.acks.backup_meta(self.keys.meta)
        backup_identity = meta.get(BACKUP_IDENTITY, "")
        local_identity = trusted_identity(store, adoption_of(meta))
        if not backup_identity:
            return Restored("missing", 0, time.perf_counter() - started)
        # Identities stay unique even when the fencing token was reset by hand.
        order = _order(backup_identity)
        self.journal.seq = order[1] if order is not None else 0
        self.buckets = int(meta.get(BACKUP_BUCKETS) or 1)
        if (
            meta.get(BACKUP_MARKED)
            and self.acks.backup_value(self.keys, BACKUP_MARK) != backup_identity.encode()
        ) or self.acks.lost_buckets(self.keys):
            if not _current(local_identity, backup_identity):
                raise StateError(self._damaged(local_identity, backup_identity))
            return Restored("damaged", 0, time.perf_counter() - started)
        self.held = {backup_identity}  # the store is made equal to it below
        if local_identity == backup_identity:
            return Restored("in sync", 0, time.perf_counter() - started)
        reader = locate(self.acks, self.keys, local_identity)
        if reader is not None:
            try:
                applied = catch_up(store, reader, until=backup_identity)
            except LogGap:
                applied = -1
            if applied >= 0 and reader.identity == backup_identity:
                return Restored("caught up", applied, time.perf_counter() - started)

        def go_on() -> bool:
            keep_alive()
            return True

        restored = restore(self.acks, self.keys, store, topics, go_on, owner=(self.group, self.partition))
        if restored is None:  # the backup went while we looked: only a stopped app's is deleted
            raise BrokerError(f"the state backup {self.keys.values} vanished during a takeover")
        return Restored("restored", restored[0], time.perf_counter() - started)

    def _damaged(self, local_identity: str, backup_identity: str) -> str:
        return (
            f"the state backup of app {self.group!r} partition {self.keys.values} is damaged: its values "
            f"hash (or one of its buckets) is missing or not at the identity its meta holds "
            f"({backup_identity}), deleted by hand or evicted. This state dir's store is at "
            f"{local_identity or 'no identity'}, so it cannot stand in for it. Nothing was processed. "
            "Run the worker with the state dir that last owned the partition (its store is at that "
            "identity or after it): it uploads its store again; or replay the app (pspf replay) to "
            "rebuild its state from the stream"
        )

    def upload(self, store: StateStore, keep_alive: Callable[[], None] = lambda: None) -> Restored:
        """Make the whole store the backup, under a new identity (a backup missing or damaged)."""
        started = time.perf_counter()
        values = self._upload(store, keep_alive)
        action = "uploaded" if values or store.checkpoints() else "fresh"
        return Restored(action, values, time.perf_counter() - started)

    def repaired(self, request: AckRequest) -> tuple[int, int] | LeaseLost:
        """Upload the store after the backup was found damaged, then acknowledge without an update.

        Only the owner calls it, under its lease: its store holds every batch the backup held and
        the ones after, so it is current and the whole of it replaces what is left.
        """
        log.error(
            "the state backup %s is damaged (its values hash is gone or not at its meta's identity: "
            "deleted or evicted): uploading the whole store again",
            self.keys.values,
        )
        self._pending = ""
        assert self.store is not None
        self._upload(self.store, lambda: None)
        if not request.ids and not request.dead:
            return (0, 0)
        (reply,) = self.acks.ack([request._replace(backup=None)])
        return reply

    def _upload(self, store: StateStore, keep_alive: Callable[[], None]) -> int:
        """Copy a whole store into an empty backup under a new identity (the store's first).

        The backup's adoption record (``pspf.partition.adoption``) stays: the owner's store follows it.
        """
        adopted = self.acks.backup_meta(self.keys.meta).get(BACKUP_ADOPTED)
        stale = self.acks.backup_layout(self.keys)[0][1:]
        buckets = self.wanted_buckets
        stamped: Updates = {}
        self.journal.stamp(stamped)
        identity = stamped[(BACKUP_NAMESPACE, BACKUP_IDENTITY)]
        assert identity is not None
        store.write(stamped, {})
        checkpoints, rows = store.dump()
        pages: list[list[bytes]] = [[]]
        for namespace, key, value in rows:  # consumed before the first call: the store is free
            if namespace != BACKUP_NAMESPACE:
                if len(pages[-1]) == 2 * CHUNK:
                    pages.append([])
                pages[-1] += (field(namespace, key), value)
        for index, page in enumerate(pages):
            keep_alive()
            last = index == len(pages) - 1
            update = BackupUpdate(
                self.keys,
                identity.decode() if last else "",  # set last: a backup without one is uploaded again
                {t: str(c) for t, c in checkpoints.items()} if last else {},
                page,
                [],
                mode="replace" if index == 0 else "upload",
                buckets=buckets,
                layout=identity.decode() if index == 0 and buckets > 1 else "",
                stale=stale if index == 0 else (),
            )
            self._send(
                AckRequest(self.stream, self.group, self.lease_key, self.lease_value, [], "", (), update)
            )
        self.held = {identity.decode()}
        self.buckets = buckets
        if self.partitions is not None:  # the first page emptied the meta
            self.acks.set_backup_field(self.keys.meta, BACKUP_PARTITIONS, str(self.partitions))
        if adopted is not None:
            self.acks.set_backup_field(self.keys.meta, BACKUP_ADOPTED, adopted)
        return sum(len(page) for page in pages) // 2

    def _send(self, request: AckRequest) -> None:
        (reply,) = self.acks.ack([request])
        if isinstance(reply, BackupDamaged):
            reply = self.repaired(request)
        if isinstance(reply, LeaseLost):
            raise reply


def _current(local: str, backup: str) -> bool:
    """Whether a store at identity ``local`` holds all a backup at ``backup`` held.

    So when equal, or ahead in the same owner's history (the same fencing token: no later owner
    wrote the backup since, so the store's extra batches are its own, their entries unacknowledged).
    """
    mine, theirs = _order(local), _order(backup)
    return local == backup or (
        mine is not None and theirs is not None and mine[0] == theirs[0] and mine >= theirs
    )


def delete_backup(acks: Acknowledging, topic: str, partition: int, group: str) -> None:
    """Forget a partition's backup (it would go stale while the backup is off)."""
    acks.delete_backup(keys.backup_keys(topic, partition, group))
