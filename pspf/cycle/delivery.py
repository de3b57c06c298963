"""The read order of the owned streams: what each cycle delivers, and what needs a handler.

A stream that must first re-read its own pending entries (after a takeover, a failure or a lost
connection) reads them from its pending list before anything new. An entry whose delivery count
says an earlier attempt may have crashed the worker is read alone, with nothing else delivered in
that cycle, so a poison entry cannot drag its batch-mates' counts up with it; one delivered more
than ``max_deliveries`` times with no recorded outcome is poison. Parked entries are claimed
again when due. New entries are read in one XREADGROUP under the leases (``Reading.read_new``).

Reading ahead: after a full batch of new entries, the next read is sent at once and its reply
taken by the next cycle (``Reading.read_ahead``), so the server builds the next batch while the
handlers run on this one. It is taken only when the next cycle reads exactly the same streams
under the same leases; otherwise it is dropped: what it delivered is pending here, and each of its
streams re-reads its pending list, in id order, as after a failure (those deliveries count as
unattempted, so they make no entry look poison).

Screening (step 2 of the cycle): an entry at or below its stream's checkpoint was applied before
a crash and needs no handler, unless a foreign consumer took it; an entry judged dead before a
crash is moved to the DLQ; a redriven entry meant for another app is skipped, and so is an entry
a replay marked superseded (a redriven copy of it, later in the stream, is applied instead).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pspf import codec, keys
from pspf.broker import Fields, RawEntry, ReadAhead, Reading, Topics
from pspf.cycle.execution import Entry
from pspf.cycle.ordering import CrossTopicOrder
from pspf.errors import ConfigError, DecodeError
from pspf.failures import RetryPolicy
from pspf.keys import StreamId, entry_name
from pspf.partition.owned import OwnedPartition, Read, StreamCursor, check_tail, parked

log = logging.getLogger("pspf.delivery")


@dataclass(slots=True)
class Screened:
    """A read after screening: the entries that need a handler, in id order, and the others."""

    todo: list[Entry] = field(default_factory=list)
    #: entries done without a handler (applied before, lost, superseded, or meant for another app)
    done_ids: list[bytes] = field(default_factory=list)
    #: (id, DLQ fields) of entries judged dead before a crash, to move now
    dead: list[tuple[bytes, Fields]] = field(default_factory=list)
    skipped: int = 0
    lost: int = 0


class Delivery:
    """Reads the owned streams in the order that keeps the guarantee (see the module docstring).

    ``owned`` and ``streams`` are the processor's registry of owned partitions and their cursors.
    """

    def __init__(
        self,
        reading: Reading,
        topics: Topics,
        group: str,
        consumer: str,
        batch_size: int,
        block_ms: int,
        policies: dict[str, RetryPolicy],
        owned: dict[int, OwnedPartition],
        streams: dict[str, StreamCursor],
        tables: frozenset[str] = frozenset(),
        ordered: bool = False,
        linger_ms: int = 0,
    ) -> None:
        self.reading = reading
        #: the streams' last ids (a check that their tails are not lost)
        self.topics = topics
        self.group = group
        self.consumer = consumer
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.policies = policies
        #: after a read of new entries that filled no batch, new entries are read again this much later
        self.linger_s = linger_ms / 1000
        #: when (monotonic) new entries are read next (``linger_s``)
        self._read_new_at = 0.0
        self.owned = owned
        self.streams = streams
        #: the read sent ahead, and the (stream, lease key, lease value) it was sent for
        self._ahead: tuple[ReadAhead, list[tuple[str, str, str]]] | None = None
        #: id order across each partition's topics (apps with tables or joins: ``ordered``; see
        #: ``pspf.cycle.ordering``)
        self.order = CrossTopicOrder(reading, tables, owned, batch_size) if tables or ordered else None

    @property
    def lingering(self) -> bool:
        """Whether new entries wait for the linger after a read that filled no batch."""
        return time.monotonic() < self._read_new_at

    @property
    def reading_ahead(self) -> bool:
        """Whether a read was sent ahead: the next cycle's entries are on their way."""
        return self._ahead is not None

    def read(self, block: bool, block_ms: int | None = None) -> tuple[list[Read], list[str]]:
        """One cycle's reads, and the streams whose lease the read found taken.

        With ``block`` the read waits up to ``block_ms`` (at most this Delivery's) for new
        entries; without, it only looks.
        """
        wait_ms = self.block_ms if block_ms is None else min(block_ms, self.block_ms)
        order = self.order
        if order is not None:
            order.begin()
        now = time.monotonic()
        ready = [c for c in self.streams.values() if c.retry_at <= now]
        if not ready:
            self._wait_for_retry(now, wait_ms)
            return [], []
        reading = ready if order is None else [c for c in ready if not order.full_of_held(c)]
        windows = {c.stream: self._pending_window(c) for c in reading if c.pending_after is not None}
        alone = self._suspect(windows)
        if alone is not None:
            return alone
        out: list[Read] = []
        lost: list[str] = []
        for stream, window in windows.items():
            pending = self._read_pending(self.streams[stream], window)
            if pending is None:
                lost.append(stream)
            else:
                out += pending
        live = [(c.stream, c.lease_key, c.lease_value) for c in reading if c.pending_after is None]
        if live and self._read_new_at and self._lingered(now, wait_ms):
            live = []
        ahead = self._take_ahead(live)
        if ahead is None:  # a read ahead dropped just now sent its streams back to their pending lists
            live = [stream for stream in live if self.streams[stream[0]].pending_after is None]
        if live:
            lost_now, replies, last_ids = ahead or self.reading.read_new(
                self.group, self.consumer, live, self.batch_size
            )
            lost += lost_now
            new = [Read(self.streams[s.decode()], entries, {}) for s, entries in replies if entries]
            if order is not None:
                full = {r.cursor.stream for r in new if len(r.entries) >= self.batch_size}
                order.complete = {s for s, _, _ in live if s not in lost_now and s not in full}
            self._check_tails(new, last_ids)
            out += new
            self._after_new(new, [stream for stream in live if stream[0] not in lost_now])
            waiting = order is not None and any(c.held is not None for c in ready)
            if block and wait_ms > 0 and not out and not waiting and last_ids:  # BLOCK 0: for ever
                self.reading.wait_for_new(last_ids, wait_ms)
        if order is not None:
            out = order.with_held(out, ready)
        return out, lost

    def _after_new(self, new: list[Read], held: list[tuple[str, str, str]]) -> None:
        """After a read of new entries: a batch filled sends the next read ahead, else the linger starts."""
        if any(len(r.entries) >= self.batch_size for r in new):
            if not self.reading.conn.cluster:
                self._ahead = self.reading.read_ahead(self.group, self.consumer, held, self.batch_size), held
        elif self.linger_s and new:
            self._read_new_at = time.monotonic() + self.linger_s

    def _lingered(self, now: float, wait_ms: int) -> bool:
        """Wait out the linger, at most ``wait_ms``; whether it still runs (no new entries read now)."""
        left = self._read_new_at - now
        if left > 0:
            time.sleep(min(left, wait_ms / 1000))
        if time.monotonic() < self._read_new_at:
            return True
        self._read_new_at = 0.0
        return False

    def _suspect(self, windows: dict[str, list[tuple[bytes, int]]]) -> tuple[list[Read], list[str]] | None:
        """The read of a crash suspect, run alone; None when no suspect runs this cycle.

        A suspect may have crashed the worker before: it runs alone, nothing else is delivered,
        so if it crashes again only its own delivery count grows. With tables, only one that no
        entry of another topic of its partition must precede (``pspf.cycle.ordering``); the others wait.
        """
        suspects = [
            (self.streams[stream], window[0][0])
            for stream, window in windows.items()
            if window and self._unexplained(self.streams[stream], window[0]) >= 2
        ]
        if not suspects:
            return None
        index = 0 if self.order is None else self.order.first_suspect(suspects)
        if index is None:
            for cursor, entry_id in suspects:
                assert self.order is not None
                self.order.wait(cursor, entry_id)
                del windows[cursor.stream]
            return None
        cursor = suspects[index][0]
        suspect = self._claim_pending(cursor, windows[cursor.stream][:1])
        if suspect is None:
            return [], [cursor.stream]
        return [r._replace(alone=True) for r in suspect], []

    def _take_ahead(
        self, live: list[tuple[str, str, str]]
    ) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]] | None:
        """The reply of the read sent ahead when it read exactly ``live``; else it is dropped."""
        if self._ahead is None:
            return None
        ahead, sent_for = self._ahead
        if sent_for != live:
            if self.order is not None:
                self._hold_ahead()
            else:
                self.drop_ahead()
            return None
        self._ahead = None
        return ahead.take()

    def _hold_ahead(self) -> None:
        """With tables: what the read sent ahead delivered is held, first in its streams' next reads.

        Dropped, it would be read again from the pending lists, its delivery counts grown: crash
        suspects all. Streams re-reading their pending list (or given up) read it there anyway.
        """
        assert self._ahead is not None
        ahead, _ = self._ahead
        self._ahead = None
        taken = ahead.take()
        if taken is None:
            return  # nothing was delivered
        for stream, entries in taken[1]:
            cursor = self.streams.get(stream.decode())
            if cursor is None or not entries:
                continue
            if cursor.pending_after is not None:  # read again there: that delivery explained
                for entry_id, _ in entries:
                    cursor.unattempted[entry_id] = cursor.unattempted.get(entry_id, 0) + 1
                continue
            read = Read(cursor, entries, {})
            cursor.held = (
                read if cursor.held is None else cursor.held._replace(entries=cursor.held.entries + entries)
            )

    def drop_ahead(self) -> None:
        """Give the read sent ahead up: its streams re-read their pending entries, in id order."""
        if self._ahead is None:
            return
        ahead, _ = self._ahead
        self._ahead = None
        for stream, ids in ahead.drop().items():
            cursor = self.streams.get(stream)
            if cursor is None:
                continue  # given up meanwhile: its next owner claims them at takeover
            cursor.rewind()
            for entry_id in ids:
                cursor.unattempted[entry_id] = cursor.unattempted.get(entry_id, 0) + 1

    def close(self) -> None:
        """Close the connection of a read sent ahead; what it delivered stays pending here."""
        if self._ahead is not None:
            self._ahead[0].abandon()
            self._ahead = None

    def _check_tails(self, new: list[Read], last_ids: dict[str, bytes]) -> None:
        """Check the streams' last ids against the checkpoints wherever they are at hand.

        New entries at or below the checkpoint mean the group's position went back: the stream's
        last id is looked up then, so that a lost tail is seen before they are skipped as done.
        """
        for stream, last_id in last_ids.items():
            check_tail(stream, last_id, self.streams[stream].checkpoint)
        for read in new:
            checkpoint = read.cursor.checkpoint
            if checkpoint is not None and StreamId.parse(read.entries[0][0]) <= checkpoint:
                check_tail(read.cursor.stream, self.topics.last_id(read.cursor.stream), checkpoint)

    def _pending_window(self, cursor: StreamCursor) -> list[tuple[bytes, int]]:
        """The next own pending entries and their delivery counts (XPENDING delivers nothing).

        Parked entries are left out: their count must not grow while they wait.
        """
        assert cursor.pending_after is not None
        window = self.reading.pending_counts(
            cursor.stream, self.group, self.consumer, cursor.pending_after, self.batch_size
        )
        if not window:
            cursor.pending_after = None
            return []
        failures = self.owned[cursor.partition].failures
        wanted = [
            (entry_id, delivered)
            for entry_id, delivered in window
            if not (failures and parked(failures.get(entry_name(cursor.topic, entry_id))))
        ]
        if not wanted:
            cursor.pending_after = StreamId.parse(window[-1][0])
        return wanted

    def _unexplained(self, cursor: StreamCursor, pending: tuple[bytes, int]) -> int:
        """Deliveries of an entry that ended with no recorded outcome: each may have been a crash."""
        entry_id, delivered = pending
        failure = self.owned[cursor.partition].failures.get(entry_name(cursor.topic, entry_id))
        return delivered - (failure.attempts if failure else 0) - cursor.unattempted.get(entry_id, 0)

    def _read_pending(self, cursor: StreamCursor, window: list[tuple[bytes, int]]) -> list[Read] | None:
        """Re-deliver the next pending entries, stopping before any that may have crashed us.

        None when the lease moved (nothing was claimed).
        """
        if not window:
            return []
        suspect = [i for i, pending in enumerate(window) if self._unexplained(cursor, pending) >= 2]
        take = 1 if cursor.isolate else (suspect[0] if suspect else len(window))
        return self._claim_pending(cursor, window[:take])

    def _claim_pending(self, cursor: StreamCursor, window: list[tuple[bytes, int]]) -> list[Read] | None:
        ids = [entry_id for entry_id, _ in window]
        found = self.reading.claim_entries(
            cursor.stream, self.group, self.consumer, ids, (cursor.lease_key, cursor.lease_value)
        )
        if found is None:
            return None
        claimed = dict(found)
        entries: list[RawEntry] = [(entry_id, claimed.get(entry_id)) for entry_id in ids]
        counts = {entry_id: delivered + 1 for entry_id, delivered in window}
        return [Read(cursor, entries, counts, self._poison(cursor, counts))]

    def _poison(self, cursor: StreamCursor, counts: dict[bytes, int]) -> frozenset[bytes]:
        """Entries delivered more than ``max_deliveries`` times with no recorded outcome."""
        limit = self.policies[cursor.topic].max_deliveries or 1
        return frozenset(e for e, n in counts.items() if self._unexplained(cursor, (e, n)) > limit)

    def read_due(self) -> list[Read]:
        """Claim parked entries whose retry is due (XCLAIM counts it as a delivery)."""
        now_ms = int(time.time() * 1000)
        out = []
        for owned in self.owned.values():
            if not owned.failures:
                continue
            for cursor in owned.streams.values():
                due = owned.due(cursor.topic, now_ms, self.batch_size)
                if not due:
                    continue
                entries = self.reading.claim_entries(
                    cursor.stream, self.group, self.consumer, due, (cursor.lease_key, cursor.lease_value)
                )
                if entries is None:
                    continue  # the lease moved: the next read reports it
                gone = set(due) - {entry_id for entry_id, _ in entries}
                for entry_id in gone:
                    log.warning(
                        "parked entry deleted from its stream, lost stream=%s id=%s",
                        cursor.stream,
                        entry_id.decode(),
                    )
                    owned.forget_failure(cursor.topic, entry_id)
                if entries:
                    counts = self.reading.delivery_counts(
                        cursor.stream, self.group, [entry_id for entry_id, _ in entries]
                    )
                    out.append(Read(cursor, entries, counts, self._poison(cursor, counts), due=True))
        return out

    def _wait_for_retry(self, now: float, wait_ms: int) -> None:
        """Sleep until the first stream may retry, but no longer than one read would block."""
        if not self.streams:
            time.sleep(wait_ms / 1000)
            return
        first = min(c.retry_at for c in self.streams.values())
        time.sleep(max(0.0, min(first - now, wait_ms / 1000)))

    # -- step 2: what needs a handler -----------------------------------------------------------

    def screen(self, owned: OwnedPartition, read: Read) -> Screened:
        """Sort out entries that need no handler; the ones that do come back in id order."""
        cursor, entries = read.cursor, read.entries
        screened = Screened()
        forced: list[RawEntry] = []
        start = 0
        checkpoint = cursor.checkpoint
        superseded = cursor.superseded
        # Ids in a reply ascend, so the entries at or below the checkpoint are a prefix.
        if checkpoint is not None and not read.due:
            while start < len(entries) and StreamId.parse(entries[start][0]) <= checkpoint:
                id_b, fields = entries[start]
                start += 1
                if id_b in cursor.foreign and id_b not in superseded:
                    forced.append((id_b, fields))
                else:
                    _handled_before(owned, cursor.topic, id_b, screened)
        rest = entries[start:]
        if not (forced or superseded) and all(
            fields is not None and codec.HEADERS not in fields for _, fields in rest
        ):
            screened.todo = rest  # type: ignore[assignment]
            return screened
        todo: list[Entry] = []
        for id_b, fields in forced + rest:
            if id_b in superseded:
                # its redriven copy is applied instead, as in the first run
                screened.done_ids.append(id_b)
                screened.skipped += 1
            elif fields is None:
                log.warning(
                    "entry deleted while pending, lost before processing topic=%s partition=%s id=%s",
                    cursor.topic,
                    cursor.partition,
                    id_b.decode(),
                )
                screened.done_ids.append(id_b)
                screened.lost += 1
            elif codec.HEADERS in fields and not self._meant_for_us(fields[codec.HEADERS]):
                screened.done_ids.append(id_b)
                screened.skipped += 1
            elif cursor.moved and _moved_done(cursor, id_b, fields):
                # handled in its old partition before a repartition
                _handled_before(owned, cursor.topic, id_b, screened)
            else:
                todo.append((id_b, fields))
        screened.todo = todo
        return screened

    def _meant_for_us(self, headers: bytes) -> bool:
        """False for an entry a redrive sent back for another app reading the same topic."""
        if keys.REDRIVE_APP_HEADER.encode() not in headers:
            return True
        try:
            target = codec.decode_headers(headers).get(keys.REDRIVE_APP_HEADER)
        except Exception:
            return True
        return target is None or target == self.group

    # -- after the cycle ------------------------------------------------------------------------

    def advance(self, done: list[tuple[StreamCursor, list[bytes], float | None]], reads: list[Read]) -> None:
        """Move each stream's read position: past what it read, or back to its pending entries.

        ``done``: per stream outcome, the ids acknowledged or dead-lettered and the retry delay
        (None when the stream need not wait).
        """
        last_read = {r.cursor.stream: StreamId.parse(r.entries[-1][0]) for r in reads if not r.due}
        for cursor, finished, retry_in_s in done:
            if cursor.unattempted or cursor.foreign:
                for entry_id in finished:
                    cursor.unattempted.pop(entry_id, None)
                    cursor.foreign.discard(entry_id)
            if cursor.stream not in last_read:
                continue  # only parked entries were tried
            if retry_in_s is not None:
                cursor.rewind()
                cursor.isolate = True
                cursor.retry_at = time.monotonic() + retry_in_s
            else:
                cursor.isolate = False
                cursor.retry_at = 0.0
                if cursor.pending_after is not None:
                    cursor.pending_after = last_read[cursor.stream]
        if self.order is not None:
            for cursor in self.streams.values():
                self.order.after_cycle(cursor)


