"""The batch cycle: read, handle, commit, acknowledge and publish, over the partitions a worker owns.

``processor`` is the table of contents: ``BatchProcessor.run_once`` runs one cycle and names the
room that holds each step. The rooms:

- ``processor``: the cycle, step by step, and the invariants it keeps;
- ``delivery``: what each cycle reads (pending entries first, parked entries when due) and which
  entries need a handler;
- ``ordering``: id order across a partition's topics, for apps with tables;
- ``attempts``: the one attempt loop the worker and ``TestApp`` share: run a read's entries,
  settle each failure;
- ``execution``: running handlers over a stream's entries, sync in id order, async concurrently;
- ``timekeeping``: what time does in a batch: windows closed, callbacks, timers, state expiry.

What a partition holds and how its batch is made durable live in ``pspf.partition.owned``; the outbox
and the relay of step 7 in ``pspf.outbox.rows``. PSPF's own modules import the rooms by their full
path, so no face sits in an import circle; the names other wings use are re-exported here.
"""

from __future__ import annotations

from pspf.cycle.attempts import Attempts
from pspf.cycle.execution import Entry
from pspf.cycle.processor import BatchProcessor
from pspf.cycle.timekeeping import Clock, TimeKeeping

__all__ = ["Attempts", "BatchProcessor", "Clock", "Entry", "TimeKeeping"]
