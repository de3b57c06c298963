"""The idempotent tier: each batch written as ONE object whose name is deterministic in its entries.

For a target without transactions (files, object stores, search indexes): a batch of one
partition goes out as one object named by (topic, partition, first id, last id), written all or
nothing (a file renamed into place, an object PUT), so writing the same batch again replaces it,
never doubles it. The object also carries the partition's position: the checkpoints and the
processor's bookkeeping after the batch (which entries are dead, which consumers applied what),
as an opaque blob. At takeover the blob of the partition's latest object is read back: a new
owner re-reads the pending entries in batches of other bounds than the ones written, so the
position, not the names alone, is what keeps a replayed entry from being written twice.

A commit that writes no record (every entry of the batch failed) writes no object; what it
changed in the bookkeeping is kept in memory, and a crash before its acknowledgement reads those
entries again, as for any commit that did not happen.

The target is not fenced: a worker paused past its lease TTL with a batch in hand may still
write it after its successor started, under other bounds (``docs/how-to/sinks.md`` says so).

A new idempotent sink implements ``IdempotentSink.target`` and ``IdempotentPartition``; the
consumer machinery (group, leases, work sharing, DLQ, metrics) is ``Sink``'s, shared with the
transactional tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar, NamedTuple

import msgspec

from pspf.keys import StreamId
from pspf.sink.base import Sink, SinkPartition, SinkRecord, Updates


class BatchName(NamedTuple):
    """What a batch object is named by: the same entries, the same name."""

    topic: str
    partition: int
    first: StreamId
    last: StreamId

    @classmethod
    def of(cls, records: Sequence[SinkRecord]) -> BatchName:
        """The name of a batch of one partition (its records in any order)."""
        ids = sorted(StreamId.parse(r.entry_id) for r in records)
        return cls(records[0].topic, records[0].partition, ids[0], ids[-1])

    def __str__(self) -> str:
        return f"{self.first}_{self.last}"


class IdempotentPartition(ABC):
    """One topic partition's batches in the target."""

    @abstractmethod
    def write(self, name: BatchName, records: Sequence[SinkRecord], position: bytes) -> None:
        """Write ``records`` and ``position`` as ONE object named ``name``, all or nothing.

        An object of that name is replaced. Raises ``SinkUnavailable`` when the target cannot be
        reached, ``RowsRefused`` for records it refuses (then nothing was written).
        """

    @abstractmethod
    def last(self) -> bytes | None:
        """The ``position`` of this partition's object with the highest last id; None if none."""

    def close(self) -> None:
        """Release what the partition holds (nothing, unless the target says otherwise)."""
        return None


class Position(msgspec.Struct, array_like=True):
    """A partition's checkpoints and bookkeeping, as stored with each batch."""

    values: list[tuple[str, str, bytes]]
    checkpoints: dict[str, tuple[int, int]]


class BatchPartition(SinkPartition):
    """A ``SinkPartition`` over an ``IdempotentPartition``: a commit writes one batch object."""

    def __init__(self, target: IdempotentPartition) -> None:
        self.target = target
        self.values: dict[tuple[str, str], bytes] = {}
        self.checkpoints: dict[str, StreamId] = {}

    def claim(self) -> tuple[dict[tuple[str, str], bytes], dict[str, StreamId]]:
        raw = self.target.last()
        if raw is not None:
            position = msgspec.msgpack.decode(raw, type=Position)
            self.values = {(ns, key): value for ns, key, value in position.values}
            self.checkpoints = {t: StreamId(*c) for t, c in position.checkpoints.items()}
        return dict(self.values), dict(self.checkpoints)

    def commit(
        self, records: Sequence[SinkRecord], updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> None:
        values = dict(self.values)
        for name, value in updates.items():
            if value is None:
                values.pop(name, None)
            else:
                values[name] = value
        merged = {**self.checkpoints, **checkpoints}
        if records:
            position = Position(
                [(ns, key, value) for (ns, key), value in sorted(values.items())],
                {topic: (c.ms, c.seq) for topic, c in merged.items()},
            )
            self.target.write(BatchName.of(records), records, msgspec.msgpack.encode(position))
        self.values, self.checkpoints = values, merged

    def close(self) -> None:
        self.target.close()


class IdempotentSink(Sink):
    """The idempotent tier: batches under deterministic names, the position stored with each."""

    tier: ClassVar[str] = "idempotent"

    @abstractmethod
    def target(self, partition: int) -> IdempotentPartition:
        """Connect one topic partition's batches."""

    def partition(self, partition: int) -> SinkPartition:
        return BatchPartition(self.target(partition))
