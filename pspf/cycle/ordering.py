"""Id order across a partition's topics, for apps with tables (DESIGN: Tables and lookups).

Within a partition the entries of the app's topics are applied in id order across them (on equal
ids, which entries of different streams may have, a table's first), so a lookup sees every table
update before its entry and none after, and a replay sees the same. Streams are read in batches,
so after a read a stream may still hold entries below what another stream delivered:

- a stream whose read may have left entries (a full batch, its pending list, or no read at all
  this cycle) bounds the partition at the last id it gave (else at a hint, else its checkpoint);
  the entries above the bound are **held back** in memory (``StreamCursor.held``) and come first
  in the stream's next read: they are not read again from Redis, so their delivery counts do not
  grow (which would make them look like crash suspects, or poison);
- a **crash suspect** (an entry whose delivery count says it may have crashed a worker) is run
  alone, but only once no other stream of its partition holds an unapplied entry before it (a
  look at each one's first entry after its checkpoint); until then it waits, and bounds the
  partition just below itself.

What is held is dropped with everything else read when a stream is rewound (a lost connection, a
retry): it is still pending, and read again from the pending list. A read sent ahead that the
next cycle does not take is held too (``Delivery._hold_ahead``), not given up.

A table's entries of a batch are applied before the other topics' (each update kept with its id):
when a stream then stops at an entry to retry (ordered mode), the table's entries after that entry
are taken out of the batch and held (``stop_tables``), so the entries behind the retried one, run
in a later batch, see no row added after them. While the stream waits out its backoff, it bounds
the partition at its checkpoint, like any stream not read this cycle.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from pspf.keys import ZERO_ID, StreamId
from pspf.partition.batch import StreamOutcome

if TYPE_CHECKING:
    from pspf.broker import RawEntry, Reading
    from pspf.partition.owned import OwnedPartition, Read, StreamCursor
    from pspf.tables.table import TableWrites


#: (id, rank): entries up to it may be applied; rank 0 is a table's entry (first on equal ids)
Bound = tuple[StreamId, int]


class CrossTopicOrder:
    """Keeps one cycle's reads of each partition in id order across its topics."""

    def __init__(
        self, reading: Reading, tables: frozenset[str], owned: dict[int, OwnedPartition], batch_size: int
    ) -> None:
        self.reading = reading
        self.tables = tables
        self.owned = owned
        self.batch_size = batch_size
        #: streams whose read of new entries this cycle got all there was (less than a batch)
        self.complete: set[str] = set()
        #: streams not read this cycle, and the bound their next entry sets (see ``_bound``)
        self.hints: dict[str, Bound] = {}

    def begin(self) -> None:
        """A new cycle: nothing is known of it yet."""
        self.complete = set()
        self.hints = {}

    def full_of_held(self, cursor: StreamCursor) -> bool:
        """Whether a stream holds a batch back already: it reads nothing more this cycle."""
        return cursor.held is not None and len(cursor.held.entries) >= self.batch_size

    # -- crash suspects -------------------------------------------------------------------------

    def first_suspect(self, suspects: list[tuple[StreamCursor, bytes]]) -> int | None:
        """The index of the suspect to run alone now (None: each waits; see ``wait``).

        Suspects are (cursor, entry id), each the head of its stream's pending list.
        """
        order = sorted(range(len(suspects)), key=lambda i: StreamId.parse(suspects[i][1]))
        for index in order:
            cursor, entry_id = suspects[index]
            at = StreamId.parse(entry_id)
            # At or below its checkpoint it was applied (its acknowledgement was lost): it waits
            # for nothing.
            if (cursor.checkpoint is not None and at <= cursor.checkpoint) or self._first_in_partition(
                cursor, at
            ):
                return index
        return None

    def wait(self, cursor: StreamCursor, entry_id: bytes) -> None:
        """A suspect not run this cycle: its stream bounds the partition just before it."""
        at = StreamId.parse(entry_id)
        # An entry of a table with the suspect's own id comes before it, unless it is a table's.
        self.hints[cursor.stream] = (at.previous(), 1) if cursor.topic in self.tables else (at, 0)

    def _first_in_partition(self, cursor: StreamCursor, at: StreamId) -> bool:
        """Whether no other stream of the partition has an unapplied entry that comes before ``at``."""
        others = [c for c in self.owned[cursor.partition].streams.values() if c is not cursor]
        if not others:
            return True
        heads = dict(self.reading.read_after({c.stream: c.checkpoint for c in others}, 1))
        for other in others:
            head = heads.get(other.stream)
            if not head:
                continue
            first = StreamId.parse(head[0][0])
            if first < at or (first == at and other.topic in self.tables and cursor.topic not in self.tables):
                return False
        return True

    # -- holding back -------------------------------------------------------------------------

    def with_held(self, reads: list[Read], streams: list[StreamCursor]) -> list[Read]:
        """Each stream's held entries first in its read this cycle (alone when it read nothing)."""
        by_stream = {r.cursor.stream: i for i, r in enumerate(reads) if not r.due}
        out = list(reads)
        for cursor in streams:
            held = cursor.held
            if held is None:
                continue
            cursor.held = None
            index = by_stream.get(cursor.stream)
            if index is None:
                out.append(held)
                continue
            read = out[index]
            out[index] = read._replace(
                entries=held.entries + read.entries,
                counts={**held.counts, **read.counts},
                poison=held.poison | read.poison,
            )
        return out

    def hold_back(self, reads: list[Read], first: set[str]) -> list[Read]:
        """The reads to apply now, each partition's tables first; what comes later is held back.

        A read run alone (a crash suspect, found first in its partition) is applied as it is.
        """
        if any(read.alone for read in reads):
            return reads
        by_partition: dict[int, list[Read]] = {}
        for read in reads:
            by_partition.setdefault(read.cursor.partition, []).append(read)
        out: list[Read] = []
        for partition, partition_reads in by_partition.items():
            bound = self._bound(self.owned[partition], partition_reads)
            kept = partition_reads if bound is None else [self._below(r, bound) for r in partition_reads]
            kept.sort(key=lambda r: r.cursor.topic not in first)
            out += [r for r in kept if r.entries]
        return out

    def _bound(self, owned: OwnedPartition, reads: list[Read]) -> Bound | None:
        """How far the partition's entries may be applied now (None: all of them).

        An entry is applied when (its id, 0 for a table's or 1) is at most the bound. A stream
        that may hold more after the last entry it gave (or after its checkpoint, when it gave
        none) bounds at that id, for every stream; a waiting suspect at itself (``wait``).
        """
        last = {r.cursor.stream: StreamId.parse(r.entries[-1][0]) for r in reads if not r.due}
        points: list[Bound] = []
        for c in owned.streams.values():
            if c.stream in self.complete:
                continue
            read_to = last.get(c.stream)
            if read_to is not None:
                points.append((read_to, 1))
            else:
                points.append(self.hints.get(c.stream) or (c.checkpoint or ZERO_ID, 1))
        return min(points) if points else None

    def _below(self, read: Read, bound: Bound) -> Read:
        """``read`` up to ``bound``; the rest is held for the stream's next read (a due read: whole)."""
        entries = read.entries
        rank = 0 if read.cursor.topic in self.tables else 1
        if read.due or (StreamId.parse(entries[-1][0]), rank) <= bound:
            return read
        cut = next(i for i, (entry_id, _) in enumerate(entries) if (StreamId.parse(entry_id), rank) > bound)
        read.cursor.held = read._replace(entries=entries[cut:])
        return read._replace(entries=entries[:cut])

    def stop_tables(
        self, reads: list[Read], outcomes: list[StreamOutcome], writes: TableWrites
    ) -> tuple[list[StreamOutcome], int]:
        """A partition's outcomes once its tables stop where a stream stopped to retry an entry.

        ``reads`` and ``outcomes`` are aligned. The tables' entries after the first entry to retry
        leave the batch (their updates too) and are held, first in their streams' next reads.
        Returns the outcomes and how many table entries left the batch.
        """
        retried = [
            StreamId.parse(o.retry_id)
            for o in outcomes
            if o.retry_id is not None and o.cursor.topic not in self.tables
        ]
        if not retried:
            return outcomes, 0
        stop = min(retried)  # a table's entry with this very id comes before it: it stays
        out: list[StreamOutcome] = []
        taken = 0
        for read, outcome in zip(reads, outcomes, strict=True):
            cursor = read.cursor
            if cursor.topic not in self.tables or read.due:
                out.append(outcome)
                continue
            after = [e for e in read.entries if StreamId.parse(e[0]) > stop]
            if not after:
                out.append(outcome)
                continue
            held = read._replace(entries=after)
            cursor.held = held if cursor.held is None else held._replace(entries=after + cursor.held.entries)
            gone = {entry_id for entry_id, _ in after}
            kept = [e for e in outcome.ack_ids if e not in gone]
            checkpoint = max((StreamId.parse(e) for e in kept), default=None)
            if checkpoint is not None and cursor.checkpoint is not None and checkpoint <= cursor.checkpoint:
                checkpoint = None
            dead = [d for d in outcome.dead if d[0] not in gone]
            handled = outcome.handled - (len(outcome.ack_ids) - len(kept))
            out.append(outcome._replace(checkpoint=checkpoint, ack_ids=kept, dead=dead, handled=handled))
            taken += len(outcome.ack_ids) - len(kept)
        writes.drop_after(stop)
        return out, taken

    def after_cycle(self, cursor: StreamCursor) -> None:
        """A stream reading its pending list goes on after what it holds (not over it again)."""
        held = cursor.held
        if held is not None and cursor.pending_after is not None:
            last = StreamId.parse(held.entries[-1][0])
            if last > cursor.pending_after:
                cursor.pending_after = last


