"""Consistent copies of a state backup, read without its lease (``pspf state export``, savepoints).

The owner may write while the copy is read: the whole values hash is read, then the log from the
position read atomically with the meta before, so every value the scan caught mid-change is set
again by a later update (``partition.backup.LogReader``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from pspf.broker import Acknowledging
from pspf.errors import BrokerError
from pspf.keys import BACKUP_IDENTITY, BACKUP_NAMESPACE, ZERO_ID, BackupKeys, StreamId
from pspf.partition.backup import CHUNK, LogGap, LogReader, meta_checkpoints
from pspf.state_stores.base import field, split_field

#: How a copy names a value: ``(namespace, key)``, or the backup's own field name.
_Name = TypeVar("_Name", tuple[str, str], bytes)


def snapshot(
    acks: Acknowledging, backup: BackupKeys
) -> tuple[dict[str, StreamId], dict[tuple[str, str], bytes]] | None:
    """A consistent copy of a backup (checkpoints, values) while its owner may write; None: none."""
    return _consistent(acks, backup, split_field, lambda name: name)


def snapshot_fields(
    acks: Acknowledging, backup: BackupKeys
) -> tuple[dict[str, StreamId], dict[bytes, bytes]] | None:
    """``snapshot`` by the backup's own field names (``namespace NUL key``): a third of its memory."""
    return _consistent(acks, backup, lambda raw: raw, lambda name: field(*name))


def _consistent(
    acks: Acknowledging,
    backup: BackupKeys,
    from_hash: Callable[[bytes], _Name],
    from_log: Callable[[tuple[str, str]], _Name],
) -> tuple[dict[str, StreamId], dict[_Name, bytes]] | None:
    """Read the whole values hash, then the log's updates from the position read with the meta."""
    for _ in range(3):
        meta, last = acks.backup_head(backup)
        identity = meta.get(BACKUP_IDENTITY, "")
        if not identity:
            return None
        checkpoints = meta_checkpoints(meta)
        values: dict[_Name, bytes | None] = {
            from_hash(raw): value for page in acks.backup_values(backup, CHUNK) for raw, value in page
        }
        reader = LogReader(acks, backup.log, last or str(ZERO_ID).encode(), identity)
        try:
            while updates := reader.read():
                for update in updates:
                    for written, value in update.updates.items():
                        values[from_log(written)] = value
                    checkpoints.update(update.checkpoints)
        except LogGap:
            continue
        gone = [name for name, value in values.items() if value is None]
        gone.append(from_log((BACKUP_NAMESPACE, BACKUP_IDENTITY)))
        for name in gone:  # in place: a copy would double what a large backup takes
            values.pop(name, None)
        return checkpoints, cast(dict[_Name, bytes], values)
    raise BrokerError(
        f"the state backup {backup.values} changed faster than it could be read: try again, or "
        "read a local store with --state-dir"
    )
