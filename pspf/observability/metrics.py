"""Prometheus metrics and a health endpoint for one worker.

``WorkerMetrics`` is a set of processor hooks that count what the worker does in a registry of its
own (never the process-wide one, so several workers in one process do not clash). Gauges that need
Redis (lag, pending entries) are computed when scraped, from the consumer group, so the hot path
pays nothing for them. ``MetricsServer`` serves ``GET /metrics`` (Prometheus text format) and
``GET /healthz`` (JSON, 200 when healthy, 503 otherwise) from a daemon thread.

Health rules: a worker is ``broker_unavailable`` while its loop waits to reconnect to Redis or
when the health check cannot reach Redis itself; ``broker_out_of_memory`` while the server refuses
its writes for memory (maxmemory reached) and it waits to retry; it is ``stuck`` when it owns a partition with
lag and has not committed anything for it for ``stuck_after_s`` (counted from when it took the
partition if it never did); otherwise it is ``ok``, also as a standby that owns nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, NamedTuple

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pspf import keys
from pspf.broker import Broker, GroupPosition
from pspf.errors import BrokerError, BrokerOutOfMemory, ConfigError
from pspf.failures import DeadLetter, Failure
from pspf.hooks import ProcessorHooks
from pspf.outbox.rows import OutboxRow, RowState

log = logging.getLogger("pspf.metrics")
#: What a worker says of its own episodes (``MemoryEpisode``) is logged under the worker's name.
_worker_log = logging.getLogger("pspf.worker")

#: What ``generate_latest`` writes: the classic text format, which every Prometheus reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Entries per cycle: up to ``batch_size`` per owned stream.
BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 50_000, 100_000)
#: A local commit or an ack round trip usually takes well under a millisecond.
DURATION_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

Status = Literal["ok", "stuck", "broker_unavailable", "broker_out_of_memory"]


_ENTRY = ("app", "topic", "partition")
_APP = ("app",)


class _Instruments(NamedTuple):
    """A worker's series: per entry ones by (app, topic, partition; late ones also window), others by app."""

    processed: Counter
    skipped: Counter
    failed: Counter
    retried: Counter
    dead_lettered: Counter
    late: Counter
    batch_size: Histogram
    commit_duration: Histogram
    ack_duration: Histogram
    members: Gauge
    rebalances: Counter
    outbox_rows: Gauge
    outbox_published: Counter
    outbox_latency: Histogram
    outbox_failed: Counter
    outbox_dead: Counter
    out_of_memory: Gauge
    refused: Counter
    global_lag: Gauge


