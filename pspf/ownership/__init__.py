"""Who may work on what: partition leases, work sharing, standby stores, operators' leases.

The rooms:

- ``owning``: owning a partition: its leases on every topic the app reads, taking it on (the
  store, restored from the backup when needed) and giving it up;
- ``membership``: the live workers of an app and which of its partitions each should own;
- ``leases``: keeping a worker's leases and membership alive from a thread of their own, and
  saying what became of them;
- ``standby``: warm local stores of the partitions a worker does not own, following their backups;
- ``operation_lease``: one operator command at a time per app (reset, delete, replay).

PSPF's own modules import the rooms by their full path, so no face sits in an import circle; the
names other wings use are re-exported here.
"""

from __future__ import annotations

from pspf.ownership.leases import LeaseKeeper, Lost, say_gone, say_waiting
from pspf.ownership.membership import Member, Membership, live_members
from pspf.ownership.operation_lease import Renewal, one_at_a_time
from pspf.ownership.owning import (
    Leases,
    PartitionLeases,
    Partitions,
    StoreFactory,
    adopt_remedy,
    check_partition_count,
)
from pspf.ownership.standby import Standby

__all__ = [
    "LeaseKeeper",
    "Leases",
    "Lost",
    "Member",
    "Membership",
    "PartitionLeases",
    "Partitions",
    "Renewal",
    "Standby",
    "StoreFactory",
    "adopt_remedy",
    "check_partition_count",
    "live_members",
    "one_at_a_time",
    "say_gone",
    "say_waiting",
]
