"""A worker process: partition ownership, the batch processor and clean shutdown wired together.

The first SIGINT/SIGTERM stops reading; the batch in hand is committed and acknowledged, leases are
released so a standby takes over at once, and ``run`` returns. A second signal exits at once,
which loses nothing: nothing uncommitted was ever acknowledged.

With a metrics port in the settings, ``run`` also serves Prometheus metrics and a health check
(``pspf.observability.metrics``) while it runs.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec

from pspf import keys, state_stores
from pspf.app import App
from pspf.broker import Broker, partition_count
from pspf.contracts.asyncapi import record_document
from pspf.contracts.registry import check_state, check_value_types, topic_checks
from pspf.cycle.processor import BatchProcessor
from pspf.errors import (
    BrokerDataLost,
    BrokerError,
    BrokerOutOfMemory,
    BrokerUnavailable,
    ConfigError,
    GroupMissing,
    NotFound,
    StateError,
    StreamWentBack,
)
from pspf.failures import policy_from
from pspf.hooks import Counts, HookChain, ProcessorHooks
from pspf.observability.metrics import MemoryEpisode, MetricsServer, WorkerMetrics
from pspf.outbox.views import check_view_types
from pspf.ownership.leases import LeaseKeeper
from pspf.ownership.membership import Membership
from pspf.ownership.owning import (
    PartitionLeases,
    Partitions,
    StoreFactory,
    adopt_remedy,
    check_partition_count,
)
from pspf.ownership.standby import Standby
from pspf.savepoint.restoring import refuse_restoring
from pspf.settings import Settings
from pspf.tables.global_tables import GlobalTables
from pspf.tables.lookups import check_table_partitions
from pspf.worker.lease_round import LeaseRound

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.worker")


_RECONNECT_MIN_S = 0.1
_RECONNECT_MAX_S = 5.0
_IDLE_POLL_S = 0.05
#: A scrape or health check waits at most this long for Redis, well within a scrape timeout.
_METRICS_REDIS_TIMEOUT_S = 2.0

#: The garbage collector's thresholds while a worker runs (Python's default: 700, 10, 10): a
#: young-generation scan per 50,000 new containers rather than per 700.
GC_THRESHOLDS = (50_000, 20, 10)


class _Collector:
    """Sets ``GC_THRESHOLDS`` while any worker of the process runs, and puts back what was before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._before = gc.get_threshold()

    @contextmanager
    def scanning_less(self) -> Iterator[None]:
        with self._lock:
            if not self._running:
                self._before = gc.get_threshold()
                gc.set_threshold(*GC_THRESHOLDS)
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    gc.set_threshold(*self._before)


_COLLECTOR = _Collector()


class RunSummary(Counts, kw_only=True):
    """Totals of one ``Worker.run``."""

    cycles: int = 0


def default_consumer_name() -> str:
    """A name that stays the same when the worker restarts on the same host."""
    return socket.gethostname()


def _worker_metrics(app: App, settings: Settings) -> WorkerMetrics | None:
    """The worker's counters and health (with a broker of their own), when a port is set."""
    if settings.metrics.port is None:
        return None
    timeout_s = min(settings.redis.connect_timeout_s, _METRICS_REDIS_TIMEOUT_S)
    broker = Broker(
        msgspec.structs.replace(settings.redis, connect_timeout_s=timeout_s),
        socket_timeout_s=_METRICS_REDIS_TIMEOUT_S,
    )
    return WorkerMetrics(app.name, app.topics, broker, settings.metrics.stuck_after_s)