def _moved_done(cursor: StreamCursor, id_b: bytes, fields: Fields) -> bool:
    """Whether a repartition moved this entry from an old partition where it was handled.

    Unless it is marked as still needing a handler there (foreign: checked by the caller for
    dead and parked ones).
    """
    raw = fields.get(codec.HEADERS)
    if raw is None or keys.MOVED_FROM_HEADER.encode() not in raw or id_b in cursor.foreign:
        return False
    try:
        headers = codec.decode_headers(raw)
        upto = cursor.moved.get(int(headers[keys.MOVED_FROM_HEADER]))
        original = StreamId.parse(headers.get(keys.MOVED_ID_HEADER, id_b.decode()))
    except (KeyError, ValueError, DecodeError, ConfigError):
        return False
    return upto is not None and original <= upto


def _handled_before(owned: OwnedPartition, topic: str, id_b: bytes, screened: Screened) -> None:
    """An entry handled before: done, unless judged dead (moved to the DLQ now) or parked."""
    if owned.dead or owned.failures:
        name = entry_name(topic, id_b)
        if name in owned.dead:
            screened.dead.append((id_b, owned.dead[name]))  # decided before a crash: move it now
            return
        if parked(owned.failures.get(name)):
            return  # stays pending until it is due
    screened.done_ids.append(id_b)
    screened.skipped += 1
