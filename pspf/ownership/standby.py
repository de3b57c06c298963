"""Warm standby: local stores of the partitions a worker does not own, kept following their backups.

A thread of the worker follows each such partition's backup log into the partition's store in
the worker's state dir: a full restore once (or a catch-up from the log when the store is near),
then every update within about ``POLL_S`` of its batch's acknowledgement. When the worker takes
the partition, the store is handed over (``release``) and its identity matches the backup's, or
is a few updates behind: the takeover applies those and restores nothing.

The standby never writes Redis; the takeover still reconciles the store with the backup, so a
standby that fell behind or broke costs time, never correctness.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import suppress
from typing import TYPE_CHECKING

from pspf import keys
from pspf.broker import Broker
from pspf.errors import BrokerUnavailable, LaterStore, StoreLocked
from pspf.partition.adoption import adoption_of, trusted_identity
from pspf.partition.backup import LogGap, LogReader, catch_up, locate, restore

if TYPE_CHECKING:
    from pspf.ownership.owning import StoreFactory
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.standby")

#: How often the followed logs are read when the last read found nothing.
POLL_S = 0.1
#: How long a partition whose store could not be opened waits before the next try.
RETRY_S = 2.0
#: How long a partition whose store is later than its adopted backup waits before the next look.
LATER_RETRY_S = 60.0


class _Follower:
    """One followed partition: its store and where it stands in the backup's log."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.reader: LogReader | None = None


class Standby:
    """Follows the backups of partitions this worker does not own, in a thread of its own."""

    def __init__(self, broker: Broker, group: str, topics: list[str], open_store: StoreFactory) -> None:
        self.broker = broker
        self.group = group
        #: the app's topics; the first one's partitions carry the backup
        self.topics = topics
        self.open_store = open_store
        self._wanted: set[int] = set()
        self._followers: dict[int, _Follower] = {}
        self._retry_at: dict[int, float] = {}
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        #: ends the thread's idle wait: what it follows changed (a takeover waits for its store)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pspf-standby", daemon=True)
        self._thread.start()

    def keep(self, partitions: set[int]) -> None:
        """Follow exactly these partitions from now on."""
        with self._changed:
            if partitions != self._wanted:
                self._wanted = set(partitions)
                self._wake.set()

    def release(self, partition: int) -> None:
        """Stop following a partition and return once its store is closed (it is about to be taken)."""
        with self._changed:
            self._wanted.discard(partition)
            self._wake.set()
            while partition in self._followers and self._thread.is_alive():
                self._changed.wait(0.05)

    def close(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(10)
        self.broker.close()

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()  # before the round reads what it follows: no change is missed
                try:
                    busy = self._round()
                except BrokerUnavailable as exc:
                    log.warning("standby: Redis unavailable, retrying in %ss: %s", RETRY_S, exc)
                    self._stopping.wait(RETRY_S)
                    continue
                if not busy:
                    self._wake.wait(POLL_S)
        finally:
            with self._changed:
                for partition in list(self._followers):
                    self._close(partition)

    def _round(self) -> bool:
        """Open, sync and read every wanted partition once; True when something was applied."""
        with self._changed:
            wanted = set(self._wanted)
            for partition in set(self._followers) - wanted:
                self._close(partition)
        busy = False
        for partition in sorted(wanted):
            if not self._still_wanted(partition):
                continue
            try:
                follower = self._followers.get(partition) or self._open(partition)
                if follower is not None:
                    busy |= self._follow(partition, follower)
            except LogGap as exc:
                log.info("standby app=%s partition=%s: %s; restoring again", self.group, partition, exc)
                self._followers[partition].reader = None
            except BrokerUnavailable:
                raise
            except LaterStore as exc:  # kept as it is until the operator adopts or deletes it
                log.error("standby app=%s partition=%s: %s", self.group, partition, exc)
                with self._changed:
                    self._close(partition)
                self._retry_at[partition] = _now() + LATER_RETRY_S
            except Exception:
                log.exception("standby app=%s partition=%s failed; trying again later", self.group, partition)
                with self._changed:
                    self._close(partition)
                self._retry_at[partition] = _now() + RETRY_S
        return busy

    def _follow(self, partition: int, follower: _Follower) -> bool:
        store = follower.store
        if follower.reader is None:
            backup = keys.backup_keys(self.topics[0], partition, self.group)
            adoption = adoption_of(self.broker.acks.backup_meta(backup.meta))
            follower.reader = locate(self.broker.acks, backup, trusted_identity(store, adoption))
            if follower.reader is None:
                restored = restore(
                    self.broker.acks,
                    backup,
                    store,
                    self.topics,
                    go_on=lambda: self._still_wanted(partition),
                    owner=(self.group, partition),
                )
                if restored is None:
                    return False  # no backup yet, or taken meanwhile
                values, follower.reader = restored
                log.info("standby app=%s partition=%s: restored %s values", self.group, partition, values)
        # One page per round: a release waits for no more than that.
        return catch_up(store, follower.reader, pages=1) > 0

    def _still_wanted(self, partition: int) -> bool:
        return partition in self._wanted and not self._stopping.is_set()

    def _open(self, partition: int) -> _Follower | None:
        if self._retry_at.get(partition, 0.0) > _now():
            return None
        try:
            store = self.open_store(self.group, partition)
        except StoreLocked:  # another worker of this state dir owns it
            self._retry_at[partition] = _now() + RETRY_S
            return None
        with self._changed:
            follower = self._followers[partition] = _Follower(store)
        return follower

    def _close(self, partition: int) -> None:
        """With ``_changed`` held: close a follower's store and tell a waiting ``release``."""
        follower = self._followers.pop(partition, None)
        if follower is not None:
            with suppress(Exception):
                follower.store.close()
        self._changed.notify_all()


def _now() -> float:
    return time.monotonic()
