"""Repartitioning: a topic, and the topics read with it, to a new partition count, with every app's state.

The design is in ``docs/concepts/repartitioning.md``. The rooms:

- ``run``: the plan, the copies into staged keys, the switch that swaps them in, and
  ``Repartition`` that runs them in order (resumable after a crash);
- ``state``: an app's backed-up state split or merged by key into the new partition count;
- ``claim``: who runs a repartition: each topic of a plan claimed atomically before anything is
  read, and the lease the running command holds.

``pspf.service.repartition`` is the operation the CLI and the admin API call. PSPF's own modules
import the rooms by their full path, so no face sits in an import circle; the names other wings
use are re-exported here.
"""

from __future__ import annotations

from pspf.repartition.run import Plan, Repartition, dry_run, make_plan

__all__ = ["Plan", "Repartition", "dry_run", "make_plan"]
