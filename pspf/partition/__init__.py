"""One owned partition: what a worker holds for it, its batch's ONE commit, and its state backup.

A worker that owns partition ``p`` of its app (``pspf.ownership``) builds an ``OwnedPartition``
and the cycle (``pspf.cycle``) works on it until the worker gives it up. The rooms:

- ``owned``: the partition's stream cursors, store and bookkeeping, and ``Read`` (one stream's
  entries read in a cycle);
- ``batch``: the overlay handlers see, the ONE store transaction of a batch;
- ``durability``: a committed batch made durable: the fenced acknowledgement with the backup's update;
- ``backup``: the state backup in Redis that lets the partition's state follow it anywhere: its
  keys, its log, restore and catch-up;
- ``copies``: consistent copies of a backup read without its lease (export, savepoints);
- ``adoption``: which store is the partition's state after Redis lost its data.

PSPF's own modules import the rooms by their full path, so no face sits in an import circle; the
names other wings use are re-exported here.
"""

from __future__ import annotations

from pspf.partition.adoption import Adoption, adoption_of, compare, shown, stamp_of, trusted_identity
from pspf.partition.backup import (
    LogGap,
    LogReader,
    PartitionBackup,
    Restored,
    catch_up,
    delete_backup,
    field,
    locate,
    meta_checkpoints,
    restore,
    split_field,
)
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.copies import snapshot, snapshot_fields
from pspf.partition.durability import Durability, flush
from pspf.partition.owned import OwnedPartition, Read, StreamCursor, check_tail, parked

__all__ = [
    "Adoption",
    "Durability",
    "LogGap",
    "LogReader",
    "OwnedPartition",
    "PartitionBackup",
    "PartitionBatch",
    "Read",
    "Restored",
    "StreamCursor",
    "StreamOutcome",
    "adoption_of",
    "catch_up",
    "check_tail",
    "compare",
    "delete_backup",
    "field",
    "flush",
    "locate",
    "meta_checkpoints",
    "parked",
    "restore",
    "shown",
    "snapshot",
    "snapshot_fields",
    "split_field",
    "stamp_of",
    "trusted_identity",
]
