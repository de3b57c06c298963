"""The lease round: what a worker does every third of the lease TTL to own its share of partitions.

``LeaseRound.step`` gives up the partitions whose leases the keeper found gone (``LeaseKeeper``
renews them from a thread of its own), sends the membership's heartbeat and gives up what the
membership now assigns to another worker, claims idle pending entries, takes the free partitions
it should own, applies the topics' retention to what it owns, and keeps the standby stores
following the others. ``next_at`` says when the next round is due: a third of the TTL after the
last, or sooner when a partition this worker should own may become free.

The worker's loop runs a round between two cycles of the processor, so what a round gives up was
committed and acknowledged; tests run one with ``worker.lease_round.step()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from pspf.errors import BrokerDataLost, BrokerError, LeaseLost, NotFound, StoreLocked
from pspf.ownership.leases import LeaseKeeper, Lost, say_gone, say_waiting
from pspf.ownership.owning import Leases, PartitionLeases, Partitions, check_partition_count
from pspf.worker import retention

if TYPE_CHECKING:
    from pspf.app import App
    from pspf.broker import Broker
    from pspf.cycle.processor import BatchProcessor
    from pspf.observability.metrics import WorkerMetrics
    from pspf.ownership.membership import Membership
    from pspf.ownership.standby import Standby
    from pspf.settings import Settings

log = logging.getLogger("pspf.worker")

#: How often a worker applies its topics' retention to the partitions it owns (and reads it again).
TRIM_EVERY_S = 10.0
#: A lease held by a worker that is no member any more is looked at again this soon, then twice as
#: late each time: it runs out with that membership or moments after (one set by hand, never).
_GONE_HOLDER_LOOK_S = 0.01


class LeaseRound:
    """One worker's partitions: which it holds, and the round that takes, keeps and gives them up."""

    def __init__(
        self,
        app: App,
        settings: Settings,
        broker: Broker,
        leases: PartitionLeases,
        membership: Membership,
        keeper: LeaseKeeper,
        partitions: Partitions,
        processor: BatchProcessor,
        standby: Standby | None,
        metrics: WorkerMetrics | None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.broker = broker
        self.leases = leases
        self.membership = membership
        self.keeper = keeper
        self.partitions = partitions
        self.processor = processor
        self.standby = standby
        self.metrics = metrics
        #: Set to stop the worker: by ``Worker.stop``, a signal, or an operator's request
        self.stopping = threading.Event()
        #: the partitions this worker holds, and their leases
        self.held: dict[int, Leases] = {}
        #: the app's partition count (``started``)
        self.count = 0
        self._next_idle_claim = 0.0
        self._next_trim = 0.0
        #: when (monotonic) the last lease round started
        self.round_at = 0.0
        #: when (monotonic) to look again at the leases of partitions this worker should own
        #: that a worker which is no member any more holds; None when there are none
        self.look_again_at: float | None = None
        self._look_again_s = _GONE_HOLDER_LOOK_S
        #: Set by a lost connection: the next lease round checks the owned streams again.
        self._recheck_streams = False
        #: the server's maxmemory-policy cannot be read (said once)
        self._policy_unchecked = False

    def started(self, count: int, eviction_checked: bool) -> None:
        """The worker started: the app's partition count, and whether the eviction policy was read."""
        self.count = count
        # check_server warned already when CONFIG cannot be read
        self._policy_unchecked = not eviction_checked

    def connection_lost(self) -> None:
        """The next round checks the owned streams again before anything is read."""
        self._recheck_streams = True

    def step(self) -> None:
        """Give up lost partitions (``LeaseKeeper`` renews), take free ones, claim idle entries.

        Also checks the server's eviction policy (every round, so after a reconnect too), that the
        owned stores are still in place (a worker with nothing to commit notices a deleted state
        dir too) and, after a lost connection, the owned streams.
        """
        self.round_at = time.monotonic()
        self.check_policy()  # first: after a reconnect too, before anything is written
        if self._stop_asked():
            return
        for owned in self.processor.owned.values():
            owned.store.check_in_place()
        self._drop_lost(self.keeper.take_lost())
        if self._recheck_streams:
            self._recheck_after_reconnect()
            self._recheck_streams = False
        behind = self.membership.count_global_lag(self.processor.lookups)  # sent with the heartbeat
        if behind is not None and self.metrics is not None:
            self.metrics.global_tables_lag(behind)
        members = self.membership.heartbeat()
        target = self.membership.target(self.count)
        say_waiting(self.membership, self.leases, self.count)
        if self.metrics is not None:
            self.metrics.members_seen(len(members), self.membership.changed)
        for partition in [p for p in self.held if p not in target]:
            # Between two cycles: what it processed is committed and acknowledged.
            log.info("partition moves to another worker app=%s partition=%s", self.app.name, partition)
            self.drop(partition, release=True, held=True)
        if time.monotonic() >= self._next_idle_claim:
            min_idle_ms = self.settings.consumer.min_idle_ms
            self._next_idle_claim = time.monotonic() + min_idle_ms / 2000
            forget_ms = int(self.settings.consumer.forget_consumers_after_s * 1000)
            for owned in self.processor.owned.values():
                self.partitions.claim_idle(owned, min_idle_ms)
                if forget_ms and self.partitions.forget_due(owned.partition):
                    self.partitions.forget_consumers(owned, forget_ms)
        self._take_free(target)
        self.processor.apply_outbox_replays()
        if time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + TRIM_EVERY_S
            self._check_topics()
            self._trim_owned()
        if self.standby is not None:
            self.standby.keep({p for p in range(self.count) if p not in self.held})

    def _stop_asked(self) -> bool:
        """Whether an operator asked the app's workers to stop (``pspf app savepoint --stop``)."""
        asked = self.broker.apps.stop_requested(self.app.name)
        if asked is not None and not self.stopping.is_set():
            log.warning("stopping: %s asked app %s to stop", asked, self.app.name)
            self.stopping.set()
        return asked is not None

    def _recheck_after_reconnect(self) -> None:
        """Check the owned partitions before anything is read again after a lost connection."""
        # The lease first: one that expired meanwhile moved on (Redis lost nothing). Else Redis
        # may be back with less than it had (a restart without its data, a fail-over to a
        # replica behind): a partition whose backup went back is taken again, which rebuilds its
        # store from the backup: then the store matches the streams the server holds now.
        for partition, owned in list(self.processor.owned.items()):
            cursors = list(owned.streams.values())
            values = self.broker.leases.lease_values([c.lease_key for c in cursors])
            if any(v != c.lease_value for v, c in zip(values, cursors, strict=True)):
                say_gone(self.leases, partition, "expired while Redis was unreachable")
                self.drop(partition, release=False)
            elif owned.backup is not None and owned.backup.went_back(self.broker.topics.last_id_up_to):
                log.warning(
                    "the state backup of partition %s went back (the server lost writes): "
                    "taking the partition again to restore its store from the backup",
                    partition,
                )
                self.drop(partition, release=True)
        for cursor in self.processor.cursors():
            self.partitions.check_stream(cursor.stream, cursor.checkpoint)

    def _trim_owned(self) -> None:
        """Apply the retention of the app's topics to the partitions this worker owns."""
        for topic in self.app.topics:
            kept = retention.stored(self.broker, topic)
            if not kept.active or not self.held:
                continue
            done = retention.trim(
                self.broker, retention.plan(self.broker, topic, sorted(self.held), kept, False)
            )
            removed = sum(p.removable for p in done)
            if removed:
                log.info(
                    "retention trimmed %s entries of topic %s partitions=%s",
                    removed,
                    topic,
                    sorted(self.held),
                )

    def _take_free(self, target: set[int]) -> None:
        """Take the partitions of ``target`` whose leases are free (or ours without our knowing it).

        A lease whose holder is no member any more (dead, or stalled past its TTL) runs out
        with that membership or moments after (``LeaseKeeper.renew``): it is looked at again soon
        (``next_at``), not a round later.
        """
        found = self.leases.takeable(sorted(target - set(self.held)))
        if found.holders - {m.id for m in self.membership.members}:
            self.look_again_at = time.monotonic() + self._look_again_s
            self._look_again_s = min(2 * self._look_again_s, self.settings.consumer.lease_ttl_ms / 3000)
        else:
            self.look_again_at, self._look_again_s = None, _GONE_HOLDER_LOOK_S
        for partition in found.free:
            asked = time.monotonic()
            leases = self.leases.acquire(partition)
            if leases is None:
                continue
            self.keeper.hold(partition, leases, asked)  # renewed during a long restore too
            try:
                if self.standby is not None:
                    self.standby.release(partition)
                self._take(partition, leases)
            except StoreLocked as exc:
                log.info("partition %s: store still in use, retrying later: %s", partition, exc)
                self.keeper.forget(partition)
                self.leases.release(partition, leases)
            except LeaseLost as exc:
                log.warning("partition %s: %s while taking it, giving it up: %s", partition, exc.what, exc)
                self.keeper.forget(partition)
            except BaseException:
                # The worker stops: give the partition up now, not when the lease expires.
                self.keeper.forget(partition)
                with suppress(BrokerError):
                    self.leases.release(partition, leases)
                raise

    def next_at(self) -> float:
        """When (monotonic) the next lease round is due.

        A third of the TTL after the last renewal, or sooner when a partition this worker should
        own may become free: another member's membership runs out (a dead worker's partitions
        then move to the live ones), or a lease whose holder is gone is looked at again.
        """
        due = [self.round_at + self.settings.consumer.lease_ttl_ms / 3000]
        for sooner in (self.look_again_at, self.membership.first_expiry_at()):
            if sooner is not None:
                due.append(sooner)
        return min(due)

    def _take(self, partition: int, leases: Leases) -> None:
        self.processor.add(
            self.partitions.take(partition, leases, self.count, self._keep_alive(partition, leases))
        )
        self.held[partition] = leases
        if self.metrics is not None:
            self.metrics.partition_taken(partition)

    def _keep_alive(self, partition: int, leases: Leases) -> Callable[[], None]:
        """Keeps the leases renewed during a long takeover restore (the loop is alive).

        Raises LeaseLost when the new partition's lease is gone: the takeover stops there.
        """

        def renew() -> None:
            self.keeper.beat()
            if self.keeper.lost(partition, leases):
                raise LeaseLost(f"the lease of partition {partition} expired while it was being taken")

        return renew

    def _drop_lost(self, lost: list[Lost]) -> None:
        """Give up the held partitions whose lease the keeper found gone, saying what happened."""
        for gone in lost:
            if self.held.get(gone.partition) != gone.leases:
                continue  # given up meanwhile
            if not self.vanished([gone.partition]):
                say_gone(self.leases, gone.partition, gone.why)
            self.drop(gone.partition, release=False)

    def vanished(self, partitions: list[int], look: bool = False) -> list[int]:
        """Say loudly when held leases are gone before their TTL could run out since their renewal.

        Such a lease did not expire (a stalled worker's does, and that stays a warning): its key
        was evicted or deleted under the running worker. An evicting server stops the worker here.
        With ``look`` the leases are read first (``LeaseKeeper.vanished``). Returns those partitions.
        """
        recent = self.keeper.vanished({p: self.held[p] for p in partitions if p in self.held}, look)
        if not recent:
            return recent
        self.check_policy()
        log.error(
            "PSPF keys vanished under the running worker (evicted or deleted): the leases of partitions "
            "%s were gone before their TTL of %.1fs ran out since their last renewal; taking them again",
            recent,
            self.settings.consumer.lease_ttl_ms / 1000,
        )
        return recent

    def check_policy(self) -> None:
        """Stop (EvictingPolicy, exit 3) on a server that may evict keys; warn once where unchecked."""
        if not self.broker.conn.check_eviction() and not self._policy_unchecked:
            self._policy_unchecked = True
            log.warning("weaker guarantee: cannot read the server's maxmemory-policy; eviction is unchecked")

    def drop(self, partition: int, release: bool, held: bool = False) -> None:
        """Stop working on a partition and forget its leases; ``release`` them in Redis.

        ``held``: the lease is ours still (a hand-over, the end): what the partition committed is
        written to its views first (``BatchProcessor.remove``).
        """
        leases = self.held.pop(partition, None)
        self.keeper.forget(partition)
        if self.metrics is not None:
            self.metrics.partition_released(partition)
        if partition in self.processor.owned:
            self.processor.remove(partition, held).store.close()
        if release and leases:
            self.leases.release(partition, leases)
        log.info("partition released app=%s partition=%s", self.app.name, partition)

    def _check_topics(self) -> None:
        """Stop when a topic's record vanished or its partition count changed under the worker."""
        for topic in self.app.topics:
            try:
                count = self.broker.topics.topic_partitions(topic)
            except NotFound:
                raise BrokerDataLost(
                    f"topic {topic!r} vanished from the server under a running worker of app "
                    f"{self.app.name!r}: Redis lost its data (a restart without persistence, a flush, "
                    "eviction) or it was deleted. Nothing more is acknowledged"
                ) from None
            check_partition_count(self.app.name, self.app.topics, self.count, count, "this worker")
