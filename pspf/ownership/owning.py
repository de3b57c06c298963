"""Owning a partition: its leases, and taking it on and giving it up.

A worker owns partition ``p`` of its app when it holds the lease of ``p`` on every topic the app
reads (one store per (app, p) holds the state of all those topics). A lease has a time to live,
is renewed while the worker runs and released when it stops; its value carries a fencing token
that the acknowledging Lua call checks, so an ex-owner can no longer acknowledge.

Taking a partition on (``Partitions.take``): open its store, check each stream against the
store's checkpoint (a stream that went back below it is refused; a vanished group is re-created
at it), load the store's bookkeeping, and claim every pending entry of the partition's streams,
marking first the ones a foreign consumer took (they were never applied, even at or below the
checkpoint). Only then does the batch processor get the partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from pspf import keys
from pspf.broker import Broker, Leasing, StreamInfo
from pspf.errors import BrokerDataLost, StateError
from pspf.keys import BACKUP_NAMESPACE, BACKUP_PARTITIONS, StreamId
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.partition.backup import PartitionBackup, Restored, delete_backup
from pspf.partition.durability import flush
from pspf.partition.owned import OwnedPartition, StreamCursor, check_tail, went_back
from pspf.settings import StateSettings

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.ownership")

#: topic -> lease value held for one partition
Leases = dict[str, str]
#: Opens the store of (app, partition).
StoreFactory = Callable[[str, int], "StateStore"]


class Takeable(NamedTuple):
    """What a look at the leases of partitions a worker should own found."""

    #: the partitions whose leases are free now
    free: list[int]
    #: the owner ids (member ids) of the workers holding the others' leases
    holders: set[str]


class PartitionLeases:
    """Acquires, renews and releases the leases of one group's partitions."""

    def __init__(self, leasing: Leasing, group: str, topics: list[str], owner: str, ttl_ms: int) -> None:
        self.leasing = leasing
        self.group = group
        self.topics = topics
        self.owner = owner
        self.ttl_ms = ttl_ms

    def acquire(self, partition: int) -> Leases | None:
        """Take the partition's lease on every topic, or none of them."""
        held: Leases = {}
        for topic in self.topics:
            value = self.leasing.acquire_lease(
                keys.lease_key(topic, partition, self.group),
                keys.fence_key(topic, partition, self.group),
                self.owner,
                self.ttl_ms,
            )
            if value is None:
                self.release(partition, held)
                return None
            held[topic] = value
        return held

    def takeable(self, partitions: list[int]) -> Takeable:
        """Which of ``partitions`` have free leases (or ours without our knowing it); who holds the rest.

        A lease call that timed out on our side may still have been applied by the server (after
        a stall): such a lease carries our owner id but we do not hold it, and nobody would work
        the partition until it expires. It is released here, so it can be taken again now.
        """
        pairs = [(p, keys.lease_key(topic, p, self.group)) for p in partitions for topic in self.topics]
        values = self.leasing.lease_values([key for _, key in pairs])
        orphans: list[tuple[str, str]] = []
        busy: set[int] = set()
        holders: set[str] = set()
        for (partition, key), value in zip(pairs, values, strict=True):
            if value is None:
                continue
            holder = value.rpartition("|")[0]
            if holder == self.owner:
                orphans.append((key, value))
            else:
                busy.add(partition)
                holders.add(holder)
        if orphans:
            log.warning("releasing leases of ours that a timed-out call took: %s", [k for k, _ in orphans])
            self.leasing.release_leases(orphans)
        return Takeable([p for p in partitions if p not in busy], holders)

    def renew(self, held: dict[int, Leases]) -> list[int]:
        """Extend every held lease; the partitions whose lease was lost (the caller says so)."""
        pairs = [
            (partition, keys.lease_key(topic, partition, self.group), value)
            for partition, leases in held.items()
            for topic, value in leases.items()
        ]
        renewed = self.leasing.renew_leases([(key, value) for _, key, value in pairs], self.ttl_ms)
        return sorted({partition for (partition, _, _), ok in zip(pairs, renewed, strict=True) if not ok})

    def holders(self, partition: int) -> set[str]:
        """The owner ids holding the partition's leases now (empty when they are all free)."""
        found = self.leasing.lease_holders([keys.lease_key(t, partition, self.group) for t in self.topics])
        return {holder for holder in found if holder}

    def held_by(self, holder: str, partitions: int) -> list[int]:
        """The partitions (of ``partitions``) of which ``holder`` holds a lease."""
        pairs = [(p, keys.lease_key(t, p, self.group)) for p in range(partitions) for t in self.topics]
        found = self.leasing.lease_holders([key for _, key in pairs])
        return sorted({p for (p, _), h in zip(pairs, found, strict=True) if h == holder})

    def release(self, partition: int, leases: Leases) -> None:
        if leases:
            self.leasing.release_leases(
                [(keys.lease_key(topic, partition, self.group), value) for topic, value in leases.items()]
            )


