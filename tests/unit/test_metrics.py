"""Health rules, scrape-time gauges, settings and hook chaining of the worker metrics, without Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pspf import ProcessorHooks, Settings
from pspf.broker import GroupPosition
from pspf.errors import BrokerUnavailable, ConfigError
from pspf.failures import Failure
from pspf.hooks import HookChain
from pspf.keys import stream_key
from pspf.observability.metrics import WorkerHealth, WorkerMetrics


class FakeBroker:
    """Answers ``topics.group_position`` from a table of lags; ``down`` makes every call fail."""

    def __init__(self) -> None:
        self.lag: dict[str, int] = {}
        self.down = False
        self.conn = self.client = self.topics = self
        self.pings = 0

    @contextmanager
    def translate_errors(self, key: str | None = None) -> Iterator[None]:
        yield

    def ping(self) -> bool:
        self.pings += 1
        if self.down:
            raise BrokerUnavailable("cannot reach Redis")
        return True

    def group_position(self, stream: str, group: str) -> GroupPosition:
        if self.down:
            raise BrokerUnavailable("cannot reach Redis")
        lag = self.lag.get(stream, 0)
        return GroupPosition(lag, None, None, 0, lag, None, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts() -> tuple[WorkerMetrics, FakeBroker, Clock]:
    broker, clock = FakeBroker(), Clock()
    metrics = WorkerMetrics("app", ["orders"], broker, stuck_after_s=10, clock=clock)  # type: ignore[arg-type]
    return metrics, broker, clock


def samples(metrics: WorkerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_a_standby_that_owns_nothing_is_healthy_but_notices_a_lost_redis(
    parts: tuple[WorkerMetrics, FakeBroker, Clock],
) -> None:
    metrics, broker, _ = parts
    health = metrics.health()
    assert health == WorkerHealth("ok", 0, None, 0)
    assert broker.pings == 1
    broker.down = True
    assert metrics.health().status == "broker_unavailable"


def test_stuck_counts_from_the_take_then_from_the_last_commit(
    parts: tuple[WorkerMetrics, FakeBroker, Clock],
) -> None:
    metrics, broker, clock = parts
    broker.lag[stream_key("orders", 1)] = 5
    metrics.partition_taken(0)  # no lag: never stuck
    metrics.partition_taken(1)
    clock.now += 10
    assert metrics.health().status == "ok"
    clock.now += 0.5
    health = metrics.health()
    assert (health.status, health.lag, health.partitions_owned) == ("stuck", 5, 2)

    metrics.on_commit(1, 0.001)
    assert metrics.health().status == "ok"
    assert metrics.health().last_commit_age_s == 0
    clock.now += 10.5
    assert metrics.health().status == "stuck"
    metrics.on_batch_committed("orders", 1, 0, 3)  # entries already done, acknowledged: progress
    assert metrics.health().status == "ok"
    clock.now += 10.5
    broker.lag.clear()
    assert metrics.health().status == "ok"  # no lag: nothing to be stuck on

    metrics.partition_released(1)
    broker.lag[stream_key("orders", 1)] = 5
    assert metrics.health().partitions_owned == 1
    assert metrics.health().status == "ok"  # not ours any more


def test_the_worker_loop_losing_redis_is_unhealthy_even_when_the_check_gets_through(
    parts: tuple[WorkerMetrics, FakeBroker, Clock],
) -> None:
    metrics, _, _ = parts
    metrics.partition_taken(0)
    metrics.broker_lost(True)
    health = metrics.health()
    assert (health.status, health.lag) == ("broker_unavailable", None)
    metrics.broker_lost(False)
    assert metrics.health().status == "ok"


def test_scrape_reports_gauges_and_skips_redis_ones_when_redis_is_down(
    parts: tuple[WorkerMetrics, FakeBroker, Clock],
) -> None:
    metrics, broker, _ = parts
    broker.lag[stream_key("orders", 3)] = 7
    metrics.partition_taken(3)
    found = samples(metrics)
    labels = {"app": "app", "topic": "orders", "partition": "3"}
    assert found["pspf_partition_lag_entries"] == [(labels, 7.0)]
    assert found["pspf_partition_pending_entries"] == [(labels, 7.0)]
    assert found["pspf_partitions_owned"] == [({"app": "app"}, 1.0)]
    assert found["pspf_last_commit_timestamp_seconds"] == [({"app": "app"}, 0.0)]
    # A taken partition's counters exist at 0 before anything happened.
    assert found["pspf_entries_dead_lettered_total"] == [(labels, 0.0)]

    broker.down = True
    found = samples(metrics)
    assert "pspf_partition_lag_entries" not in found
    assert found["pspf_partitions_owned"] == [({"app": "app"}, 1.0)]


def test_hooks_count_per_topic_and_partition(parts: tuple[WorkerMetrics, FakeBroker, Clock]) -> None:
    metrics, _, clock = parts
    failure = Failure(attempts=1, first_failed_ms=1, last_failed_ms=1, error_type="E", message="m")
    metrics.on_batch_committed("orders", 2, 5, 1)
    metrics.on_batch_committed("orders", 2, 0, 2)
    metrics.on_failure("orders", 2, "1-0", failure)
    metrics.on_failure("orders", 2, "1-0", failure)
    metrics.on_retry("orders", 2, "1-0", failure)
    metrics.on_read(40)
    metrics.on_commit(2, 0.002)
    metrics.on_ack(0.001)
    found = samples(metrics)
    labels = {"app": "app", "topic": "orders", "partition": "2"}
    assert found["pspf_entries_processed_total"] == [(labels, 5.0)]
    assert found["pspf_entries_skipped_total"] == [(labels, 3.0)]
    assert found["pspf_entries_failed_total"] == [(labels, 2.0)]
    assert found["pspf_entries_retried_total"] == [(labels, 1.0)]
    assert found["pspf_batch_size_entries_sum"] == [({"app": "app"}, 40.0)]
    assert found["pspf_commit_duration_seconds_count"] == [({"app": "app"}, 1.0)]
    assert found["pspf_ack_duration_seconds_count"] == [({"app": "app"}, 1.0)]
    assert found["pspf_last_commit_timestamp_seconds"] == [({"app": "app"}, clock.now)]


def test_two_workers_metrics_do_not_share_a_registry() -> None:
    first = WorkerMetrics("a", ["t"], FakeBroker())  # type: ignore[arg-type]
    second = WorkerMetrics("a", ["t"], FakeBroker())  # type: ignore[arg-type]
    first.on_batch_committed("t", 0, 4, 0)
    assert samples(first)["pspf_entries_processed_total"][0][1] == 4
    assert samples(second).get("pspf_entries_processed_total", []) == []


def test_a_hook_chain_calls_every_hook_even_after_one_fails() -> None:
    calls: list[tuple[str, Any]] = []

    class Broken(ProcessorHooks):
        def on_commit(self, partition: int, seconds: float) -> None:
            raise RuntimeError("broken hook")

    class Recorder(ProcessorHooks):
        def on_commit(self, partition: int, seconds: float) -> None:
            calls.append(("commit", partition))

        def on_read(self, entries: int) -> None:
            calls.append(("read", entries))

    chain = HookChain(Broken(), Recorder())
    chain.on_commit(3, 0.1)
    chain.on_read(7)
    chain.on_ack(0.1)  # neither overrides it: the base no-op
    assert calls == [("commit", 3), ("read", 7)]


def test_metrics_settings_from_the_environment() -> None:
    settings = Settings.load(
        environ={"PSPF_METRICS_PORT": "9100", "PSPF_METRICS_HOST": "0.0.0.0", "PSPF_STUCK_AFTER_S": "2.5"}
    )
    assert (settings.metrics.port, settings.metrics.host, settings.metrics.stuck_after_s) == (
        9100,
        "0.0.0.0",
        2.5,
    )
    defaults = Settings.load(environ={})
    assert (defaults.metrics.port, defaults.metrics.host, defaults.metrics.stuck_after_s) == (
        None,
        "127.0.0.1",
        60.0,
    )
    with pytest.raises(ConfigError, match="PSPF_METRICS_PORT"):
        Settings.load(environ={"PSPF_METRICS_PORT": "70000"})
    with pytest.raises(ConfigError, match="PSPF_STUCK_AFTER_S"):
        Settings.load({"PSPF_STUCK_AFTER_S": 0}, environ={})
