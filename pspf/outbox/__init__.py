"""The outbox: what handlers emit, committed with their batch, then published exactly once.

``ctx.emit`` (and a closed window's result) goes through the rooms in this order:

- ``emit``: an emitted entry checked, encoded, its partition picked, its source named;
- ``partition_outbox``: one owned partition's outbox rows: written with its batches (in the
  batch's ONE store transaction), indexed in memory while they wait;
- ``rows``: the outbox row, its states and its encoding in the store and the state backup;
- ``relay``: publishes a partition's confirmed rows, idempotently, after their batch was
  acknowledged (DESIGN step 7).

PSPF's own modules import the rooms by their full path, so no face sits in an import circle; the
names other wings use are re-exported here, except the relay's: ``pspf.hooks`` names the row types
of this wing and the relay calls those hooks, so this face leaves the relay unloaded (import
``Relay`` from ``pspf.outbox.relay``).
"""

from __future__ import annotations

from pspf.outbox.emit import SOURCE_ID_HEADER, SOURCE_TOPIC_HEADER, Emitted, Emitter
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.outbox.rows import OutboxRow, RowState, rows_in_backup, rows_in_store

__all__ = [
    "SOURCE_ID_HEADER",
    "SOURCE_TOPIC_HEADER",
    "Emitted",
    "Emitter",
    "OutboxRow",
    "PartitionOutbox",
    "RowState",
    "rows_in_backup",
    "rows_in_store",
]