#: Per series (a field of ``_Instruments``): its kind, name, help, labels and histogram buckets.
#: A series labelled by app alone is bound to the worker's app at once.
_SERIES: dict[str, tuple[type[Counter | Gauge | Histogram], str, str, tuple[str, ...], tuple[float, ...]]] = {
    "processed": (Counter, "pspf_entries_processed", "Entries a handler completed, committed.", _ENTRY, ()),
    "skipped": (
        Counter,
        "pspf_entries_skipped",
        "Entries acknowledged without a handler: at or below the checkpoint, or redriven for another app.",
        _ENTRY,
        (),
    ),
    "failed": (
        Counter,
        "pspf_entries_failed",
        "Failed attempts, undecodable and poison entries included.",
        _ENTRY,
        (),
    ),
    "retried": (Counter, "pspf_entries_retried", "Failed entries that will be tried again.", _ENTRY, ()),
    "dead_lettered": (Counter, "pspf_entries_dead_lettered", "Entries moved to the DLQ.", _ENTRY, ()),
    "late": (
        Counter,
        "pspf_window_late_entries",
        "Entries that came after all their windows of a window aggregation closed: not applied to it.",
        (*_ENTRY, "window"),
        (),
    ),
    "batch_size": (
        Histogram,
        "pspf_batch_size_entries",
        "Entries read per cycle that read any.",
        _APP,
        BATCH_BUCKETS,
    ),
    "commit_duration": (
        Histogram,
        "pspf_commit_duration_seconds",
        "Duration of one state store transaction (a partition's batch).",
        _APP,
        DURATION_BUCKETS,
    ),
    "ack_duration": (
        Histogram,
        "pspf_ack_duration_seconds",
        "Duration of a cycle's acknowledging round trip to Redis.",
        _APP,
        DURATION_BUCKETS,
    ),
    "members": (Gauge, "pspf_members", "Live workers of the app, as this worker last saw them.", _APP, ()),
    "rebalances": (
        Counter,
        "pspf_rebalances",
        "Changes of the partitions this worker should own (members joined or left).",
        _APP,
        (),
    ),
    "outbox_rows": (
        Gauge,
        "pspf_outbox_rows",
        "Outbox rows of an owned partition by state.",
        ("app", "partition", "state"),
        (),
    ),
    "outbox_published": (
        Counter,
        "pspf_outbox_published",
        "Outbox rows published (emitted entries added to their topics).",
        _APP,
        (),
    ),
    "outbox_latency": (
        Histogram,
        "pspf_outbox_publish_latency_seconds",
        "From an emitting batch's commit to its row's publish.",
        _APP,
        DURATION_BUCKETS,
    ),
    "outbox_failed": (
        Counter,
        "pspf_outbox_failed_attempts",
        "Publish attempts of outbox rows that failed.",
        _APP,
        (),
    ),
    "outbox_dead": (
        Counter,
        "pspf_outbox_dead",
        "Outbox rows that became DEAD (attempts exhausted).",
        _APP,
        (),
    ),
    "out_of_memory": (
        Gauge,
        "pspf_broker_out_of_memory",
        "1 while the server refuses this worker's writes for memory (maxmemory reached) and the "
        "worker waits to retry, else 0.",
        _APP,
        (),
    ),
    "refused": (
        Counter,
        "pspf_broker_refused_calls",
        "Calls of this worker the server refused for memory (each is retried after a backoff).",
        _APP,
        (),
    ),
    "global_lag": (
        Gauge,
        "pspf_global_table_lag_entries",
        "Entries a global table's streams hold past this worker's positions, as last counted "
        "(every few seconds).",
        ("app", "table"),
        (),
    ),
}


def _instruments(registry: CollectorRegistry, app: str) -> _Instruments:
    """Declare every series of ``_SERIES`` in ``registry``."""
    made: dict[str, Any] = {}
    for field, (kind, name, text, labels, buckets) in _SERIES.items():
        series: Counter | Gauge | Histogram
        if kind is Histogram:
            series = Histogram(name, text, labels, registry=registry, buckets=buckets)
        else:
            series = kind(name, text, labels, registry=registry)
        made[field] = series.labels(app) if labels == _APP else series
    return _Instruments(**made)


class WorkerHealth(msgspec.Struct, frozen=True):
    """What ``GET /healthz`` answers; ``lag`` is None when Redis could not be asked."""

    status: Status
    partitions_owned: int
    last_commit_age_s: float | None
    lag: int | None


@dataclass(slots=True)
class _Series:
    """The counters of one (topic, partition), looked up once instead of per call."""

    processed: Any
    skipped: Any
    failed: Any
    retried: Any
    dead_lettered: Any


