"""`pspf state adopt`, one partition at a time: which store becomes the state after a total loss.

Adopting a store (``Adopter.adopt``) stamps it with a new adoption id, uploads it as the
partition's backup under the partition's lease, writes the adoption record into the backup's
meta (``pspf.partition.adoption``) and only then moves the consumer groups to the store's checkpoints, so
no worker reads from the new position before the backup holds the state it belongs to. Each step
can be run again: an adopt cut short is finished by the next one on the same machine.

A second machine's store is compared with the adopted one by checkpoints: one not later is left
alone (it follows the backup); a later one replaces the adopted state when no worker applied
anything on top of it yet, else only with ``replace`` (the entries applied since are applied
again on top of the later store).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from pspf import keys
from pspf.broker import Broker
from pspf.errors import AppRunning, LaterStore, LeaseLost
from pspf.keys import BACKUP_ADOPTED, BACKUP_IDENTITY, BACKUP_NAMESPACE, StreamId
from pspf.partition.adoption import Adoption, adoption_of, compare, shown, stamp_of
from pspf.partition.backup import PartitionBackup, meta_checkpoints
from pspf.settings import Settings
from pspf.state_stores import StateStore, open_store
from pspf.state_stores.memory import MemoryStore


class Adopter:
    """Adopts the stores of one app in this state dir, partition by partition."""

    def __init__(
        self, broker: Broker, settings: Settings, app: str, topics: list[str], count: int, replace: bool
    ) -> None:
        self.broker = broker
        self.settings = settings
        self.app = app
        #: the app's topics in its order: the first one's partitions carry the backup
        self.topics = topics
        self.count = count
        self.replace = replace
        self.backup = settings.state.backup == "on"

    def adopt(self, partition: int, stored: bool) -> dict[str, str] | None:
        """Adopt the store here of ``partition`` (a new, empty one without ``stored``).

        Returns where the groups start now per topic, or None when the partition is left alone:
        the server holds its state, as late as this store or later.
        """
        meta = self.broker.acks.backup_meta(keys.backup_keys(self.topics[0], partition, self.app).meta)
        adoption = adoption_of(meta)
        with self._store(partition, stored) as store:
            mine = store.checkpoints()
            if self._cut_short(store, meta, adoption):  # an adopt here stopped after its upload
                if adoption is None or adoption.id != stamp_of(store):
                    done = Adoption(id=stamp_of(store), checkpoints=_text(mine), replaced=_replaced(adoption))
                    self._record(partition, done)
                starts, changed = self._move_groups(partition, mine)
                return starts if changed else None
            if adoption is None:
                if not self._lost(partition, meta):
                    return None
            elif not self._takes(partition, store, adoption, meta):
                return None
            return self._take(partition, store, mine, adoption)

    def _takes(self, partition: int, store: StateStore, adoption: Adoption, meta: dict[str, str]) -> bool:
        """Whether this store replaces the adopted state; LaterStore when only the operator may say."""
        mark = stamp_of(store)
        if mark == adoption.id or mark in adoption.replaced:
            return False  # of the adopted history (or of one replaced): it follows the backup
        mine, adopted = store.checkpoints(), adoption.positions()
        relation = compare(mine, adopted)
        if relation in ("same", "behind"):
            return False
        now = meta_checkpoints(meta)
        where = (
            f"partition {partition} of app {self.app!r}: the store here ({shown(mine)}) is "
            f"{'later than' if relation == 'later' else 'ahead in some topics and behind in others of'} "
            f"the state adopted from another store ({shown(adopted)})"
        )
        if relation == "apart" and not self.replace:
            raise LaterStore(
                f"{where}: neither holds all the other holds. Nothing was changed. Keep the adopted "
                f"state (delete this store), or run `pspf state adopt {self.app} --replace` here to "
                "make this store the state (the adopted state's entries this store lacks are lost)"
            )
        if now != adopted and not self.replace:
            raise LaterStore(
                f"{where}, and workers applied entries on top of the adopted state since (it is at "
                f"{shown(now)}). Nothing was changed. Run `pspf state adopt {self.app} --replace` "
                "here (the app stopped) to make this store the state: the entries after its "
                "checkpoints are applied again on top of it, and what the app emitted for those "
                "applied since the adoption is emitted again"
            )
        return True

    def _take(
        self, partition: int, store: StateStore, mine: dict[str, StreamId], previous: Adoption | None
    ) -> dict[str, str]:
        """Make the store the partition's state: stamp, upload, record, then move the groups."""
        adoption = Adoption(id=uuid.uuid4().hex, checkpoints=_text(mine), replaced=_replaced(previous))
        if self.backup:
            store.write({(BACKUP_NAMESPACE, BACKUP_ADOPTED): adoption.id.encode()}, {})
            self._upload(partition, store)
            self._record(partition, adoption)
        return self._move_groups(partition, mine)[0]

    def _upload(self, partition: int, store: StateStore) -> None:
        """Upload the whole store as the partition's backup, under the partition's leases."""
        owner = f"pspf-state-adopt/{os.getpid()}"
        ttl_ms = self.settings.consumer.lease_ttl_ms
        held: list[tuple[str, str]] = []
        try:
            for topic in self.topics:
                lease = keys.lease_key(topic, partition, self.app)
                value = self.broker.leases.acquire_lease(
                    lease, keys.fence_key(topic, partition, self.app), owner, ttl_ms
                )
                if value is None:
                    raise AppRunning(
                        f"app {self.app!r} is running (a worker took partition {partition}): stop it first"
                    )
                held.append((lease, value))

            def keep_alive() -> None:
                if not all(self.broker.leases.renew_leases(held, ttl_ms)):
                    raise LeaseLost(
                        f"the lease of app {self.app!r} partition {partition} expired during "
                        "the upload: run adopt again"
                    )

            first = held[0]
            PartitionBackup(
                self.broker.acks, self.app, self.topics[0], partition, first[0], first[1], self.count
            ).upload(store, keep_alive)
        finally:
            if held:
                self.broker.leases.release_leases(held)

    def _record(self, partition: int, adoption: Adoption) -> None:
        meta = keys.backup_keys(self.topics[0], partition, self.app).meta
        self.broker.acks.set_backup_field(meta, BACKUP_ADOPTED, adoption.encode())

    def _move_groups(self, partition: int, mine: dict[str, StreamId]) -> tuple[dict[str, str], bool]:
        """Put the groups at the store's checkpoints and move the streams' last ids past them.

        Returns each group's start, and whether any group moved (or was created).
        """
        starts: dict[str, str] = {}
        changed = False
        for topic in self.topics:
            stream, start = keys.stream_key(topic, partition), mine.get(topic)
            at = str(start or "0")
            group = self.broker.topics.stream_info(stream).groups.get(self.app)
            if group is None:
                self.broker.apps.ensure_group(stream, self.app, at)  # creates the stream
                changed = True
            elif StreamId.parse(group.last_delivered_id) != StreamId.parse(at):
                self.broker.apps.reset_group(stream, self.app, at)
                changed = True
            last = self.broker.topics.last_id(stream)
            if start is not None and (last is None or StreamId.parse(last) < start):
                self.broker.topics.move_last_id(stream, str(start))
            self.broker.apps.record_group_start(self.app, topic, partition, stream)
            starts[topic] = at
        return starts, changed

    def _cut_short(self, store: StateStore, meta: dict[str, str], adoption: Adoption | None) -> bool:
        """Whether the backup is this store as an adopt here uploaded it, and nothing ran since.

        Then the adopt may have stopped before its record or its groups: both are done again.
        """
        identity = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
        mark, mine = stamp_of(store), store.checkpoints()
        if not (
            self.backup
            and mark
            and identity is not None
            and identity.decode() == meta.get(BACKUP_IDENTITY)
            and meta_checkpoints(meta) == mine
        ):
            return False
        return adoption is None or adoption.id != mark or adoption.positions() == mine

    def _lost(self, partition: int, meta: dict[str, str]) -> bool:
        """Whether the server has neither the partition's groups nor its state backup."""
        if meta.get(BACKUP_IDENTITY):
            return False
        return all(
            self.app not in self.broker.topics.stream_info(keys.stream_key(t, partition)).groups
            for t in self.topics
        )

    @contextmanager
    def _store(self, partition: int, stored: bool) -> Iterator[StateStore]:
        if not stored:  # a partition adopted anew: its backup starts empty
            yield MemoryStore()
            return
        state = self.settings.state
        with open_store(state.engine, state.dir, self.app, partition, durability=state.durability) as store:
            yield store


def _text(checkpoints: dict[str, StreamId]) -> dict[str, str]:
    return {topic: str(at) for topic, at in checkpoints.items()}


def _replaced(previous: Adoption | None) -> list[str]:
    return [] if previous is None else [*previous.replaced, previous.id]
