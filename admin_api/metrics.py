"""Broker-level Prometheus metrics, read from Redis at scrape time.

A custom collector in its own registry: every scrape asks ``service.apps.groups()`` afresh, so the
numbers are what Redis holds now (no background poller, nothing cached between scrapes), and the
process-wide default registry, where a worker keeps its own ``pspf_entries_*_total`` and
``pspf_partition_*`` series, is left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from pspf.errors import BrokerError
from pspf.service import AppLag, Service

__all__ = ["MEDIA_TYPE", "BrokerCollector", "make_registry", "render"]

logger = logging.getLogger("pspf.admin")

_LABELS = ["app", "topic", "partition"]

#: The exposition format's media type without its charset, which the web framework appends.
MEDIA_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")


def _families() -> tuple[GaugeMetricFamily, ...]:
    return (
        GaugeMetricFamily(
            "pspf_group_lag_entries",
            "Entries of the partition the app has not acknowledged yet (undelivered or pending).",
            labels=_LABELS,
        ),
        GaugeMetricFamily(
            "pspf_group_pending_entries",
            "Entries delivered to the app's consumer group and not yet acknowledged.",
            labels=_LABELS,
        ),
        GaugeMetricFamily(
            "pspf_group_oldest_pending_age_seconds",
            "Age of the oldest pending entry, from its id's time (absent when nothing is pending).",
            labels=_LABELS,
        ),
        GaugeMetricFamily(
            "pspf_dlq_entries",
            "Entries the app dead-lettered that are still in the partition's DLQ.",
            labels=_LABELS,
        ),
    )


class BrokerCollector(Collector):
    """Per app, topic and partition: lag, pending, oldest pending age and DLQ entries."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def describe(self) -> Iterable[Metric]:
        # Names only, so registering checks for clashes without a round trip to Redis.
        return [*_families(), self._up(1)]

    def collect(self) -> Iterator[Metric]:
        try:
            groups = self.service.apps.groups()
        except BrokerError as exc:
            # Redis down is a value to alert on, not a failed scrape of this process.
            logger.warning("metrics: %s", exc)
            yield self._up(0)
            return
        yield self._up(1)
        yield from self._group_families(groups)

    @staticmethod
    def _group_families(groups: list[AppLag]) -> tuple[GaugeMetricFamily, ...]:
        lag, pending, age, dead = families = _families()
        for group in groups:
            for d in group.detail:
                labels = [group.app, d.topic, str(d.partition)]
                lag.add_metric(labels, d.lag)
                pending.add_metric(labels, d.pending)
                if d.oldest_pending_age_s is not None:
                    age.add_metric(labels, d.oldest_pending_age_s)
                dead.add_metric(labels, d.dead_letters)
        return families

    @staticmethod
    def _up(value: int) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "pspf_broker_up", "1 when Redis answered the last scrape, 0 when it did not.", value=value
        )


def make_registry(service: Service) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BrokerCollector(service))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry`` (collected now)."""
    return generate_latest(registry)
