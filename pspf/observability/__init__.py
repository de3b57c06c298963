"""What a running worker tells the outside: Prometheus metrics, a health check, OpenTelemetry spans.

The rooms:

- ``metrics``: a worker's metrics (processor hooks counting into a registry of its own), its
  ``/metrics`` and ``/healthz`` server, and the episodes it logs (the server out of memory);
- ``tracing``: a span per handled entry and per batch commit, when a tracer provider is set.

Logs use the logger of the module that writes them (``pspf.worker``, ``pspf.ownership``, ...). PSPF's
own modules import the rooms by their full path, so no face sits in an import circle; the names
other wings use are re-exported here.
"""

from __future__ import annotations

from pspf.observability.metrics import MemoryEpisode, MetricsServer, WorkerMetrics
from pspf.observability.tracing import TracedContext, Tracing, configured, sync_run

__all__ = [
    "MemoryEpisode",
    "MetricsServer",
    "TracedContext",
    "Tracing",
    "WorkerMetrics",
    "configured",
    "sync_run",
]