def check_partition_count(
    group: str, topics: list[str], recorded: bytes | str | int | None, count: int, where: str
) -> None:
    """Refuse state built for another partition count: its keys would be in other partitions."""
    if recorded is None or int(recorded) == count:
        return
    names = ", ".join(repr(t) for t in topics)
    raise StateError(
        f"the state of app {group!r} was built for {int(recorded)} partitions ({where} says so) but "
        f"topic {names} has {count} partitions now: the count was changed behind PSPF's back (a "
        "topic deleted and created again). Keys would land in partitions whose state does not "
        f"hold them, so nothing was processed. Create the topic again with {int(recorded)} "
        "partitions"
    )


def adopt_remedy(app: str) -> str:
    """What an operator does when Redis lost an app's data (``BrokerDataLost``)."""
    return (
        "Nothing was processed. To keep the stores' state and go on with what the server holds "
        f"now, run `pspf state adopt {app}` on every machine that holds stores of the app (in any "
        "order: each partition keeps its latest store), then "
        "start the workers"
    )


#: How often an owner looks at its partitions' idle consumers (``Partitions.forget_consumers``).
FORGET_EVERY_S = 600.0


class Partitions:
    """Takes partitions on for one worker of an app (the leases are already held)."""

    def __init__(
        self,
        broker: Broker,
        group: str,
        consumer: str,
        open_store: StoreFactory,
        topics: list[str],
        state: StateSettings | None = None,
    ) -> None:
        self.broker = broker
        self.group = group
        self.consumer = consumer
        self.open_store = open_store
        #: the app's topics; the first one's partitions carry the state backup
        self.topics = topics
        state = state or StateSettings()
        self.backup = state.backup == "on"
        #: the hashes each backup spreads its values over (``StateSettings.backup_buckets``)
        self.buckets = state.backup_buckets
        #: partition -> when (monotonic) its idle consumers are looked at next
        self._forget_at: dict[int, float] = {}

    def forget_due(self, partition: int) -> bool:
        """Whether it is time to look at a partition's idle consumers (every FORGET_EVERY_S)."""
        now = time.monotonic()
        if now < self._forget_at.get(partition, 0.0):
            return False
        self._forget_at[partition] = now + FORGET_EVERY_S
        return True

    def take(
        self, partition: int, leases: Leases, count: int, keep_alive: Callable[[], None] = lambda: None
    ) -> OwnedPartition:
        """Open the partition's store, check its streams and claim their pending entries.

        ``count`` is the topics' partition count now: state built for another count is refused.
        The store is made equal to the backup first; only a store known not to be behind its
        consumer group becomes the backup (where there is none, or it is damaged).
        An entry pending at a consumer outside the store's history, at or below the checkpoint,
        was never applied here (a foreign consumer of the group took it): it is marked, durably
        and before the claim, so it runs. A store from before the history was kept (checkpoints
        but no history) trusts every consumer, as it did then. ``keep_alive`` renews the leases
        during a long restore (it raises LeaseLost when one is gone).
        """
        store = self.open_store(self.group, partition)
        try:
            self._check_store_count(store, partition, count)
            backup, done = self._reconcile(store, partition, leases, count, keep_alive)
            checkpoints = store.checkpoints()
            streams = {}
            for topic, lease_value in leases.items():
                stream = keys.stream_key(topic, partition)
                lost = backup is not None and done.action == "missing"
                info = self.check_stream(stream, checkpoints.get(topic), backup_lost=lost)
                self._refuse_behind(stream, info, partition, topic, checkpoints.get(topic))
                streams[stream] = StreamCursor(
                    topic=topic,
                    partition=partition,
                    stream=stream,
                    dlq=keys.dlq_key(topic, partition),
                    lease_key=keys.lease_key(topic, partition, self.group),
                    lease_value=lease_value,
                    checkpoint=checkpoints.get(topic),
                )
            if backup is not None:
                self._settle_backup(backup, store, done, keep_alive, count)
            store.write({(BACKUP_NAMESPACE, BACKUP_PARTITIONS): str(count).encode()}, {})
            outbox = PartitionOutbox(store, self.group, partition, self.consumer)
            owned = OwnedPartition(partition, store, streams, outbox, backup=backup)
            owned.load_bookkeeping()
            self._claim_pending(owned)
        except BaseException:
            store.close()
            raise
        log.info("partition assigned app=%s partition=%s checkpoints=%s", self.group, partition, checkpoints)
        return owned

    def _check_count(self, recorded: bytes | str | None, count: int, where: str) -> None:
        check_partition_count(self.group, self.topics, recorded, count, where)

    def _check_store_count(self, store: StateStore, partition: int, count: int) -> None:
        """Refuse a store built for another count, unless a repartition rebuilt the backup for this one.

        Then the store is of the old layout: its keys belong to other partitions now. It is
        cleared, so the backup restores it whole; it is never trusted.
        """
        recorded = store.get(BACKUP_NAMESPACE, BACKUP_PARTITIONS)
        if recorded is None or int(recorded) == count or not self.backup:
            self._check_count(recorded, count, "its store")
            return
        meta = self.broker.acks.backup_meta(keys.backup_keys(self.topics[0], partition, self.group).meta)
        if meta.get(BACKUP_PARTITIONS) != str(count):
            self._check_count(recorded, count, "its store")
            return
        log.info(
            "the store of app %s partition %s was built for %s partitions; the topic was "
            "repartitioned to %s: restoring it from the state backup",
            self.group,
            partition,
            int(recorded),
            count,
        )
        store.rewind(keys.STORE_NAMESPACES, dict.fromkeys(store.checkpoints()))

    def _claim_pending(self, owned: OwnedPartition) -> None:
        legacy = not owned.consumers and any(c.checkpoint is not None for c in owned.streams.values())
        marks = {
            cursor: [
                pending.id
                for pending in self.broker.reading.pending_entries(
                    cursor.stream, self.group, cursor.checkpoint
                )
                if pending.consumer not in owned.consumers
            ]
            for cursor in owned.streams.values()
            if cursor.checkpoint is not None and not legacy
        }
        owned.mark_foreign(marks, self.consumer)
        _flushed(owned)  # the marks and our name, in the backup before anything is claimed
        for cursor in owned.streams.values():
            claimed, _ = self.broker.reading.claim_idle(cursor.stream, self.group, self.consumer, 0)
            if claimed:
                log.info(
                    "claimed %s pending entries of earlier consumers stream=%s (%s never applied here)",
                    len(claimed),
                    cursor.stream,
                    len(marks.get(cursor, ())),
                )

    def _reconcile(
        self,
        store: StateStore,
        partition: int,
        leases: Leases,
        count: int,
        keep_alive: Callable[[], None],
    ) -> tuple[PartitionBackup | None, Restored]:
        """Make the store equal to the partition's backup (see ``pspf.partition.backup``).

        With the backup off, the backup is dropped instead: it would go stale.
        """
        topic = self.topics[0]
        if not self.backup:
            delete_backup(self.broker.acks, topic, partition, self.group)
            return None, Restored("off", 0, 0.0)
        backup = PartitionBackup(
            self.broker.acks,
            self.group,
            topic,
            partition,
            keys.lease_key(topic, partition, self.group),
            leases[topic],
            count,
            self.buckets,
        )
        done = backup.reconcile(store, self.topics, keep_alive)
        store.journal = backup.journal
        return backup, done

    def _settle_backup(
        self,
        backup: PartitionBackup,
        store: StateStore,
        done: Restored,
        keep_alive: Callable[[], None],
        count: int,
    ) -> None:
        """Upload a store that passed the stream checks where the backup is missing or damaged."""
        if done.action in ("missing", "damaged"):
            if done.action == "damaged":
                log.error(
                    "the state backup of app %s partition %s lost its values (deleted or evicted): "
                    "this store is current, uploading it again",
                    self.group,
                    backup.partition,
                )
            done = backup.upload(store, keep_alive)
        else:  # refused when built for another count; one from before counts were kept gets it
            meta = self.broker.acks.backup_meta(backup.keys.meta)
            self._check_count(meta.get(BACKUP_PARTITIONS), count, "its state backup")
            if BACKUP_PARTITIONS not in meta:
                self.broker.acks.set_backup_field(backup.keys.meta, BACKUP_PARTITIONS, str(count))
            if backup.buckets != self.buckets:  # the store equals it: laid out anew from the store
                log.info(
                    "state backup app=%s partition=%s: from %s to %s buckets, uploading the store",
                    self.group,
                    backup.partition,
                    backup.buckets,
                    self.buckets,
                )
                backup.upload(store, keep_alive)
        detail = {
            "in sync": "(the store matches it: nothing to restore)",
            "caught up": f"updates={done.amount} (from its log: no full restore)",
            "restored": f"values={done.amount} (a full restore)",
            "uploaded": f"values={done.amount} (there was none, or it had lost its values)",
            "fresh": "(nothing to back up yet)",
        }[done.action]
        log.info(
            "state backup %s app=%s partition=%s %s in %.3fs",
            done.action,
            self.group,
            backup.partition,
            detail,
            done.seconds,
        )

    def _refuse_behind(
        self, stream: str, info: StreamInfo, partition: int, topic: str, checkpoint: StreamId | None
    ) -> None:
        """Refuse a store the consumer group has moved past: never a silent start from less state."""
        mine = info.groups.get(self.group)
        start = self.broker.apps.group_start(self.group, topic, partition)
        after = checkpoint if start is None or (checkpoint is not None and checkpoint > start) else start
        delivered = None if mine is None else mine.last_delivered_id
        if delivered is None or not self.broker.reading.acknowledged_after(
            stream, self.group, after, delivered
        ):
            return
        fix = (
            "start the worker with the state directory that holds this partition's store, or "
            "turn the state backup on, which keeps it in Redis"
            if not self.backup
            else "the state backup is missing or behind too (deleted by hand, or left from a time "
            "the backup was off)"
        )
        raise StateError(
            f"the state of app {self.group!r} partition {partition} is behind its consumer group: "
            f"the store's checkpoint for {topic!r} is {checkpoint or 'none (no state)'} but the group "
            f"has acknowledged entries up to {delivered.decode()}, whose effects the "
            f"store lacks. Nothing was processed. To go on, {fix}; or replay the app "
            f"(pspf replay) to rebuild its state from the stream"
        )

    def check_stream(self, stream: str, checkpoint: StreamId | None, backup_lost: bool = False) -> StreamInfo:
        """Refuse a stream that went back below the checkpoint, and re-create a deleted group.

        A group deleted while the app was away is re-created at the checkpoint, never at ``$``:
        entries after the checkpoint must still be processed. With the state backup gone as
        well (``backup_lost``), Redis lost the app's data: nothing can show the store is current.
        """
        info = self.broker.topics.stream_info(stream)
        # Lost data first: after a flush the topic may be back (empty, so it went back too) and
        # its group too (another worker's takeover made it), but the backup says what was lost.
        if backup_lost and (self.group not in info.groups or went_back(info.last_id, checkpoint)):
            # A worker creates the groups of every partition before it takes any: the app ran here.
            held = (
                f"this store applied entries up to {checkpoint}"
                if checkpoint
                else "this machine has no store of it"
            )
            gone = (
                f"consumer group on {stream}"
                if self.group not in info.groups
                else f"entries of {stream} up to the store's checkpoint (the stream went back)"
            )
            raise BrokerDataLost(
                f"the server no longer has app {self.group!r}'s {gone} nor the "
                f"partition's state backup ({held}): Redis lost its data (a restart without "
                f"persistence, a flush, eviction) or they were deleted. {adopt_remedy(self.group)} "
                "(see docs/concepts/guarantee.md, When Redis loses data)"
            )
        check_tail(stream, info.last_id, checkpoint)
        if self.group not in info.groups:
            start = str(checkpoint or "0")
            log.error(
                "consumer group %s is missing on %s although the app has read it before: "
                "re-creating it at %s (entries up to the checkpoint are skipped as done)",
                self.group,
                stream,
                start,
            )
            self.broker.apps.ensure_group(stream, self.group, start)
        return info

    def forget_consumers(self, owned: OwnedPartition, after_ms: int) -> list[str]:
        """Delete the group's consumers with nothing pending in the partition's streams, idle ``after_ms``.

        Worker names change per pod, and each leaves a consumer in every stream it read: they
        pile up. Only the owner deletes, under its lease (no other consumer reads these streams),
        and never one with pending entries (XGROUP DELCONSUMER would drop them). The names no
        stream has any more leave the store's consumer list too: takeover only asks it about
        consumers with pending entries. Returns the names deleted.
        """
        kept: set[str] = set()
        deleted: set[str] = set()
        for cursor in owned.streams.values():
            for name, pending, idle_ms in self.broker.apps.group_consumers(cursor.stream, self.group):
                if name != self.consumer and pending == 0 and idle_ms >= after_ms:
                    self.broker.apps.delete_consumer(cursor.stream, self.group, name)
                    deleted.add(name)
                else:
                    kept.add(name)
        owned.forget_consumers(owned.consumers - kept - {self.consumer})
        if deleted:
            log.info(
                "deleted %s idle consumers of group %s partition=%s: %s",
                len(deleted),
                self.group,
                owned.partition,
                ", ".join(sorted(deleted)),
            )
        return sorted(deleted)

    def claim_idle(self, owned: OwnedPartition, min_idle_ms: int) -> None:
        """Take over entries other consumers of the group left idle on a partition's streams.

        Takeover claims an earlier owner's entries at once; this periodic pass is the safety net
        for entries another consumer took without holding the lease. Those at or below the
        checkpoint are marked foreign before they are claimed, so they run.
        """
        for cursor in owned.streams.values():
            idle = [
                pending
                for pending in self.broker.reading.pending_entries(
                    cursor.stream, self.group, min_idle_ms=min_idle_ms
                )
                if pending.consumer != self.consumer
            ]
            if not idle:
                continue
            checkpoint = cursor.checkpoint
            foreign = [
                p.id
                for p in idle
                if checkpoint is not None
                and p.consumer not in owned.consumers
                and StreamId.parse(p.id) <= checkpoint
            ]
            owned.mark_foreign({cursor: foreign})
            if foreign:
                _flushed(owned)
            claimed = self.broker.reading.claim_ids(
                cursor.stream, self.group, self.consumer, min_idle_ms, [p.id for p in idle]
            )
            log.warning(
                "claimed %s entries idle over %s ms from other consumers stream=%s; "
                "they are applied now, out of order",
                len(claimed),
                min_idle_ms,
                cursor.stream,
            )
            cursor.rewind()


def _flushed(owned: OwnedPartition) -> None:
    """The store's marks in the backup before Redis changes (a claim); LeaseLost if refused."""
    refused = flush(owned)
    if refused is not None:
        raise refused[1]