# -- entries applied in id order across streams (apps with joins) ------------------------------------


def id_order_runs(reads: list[Read], tables: frozenset[str]) -> list[tuple[int, Read]]:
    """A partition's reads as runs in id order across its streams, for apps whose joins need it.

    Tables' reads first, as they are (their updates keep their ids); then the other streams'
    entries merged by id and cut into runs where the stream changes; parked entries claimed again
    (due reads, deferred mode: no order kept) last. Each run is handled as a read of its stream;
    each comes with the index of the read it is part of.
    """
    first = [(i, r) for i, r in enumerate(reads) if r.cursor.topic in tables and not r.due]
    due = [(i, r) for i, r in enumerate(reads) if r.due]
    rest = [(i, r) for i, r in enumerate(reads) if r.cursor.topic not in tables and not r.due]
    if len(rest) < 2:
        return [*first, *rest, *due]
    merged = heapq.merge(*([(StreamId.parse(e[0]), i, e) for e in r.entries] for i, r in rest))
    runs: list[tuple[int, Read]] = []
    at = -1
    run: list[RawEntry] = []
    for _, i, entry in merged:
        if i != at and run:
            runs.append((at, reads[at]._replace(entries=run)))
            run = []
        at = i
        run.append(entry)
    if run:
        runs.append((at, reads[at]._replace(entries=run)))
    return [*first, *runs, *due]