class WorkerMetrics(ProcessorHooks):
    """Counts what a worker's processor does and reports its partitions' lag and health.

    The worker tells it which partitions it owns and whether its loop lost Redis; ``broker``
    is used only when scraped or asked for health (give it a connection pool of its own, so a
    scrape never waits behind the worker's reads).
    """

    def __init__(
        self,
        app: str,
        topics: Sequence[str],
        broker: Broker,
        stuck_after_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.app = app
        self.topics = list(topics)
        self.broker = broker
        self.stuck_after_s = stuck_after_s
        self._clock = clock
        self.registry = CollectorRegistry()
        self.m = _instruments(self.registry, app)
        self._series: dict[tuple[str, int], _Series] = {}
        self._lock = threading.Lock()
        #: owned partition -> unix time it was taken
        self._taken: dict[int, float] = {}
        #: owned partition -> unix time of its last commit (or batch of done entries)
        self._progress: dict[int, float] = {}
        self._last_commit = 0.0
        self._broker_lost = False
        self._refusing = False
        self.registry.register(_ScrapeCollector(self))

    # -- what the worker reports ----------------------------------------------------------------

    def partition_taken(self, partition: int) -> None:
        """The worker owns ``partition`` from now on; its counters start at 0 if new."""
        for topic in self.topics:
            self._counters(topic, partition)
        with self._lock:
            self._taken[partition] = self._clock()
            self._progress.pop(partition, None)

    def partition_released(self, partition: int) -> None:
        with self._lock:
            self._taken.pop(partition, None)
            self._progress.pop(partition, None)
        for state in RowState:
            with suppress(KeyError):
                self.m.outbox_rows.remove(self.app, str(partition), str(state))

    def members_seen(self, members: int, rebalanced: bool) -> None:
        """The live members at a lease round, and whether this worker's target changed."""
        self.m.members.set(members)
        if rebalanced:
            self.m.rebalances.inc()

    def broker_lost(self, lost: bool) -> None:
        """The worker's loop is (True) or is no longer (False) waiting to reconnect to Redis."""
        self._broker_lost = lost

    def out_of_memory(self, refused: bool) -> None:
        """A call was refused for memory (True), or the worker's calls go through again (False)."""
        if refused:
            self.m.refused.inc()
        self._refusing = refused
        self.m.out_of_memory.set(1 if refused else 0)

    def global_tables_lag(self, behind: dict[str, int]) -> None:
        """The entries each global table is behind, as the worker just counted them."""
        for table, entries in behind.items():
            self.m.global_lag.labels(self.app, table).set(entries)

    # -- processor hooks ------------------------------------------------------------------------

    def on_read(self, entries: int) -> None:
        self.m.batch_size.observe(entries)

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        series = self._counters(topic, partition)
        if handled:
            series.processed.inc(handled)
        if skipped:
            series.skipped.inc(skipped)
        now = self._clock()
        with self._lock:
            if partition in self._taken:
                self._progress[partition] = now

    def on_commit(self, partition: int, seconds: float) -> None:
        self.m.commit_duration.observe(seconds)
        now = self._clock()
        with self._lock:
            self._last_commit = now
            if partition in self._taken:
                self._progress[partition] = now

    def on_ack(self, seconds: float) -> None:
        self.m.ack_duration.observe(seconds)

    def on_failure(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        self._counters(topic, partition).failed.inc()

    def on_retry(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        self._counters(topic, partition).retried.inc()

    def on_dead_letter(self, record: DeadLetter) -> None:
        self._counters(record.source_topic, record.source_partition).dead_lettered.inc()

    def on_late(self, window: str, topic: str, partition: int, entries: int) -> None:
        self.m.late.labels(self.app, topic, str(partition), window).inc(entries)

    def on_outbox_settled(
        self, partition: int, published: list[tuple[int, int]], failed: list[OutboxRow]
    ) -> None:
        if published:
            self.m.outbox_published.inc(len(published))
            for created_ms, published_ms in published:
                self.m.outbox_latency.observe(max(0, published_ms - created_ms) / 1000)
        if failed:
            self.m.outbox_failed.inc(len(failed))
            dead = sum(1 for row in failed if row.state is RowState.DEAD)
            if dead:
                self.m.outbox_dead.inc(dead)

    def on_outbox_rows(self, partition: int, counts: dict[RowState, int]) -> None:
        for state, count in counts.items():
            self.m.outbox_rows.labels(self.app, str(partition), str(state)).set(count)

    def _counters(self, topic: str, partition: int) -> _Series:
        series = self._series.get((topic, partition))
        if series is None:
            values = (self.app, topic, str(partition))
            series = self._series[(topic, partition)] = _Series(
                self.m.processed.labels(*values),
                self.m.skipped.labels(*values),
                self.m.failed.labels(*values),
                self.m.retried.labels(*values),
                self.m.dead_lettered.labels(*values),
            )
        return series

    # -- scrape time ----------------------------------------------------------------------------

    def owned(self) -> dict[int, float]:
        """Owned partitions and when each was taken (unix time)."""
        with self._lock:
            return dict(self._taken)

    @property
    def last_commit(self) -> float:
        """Unix time of the last store commit; 0 before any."""
        return self._last_commit

    def positions(self, partitions: Sequence[int]) -> dict[tuple[str, int], GroupPosition] | None:
        """The app's group position in each owned stream; None when Redis cannot be asked.

        With nothing owned it still pings, so a standby notices a lost Redis too.
        """
        found: dict[tuple[str, int], GroupPosition] = {}
        try:
            if not partitions:
                with self.broker.conn.translate_errors():
                    self.broker.conn.client.ping()
            for partition in sorted(partitions):
                for topic in self.topics:
                    stream = keys.stream_key(topic, partition)
                    found[(topic, partition)] = self.broker.topics.group_position(stream, self.app)
        except BrokerError as exc:
            log.debug("metrics: cannot read group positions: %s", exc)
            return None
        return found

    def health(self) -> WorkerHealth:
        """The worker's health now (see the module docstring for the rules)."""
        with self._lock:
            taken = dict(self._taken)
            progress = dict(self._progress)
            last_commit = self._last_commit
        positions = self.positions(list(taken))
        now = self._clock()
        age = round(max(0.0, now - last_commit), 3) if last_commit else None
        if positions is None or self._broker_lost:
            return WorkerHealth("broker_unavailable", len(taken), age, None)
        lag = {partition: 0 for partition in taken}
        for (_, partition), position in positions.items():
            lag[partition] += position.lag
        stuck = any(
            lag[partition] > 0 and now - progress.get(partition, since) > self.stuck_after_s
            for partition, since in taken.items()
        )
        status: Status = "broker_out_of_memory" if self._refusing else "stuck" if stuck else "ok"
        return WorkerHealth(status, len(taken), age, sum(lag.values()))


class _ScrapeCollector(Collector):
    """Gauges computed when scraped: ownership, last commit, and lag and pending from Redis."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        owned = m.owned()
        gauge = GaugeMetricFamily("pspf_partitions_owned", "Partitions this worker owns.", labels=["app"])
        gauge.add_metric([m.app], len(owned))
        yield gauge
        gauge = GaugeMetricFamily(
            "pspf_last_commit_timestamp_seconds",
            "Unix time of the worker's last state store commit; 0 before any.",
            labels=["app"],
        )
        gauge.add_metric([m.app], m.last_commit)
        yield gauge
        positions = m.positions(list(owned))
        if positions is None:
            return  # Redis is unreachable: report what we know, not a failed scrape
        labels = ["app", "topic", "partition"]
        lag = GaugeMetricFamily(
            "pspf_partition_lag_entries",
            "Entries of an owned partition the app has not acknowledged (undelivered or pending).",
            labels=labels,
        )
        pending = GaugeMetricFamily(
            "pspf_partition_pending_entries",
            "Entries of an owned partition delivered and not acknowledged yet.",
            labels=labels,
        )
        for (topic, partition), position in positions.items():
            lag.add_metric([m.app, topic, str(partition)], position.lag)
            pending.add_metric([m.app, topic, str(partition)], position.pending)
        yield lag
        yield pending


class _Handler(BaseHTTPRequestHandler):
    """GET /metrics and GET /healthz; anything else is 404."""

    metrics: WorkerMetrics
    server_version = "pspf"

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        try:
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE, generate_latest(self.metrics.registry))
            elif path == "/healthz":
                health = self.metrics.health()
                code = 200 if health.status == "ok" else 503
                self._reply(code, "application/json", msgspec.json.encode(health))
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n")
        except Exception:
            log.exception("metrics: answering %s failed", path)
            self._reply(500, "text/plain; charset=utf-8", b"internal error\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves a worker's ``/metrics`` and ``/healthz`` from a daemon thread until closed."""

    def __init__(self, metrics: WorkerMetrics, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"metrics": metrics})
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server = server_class((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="pspf-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): the real port when 0 was asked for."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class MemoryEpisode:
    """An out-of-memory episode of a worker: a time the server refuses its writes for memory.

    Logged once when it starts and once when it ends (not per retry), and exported in the
    metrics while it lasts.
    """

    def __init__(self, metrics: WorkerMetrics | None) -> None:
        self.metrics = metrics
        self.since: float | None = None
        self.refused = 0

    def refusal(self, exc: BrokerOutOfMemory, retry_in_s: float) -> None:
        if self.since is None:
            self.since = time.monotonic()
            _worker_log.error(
                "%s; the worker keeps its leases where it can, acknowledges nothing that is not "
                "committed and retries (every %.1fs at most) until memory is freed",
                exc,
                retry_in_s,
            )
        self.refused += 1
        if self.metrics is not None:
            self.metrics.out_of_memory(True)

    def over(self) -> None:
        """The worker's calls went through again: the episode (if any) ends."""
        if self.since is None:
            return
        _worker_log.warning(
            "the server accepts writes again after %.1fs out of memory (%s calls refused)",
            time.monotonic() - self.since,
            self.refused,
        )
        self.since, self.refused = None, 0
        if self.metrics is not None:
            self.metrics.out_of_memory(False)
