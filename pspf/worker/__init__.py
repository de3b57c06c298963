"""A worker process: ownership, the batch cycle and clean shutdown wired together (``pspf.Worker``).

``pspf run module:attr`` and ``Worker(app, settings).run()`` start one. The rooms:

- ``process``: the ``Worker``: its start checks, its loop (a lease round, then cycles; reconnects),
  its signals and its ``RunSummary``;
- ``lease_round``: the round every third of the lease TTL that takes, keeps and gives up the
  worker's partitions (``worker.lease_round.step()``, a public step tests call too);
- ``retention``: trimming a topic's streams without removing an entry anyone still needs (the
  worker trims its own partitions; ``pspf topic trim`` uses it too).

The leases, membership and standby stores it keeps are in ``pspf.ownership``, the cycle it runs in
``pspf.cycle``. This face is a public path: ``from pspf.worker import Worker, RunSummary``.
"""

from __future__ import annotations

from pspf.worker.lease_round import LeaseRound
from pspf.worker.process import RunSummary, Worker, default_consumer_name
from pspf.worker.retention import PartitionTrim, Retention

__all__ = ["LeaseRound", "PartitionTrim", "Retention", "RunSummary", "Worker", "default_consumer_name"]