def joined(before: StreamOutcome | None, run: StreamOutcome) -> StreamOutcome:
    """A stream's outcome over its runs so far, ``run`` the latest."""
    if before is None:
        return run
    return StreamOutcome(
        run.cursor,
        run.checkpoint or before.checkpoint,
        before.ack_ids + run.ack_ids,
        before.dead + run.dead,
        run.retry_in_s,
        before.handled + run.handled,
        before.skipped + run.skipped,
        run.retry_id,
    )


def hold_runs(runs: list[tuple[int, Read]], stopped: StreamCursor) -> None:
    """The runs after one that stopped to retry an entry: not applied in this batch.

    The stopped stream reads its entries from the one to retry on (they were delivered, not
    attempted); the other streams' are held, first in their next reads, before what they held.
    """
    for _, run in reversed(runs):
        cursor = run.cursor
        if cursor is stopped:
            for entry_id, _ in run.entries:
                cursor.unattempted[entry_id] = cursor.unattempted.get(entry_id, 0) + 1
            continue
        held = cursor.held
        cursor.held = run if held is None else run._replace(entries=run.entries + held.entries)


def empty_outcome(cursor: StreamCursor) -> StreamOutcome:
    """The outcome of a stream none of whose entries this batch applied."""
    return StreamOutcome(cursor, None, [], [], None, 0, 0)
