"""A worker process: ownership, the batch cycle and clean shutdown wired together (``pspf.Worker``).

``pspf run module:attr`` and ``Worker(app, settings).run()`` start one. The rooms:

- ``process``: the ``Worker``: its loop (lease rounds, cycles, reconnects), its signals and its
  ``RunSummary``;
- ``retention``: trimming a topic's streams without removing an entry anyone still needs (the
  worker trims its own partitions; ``pspf topic trim`` uses it too).

The leases, membership and standby stores it keeps are in ``pspf.ownership``, the cycle it runs in
``pspf.cycle``. This face is a public path: ``from pspf.worker import Worker, RunSummary``.
"""

from __future__ import annotations

from pspf.worker.process import RunSummary, Worker, default_consumer_name
from pspf.worker.retention import PartitionTrim, Retention

__all__ = ["PartitionTrim", "Retention", "RunSummary", "Worker", "default_consumer_name"]