def _processor(
    app: App, settings: Settings, broker: Broker, consumer: str, hooks: ProcessorHooks | None
) -> BatchProcessor:
    run_policy = policy_from(settings.retry)
    return BatchProcessor(
        app,
        broker,
        consumer,
        batch_size=settings.consumer.batch_size,
        # Lease rounds (taking, giving up) run between reads: a read never outlasts a third of the TTL.
        block_ms=min(settings.consumer.block_ms, settings.consumer.lease_ttl_ms // 3),
        linger_ms=settings.consumer.linger_ms,
        policies={topic: h.retry.over(run_policy) for topic, h in app.handlers.items()},
        hooks=hooks,
        outbox=settings.outbox,
        idle_close_s=settings.time.idle_close_ms / 1000,
    )


class Worker:
    """Runs one app: owns what partitions it can, processes them, and stops cleanly."""

    def __init__(
        self,
        app: App,
        settings: Settings,
        store_factory: StoreFactory | None = None,
        hooks: ProcessorHooks | None = None,
    ) -> None:
        if not app.handlers:
            raise ConfigError(f"app {app.name!r} has no handlers")
        app.compile()
        self.app = app
        self.settings = settings
        self.consumer = settings.consumer.consumer_name or default_consumer_name()
        owner = f"{self.consumer}/{os.getpid()}/{random.getrandbits(32):08x}"
        socket_timeout_s = settings.consumer.block_ms / 1000 + settings.redis.connect_timeout_s
        self.broker = Broker(settings.redis, socket_timeout_s=socket_timeout_s)
        self.leases = PartitionLeases(
            self.broker.leases, app.name, app.topics, owner, settings.consumer.lease_ttl_ms
        )
        self.membership = Membership(
            self.broker.leases, app.name, owner, self.consumer, settings.consumer.lease_ttl_ms
        )
        # A loop may wait out a data call caught by a cut (its socket timeout) besides its work.
        stall_s = settings.consumer.lease_ttl_ms / 1000 + socket_timeout_s
        self.keeper = LeaseKeeper(settings.redis, self.leases, self.membership, stall_s)
        hooks = hooks if hooks is not None else app.hooks
        #: Counters and health, when the settings ask for a metrics port.
        self.metrics = _worker_metrics(app, settings)
        self._metrics_server: MetricsServer | None = None
        if self.metrics is not None:
            hooks = self.metrics if hooks is None else HookChain(self.metrics, hooks)
        self.processor = _processor(app, settings, self.broker, self.consumer, hooks)
        self._store_factory = store_factory or self._open_store
        self.partitions = Partitions(
            self.broker, app.name, self.consumer, self._store_factory, app.topics, settings.state
        )
        #: Follows the partitions this worker does not own (``--standby``).
        self.standby = self._standby(socket_timeout_s)
        #: Takes, keeps and gives up partitions, every third of the lease TTL (``step``).
        self.lease_round = LeaseRound(
            app,
            settings,
            self.broker,
            self.leases,
            self.membership,
            self.keeper,
            self.partitions,
            self.processor,
            self.standby,
            self.metrics,
        )
        self._partitions = 0
        self._stopping = self.lease_round.stopping  # stop(), a signal, or an operator's request
        self._memory_episode = MemoryEpisode(self.metrics)
        self._signals = 0

    def _standby(self, socket_timeout_s: float) -> Standby | None:
        state = self.settings.state
        if not state.standby:
            return None
        if state.backup != "on":
            raise ConfigError("--standby follows the state backup: it needs --state-backup on")
        broker = Broker(self.settings.redis, socket_timeout_s=socket_timeout_s)
        return Standby(broker, self.app.name, self.app.topics, self._store_factory)

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self, until_idle: bool = False) -> RunSummary:
        """Process until stopped (or, with ``until_idle``, until nothing is left to read)."""
        summary = RunSummary()
        self._serve_metrics()
        try:
            try:
                self.start()
            except BaseException:
                self.broker.close()  # nothing else is running yet
                self.keeper.close()
                raise
            self.keeper.start()
            # What exists now (modules, the app) lives as long as the worker: keep it out of the
            # collector's scans, which otherwise revisit it for every batch's garbage. And scan
            # less often: a batch makes tens of thousands of short-lived containers, none of them
            # in cycles (refcounting frees them), and each scan also walks every object the owned
            # partitions hold (reading a cycle of 200,000 entries took twice as long without).
            gc.collect()
            gc.freeze()
            try:
                with _COLLECTOR.scanning_less():
                    self._loop(until_idle, summary)
            finally:
                self.shutdown()
                gc.unfreeze()
        finally:
            self._close_metrics()
        log.info(
            "worker stopped app=%s handled=%s skipped=%s dead_lettered=%s failed_attempts=%s late=%s",
            self.app.name,
            summary.handled,
            summary.skipped,
            summary.dead_lettered,
            summary.failed,
            summary.late,
        )
        return summary

    def stop(self) -> None:
        """Ask the worker to finish the batch in hand and return from ``run``."""
        self._stopping.set()

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where ``/metrics`` and ``/healthz`` are served while ``run`` runs (the bound port)."""
        server = self._metrics_server
        return None if server is None else server.address

    def _serve_metrics(self) -> None:
        if self.metrics is None:
            return
        config = self.settings.metrics
        assert config.port is not None
        self._metrics_server = MetricsServer(self.metrics, config.host, config.port)
        host, port = self._metrics_server.address
        log.info("serving metrics on http://%s:%s/metrics and health on /healthz", host, port)

    def _close_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self.metrics is not None:
            self.metrics.broker.close()

    @contextmanager
    def signals_handled(self) -> Iterator[None]:
        """Within the block, the first SIGINT/SIGTERM stops gracefully and a second exits at once."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._signals += 1
            if self._signals > 1:
                os._exit(128 + signum)
            log.info("signal %s: finishing the batch in hand, then stopping", signal.Signals(signum).name)
            self.stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _managed_topics(self, managed: list[str], counts: dict[str, int]) -> dict[str, int]:
        """Create the app's re-keying topics that are missing, with the app's partition count.

        Refused (ConfigError, one line) when one exists with another count: its keys would land
        in partitions whose state is not theirs.
        """
        if not managed:
            return {}
        if not counts:
            raise ConfigError(
                f"app {self.app.name!r} reads only re-keying topics ({', '.join(managed)}): "
                "it needs a topic of its own"
            )
        partitions = next(iter(counts.values()))
        found = {}
        for topic in managed:
            try:
                existing = self.broker.topics.topic_partitions(topic)
            except NotFound:
                self.broker.topics.create_topic(topic, partitions)
                log.info("created the re-keying topic %s with %s partitions", topic, partitions)
                existing = partitions
            if existing != partitions:
                raise ConfigError(
                    f"app {self.app.name!r}: the re-keying topic {topic!r} (group_by) has {existing} "
                    f"partitions, the app's topics {partitions}: give group_by another topic, or delete it"
                )
            found[topic] = existing
        return found

    def _check_outputs(self) -> None:
        """Refuse (NotFound) a window's ``emit_to`` or a stream's ``to`` topic that does not exist."""
        for aggregation in self.app.windows.values():
            if aggregation.chained:
                continue  # its results go where its chain says: checked with the chains' outputs
            try:
                self.broker.topics.topic_partitions(aggregation.emit_to)
            except NotFound as exc:
                where = f"window {aggregation.name!r} of topic {aggregation.topic!r}"
                raise NotFound(f"{where} emits to a missing topic: {exc}") from None
        for topic in self.app.dataflow.outputs:
            try:
                self.broker.topics.topic_partitions(topic)
            except NotFound as exc:
                raise NotFound(
                    f"a stream of app {self.app.name!r} publishes to a missing topic (to): {exc}"
                ) from None

    def start(self) -> None:
        """What ``run`` does first: check the server, the topics, the state dir; create the groups.

        No thread starts here (``run`` starts the lease keeper): a test that drives the lease
        rounds step by step (``lease_round.step()``) calls this, then ``shutdown``.
        """
        info = self.broker.conn.check_server()
        for warning in info.warnings:
            log.warning("weaker guarantee: %s", warning)
        eviction_checked = self.broker.conn.check_eviction()
        managed = self.app.managed_topics
        counts = {
            topic: partition_count(self.broker.topics, topic, app=self.app.name).partitions
            for topic in self.app.topics
            if topic not in managed
        }
        counts.update(self._managed_topics(managed, counts))
        check_table_partitions(self.app.name, list(self.app.tables), counts)
        if len(set(counts.values())) > 1:
            raise ConfigError(
                f"the topics of app {self.app.name!r} must have the same partition count "
                f"(their keys share one state per partition): {counts}"
            )
        self._partitions = next(iter(counts.values()))
        self.lease_round.started(self._partitions, eviction_checked)
        self._check_outputs()
        self._check_state_dir()
        self._check_app_record()
        # A group is created from --start-from only for a topic the app never read before. One
        # that vanished later is re-created when its partition is taken: at the checkpoint.
        seen = self.broker.apps.app_topics(self.app.name)
        start_id = "0" if self.settings.consumer.start_from == "earliest" else "$"
        for topic in self.app.topics:
            if topic not in seen:
                for partition in range(self._partitions):
                    stream = keys.stream_key(topic, partition)
                    self.broker.apps.ensure_group(stream, self.app.name, start_id)
                    self.broker.apps.record_group_start(self.app.name, topic, partition, stream)
        self._check_contracts()
        views = self.app.views
        self.broker.apps.register_app(
            self.app.name,
            self.app.topics,
            self._partitions,
            *self.app.table_topics(),
            managed=managed,
            views=list(views),
        )
        self.processor.start_tables(self._partitions, self._global_tables())
        schemas = {topic: topic_checks(self.broker, topic) for topic in self.app.handlers}
        self.processor.attempts.check_schemas({topic: c for topic, c in schemas.items() if c.checkers})
        log.info(
            "worker started app=%s consumer=%s topics=%s partitions=%s server=%s",
            self.app.name,
            self.consumer,
            self.app.topics,
            self._partitions,
            f"{info.name} {info.version}",
        )

    def _check_contracts(self) -> None:
        """Before the app's record: its state type, value types, views' keys; its AsyncAPI document."""
        check_state(self.broker, self.app.name, self.app.state_decoder)
        check_value_types(self.broker, self.app)
        if self.app.views:
            check_view_types(self.app.views, self.broker.publishing.key_types(list(self.app.views)))
        record_document(self.broker, self.app)

    def _check_app_record(self) -> None:
        """Refuse to start when the server forgot the app its stores here were built for.

        The record is kept with the app's partition count: a count changed since (a topic deleted
        and created again) is refused, and so is a missing record while this state dir holds
        stores of the app (Redis lost its data: going on would start some partitions anew), and
        so is an app a restore is switching (``pspf.savepoint.restoring``).
        """
        refuse_restoring(self.broker, self.app.name)
        try:
            recorded: int | None = self.broker.apps.app_partitions(self.app.name)
        except NotFound:
            recorded = None
        check_partition_count(
            self.app.name, self.app.topics, recorded, self._partitions, "the server's record"
        )
        if recorded is not None or self._store_factory != self._open_store:
            return
        state = self.settings.state
        stored = state_stores.stored_partitions(state.engine, state.dir, self.app.name)
        if stored:
            raise BrokerDataLost(
                f"the server at {self.broker.conn.url} has no record of app {self.app.name!r}, but "
                f"{state.dir} holds its stores of partitions {stored}: Redis lost its data (a "
                f"restart without persistence, a flush, eviction) or the app was deleted there. "
                f"{adopt_remedy(self.app.name)}; to start the app anew, delete its stores "
                f"({Path(state.dir) / self.app.name})"
            )

    def _check_state_dir(self) -> None:
        if self._store_factory != self._open_store:
            return
        folder = Path(self.settings.state.dir) / self.app.name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise StateError(f"state dir {self.settings.state.dir} is not writable: {exc.strerror}") from None

    def _loop(self, until_idle: bool, summary: RunSummary) -> None:
        next_lease_round = 0.0
        failures = 0
        while not self._stopping.is_set():
            self.keeper.beat()
            try:
                if time.monotonic() >= next_lease_round:
                    self._settle(summary)  # before hand-overs
                    self.lease_round.step()
                    next_lease_round = self.lease_round.next_at()
                # "Nothing left to read" needs only a look, not a blocking read; a blocking read
                # ends by the next lease round, so that round is neither late nor missed.
                until_round_ms = math.ceil((next_lease_round - time.monotonic()) * 1000)
                result = self.processor.run_once(block=not until_idle, block_ms=max(0, until_round_ms))
                if failures or self._memory_episode.since is not None:
                    self._settle(summary)  # the server took the writes only once their reply says so
                # rows published this cycle may be to a topic the app reads (a group_by's): one
                # more look reads them
                finished = until_idle and result.idle and not result.published and self._others_drained()
                if failures and self.metrics is not None:
                    self.metrics.broker_lost(False)
                self._memory_episode.over()
                failures = 0
            except GroupMissing as exc:
                with suppress(BrokerUnavailable):  # an evicting server stops us: no group made again
                    self.lease_round.check_policy()
                log.error("%s: giving the partitions up to take them again", exc)
                for partition in list(self.lease_round.held):
                    self.lease_round.drop(partition, release=True)
                next_lease_round = 0.0
                continue
            except BrokerUnavailable as exc:
                failures += 1
                self._wait_for_broker(exc, failures)
                next_lease_round = 0.0
                continue
            except StreamWentBack:  # after a flush, say so when the app's record went too
                self._check_app_record()
                raise
            summary.cycles += 1
            summary.add(result)
            self._drop_lost(result.lost_partitions)
            if finished:
                return
            if until_idle and result.read == 0 and not result.published:  # else: look again at once
                self._stopping.wait(_IDLE_POLL_S)
        with suppress(BrokerError):  # stopped: the last acknowledgement counts (shutdown tries again)
            self._settle(summary)

    def _settle(self, summary: RunSummary) -> None:
        """Read the acknowledgement still in flight into ``summary``; give up what it lost."""
        settled = self.processor.settle()
        summary.add(settled)
        self._drop_lost(settled.lost_partitions)

    def _drop_lost(self, partitions: list[int]) -> None:
        """Give up the partitions a cycle (or its acknowledgement) found refused."""
        self.lease_round.vanished(partitions, look=True)
        for partition in partitions:
            # releasing is a no-op for a lease that moved on, and frees one whose backup went back
            self.lease_round.drop(partition, release=True)

    def _wait_for_broker(self, exc: BrokerUnavailable, failures: int) -> None:
        """Back off after a lost connection or a write refused for memory, then go on.

        Nothing read is trusted again: the batch in hand is committed (or not) locally, its entries
        stay pending, and the next cycle re-reads them and acknowledges those at or below the
        checkpoint. A server out of memory still answers: the wait stays under a lease round, so
        the leases are renewed (renewals write nothing new) while it refuses writes.
        """
        delay = min(_RECONNECT_MAX_S, _RECONNECT_MIN_S * 2 ** (failures - 1))
        delay *= random.uniform(0.5, 1.0)
        self.processor.rewind_all()
        if isinstance(exc, BrokerOutOfMemory):
            delay = min(delay, self.settings.consumer.lease_ttl_ms / 3000)
            self._memory_episode.refusal(
                exc, min(_RECONNECT_MAX_S, self.settings.consumer.lease_ttl_ms / 3000)
            )
        else:
            if self.metrics is not None:
                self.metrics.broker_lost(True)
            log.warning("%s unavailable, retrying in %.1fs: %s", exc.what, delay, exc)
            self.lease_round.connection_lost()
        self.keeper.beat(delay)
        self._stopping.wait(delay)

    def shutdown(self) -> None:
        """What ``run`` does last: leave the membership, release the leases, close the stores."""
        self.keeper.close()  # first: nothing renews what is released or left to run out below
        if self.standby is not None:
            self.standby.close()
        lost: set[int] = set()
        try:  # the last acknowledgement before the leases go (every partition is dropped below)
            lost.update(self.processor.settle().lost_partitions)
        except BrokerError as exc:
            lost.update(self.lease_round.held)
            log.warning("the last acknowledgement's reply was not read (its entries stay pending): %s", exc)
        with suppress(BrokerError):
            self.membership.leave()  # first: the others take the partitions as soon as they are free
        for partition in list(self.lease_round.held):
            try:
                self.lease_round.drop(partition, release=True, held=partition not in lost)
            except BrokerUnavailable as exc:
                log.warning("could not release leases, they expire by themselves: %s", exc)
        self.processor.close()
        self.broker.close()

    # -- ownership ------------------------------------------------------------------------------

    def _others_drained(self) -> bool:
        """True when no partition this worker does not own has entries left for the app.

        Lets ``--until-idle`` wait for partitions a peer is still working through, or whose dead
        owner's lease has yet to expire, instead of stopping with their work undone.
        """
        return not any(
            self.broker.topics.has_backlog(keys.stream_key(topic, partition), self.app.name)
            for partition in range(self._partitions)
            if partition not in self.lease_round.held
            for topic in self.app.topics
        )

    def _global_tables(self) -> GlobalTables | None:
        """The app's global tables in this worker's own store (in memory with a store factory of a test's)."""
        if not self.app.global_tables:
            return None
        state = self.settings.state
        if self._store_factory != self._open_store:
            store: StateStore = state_stores.MemoryStore()
        else:
            store = state_stores.open_globals_store(state.engine, state.dir, self.app.name, state.durability)
        counts = {topic: self.broker.topics.topic_partitions(topic) for topic in self.app.global_tables}
        return GlobalTables(self.app.global_tables.values(), store, self.broker, counts)

    def _open_store(self, group: str, partition: int) -> StateStore:
        state = self.settings.state
        return state_stores.open_store(state.engine, state.dir, group, partition, durability=state.durability)
