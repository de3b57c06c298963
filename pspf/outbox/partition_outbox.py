"""One owned partition's outbox rows: written with its batches, indexed in memory while they wait.

``PartitionOutbox`` makes a batch's emitted entries into a new page and the store writes that
make it (joined to the batch's ONE store transaction by the caller), indexes the rows that wait
per target partition in sequence order, says which rows a relay step may publish now
(``publishable``), and stores their status records as the relay settles them (``update``).

A row created while an earlier row to the same target waits PENDING is created PENDING behind it.
Claims of a relay that died are reaped by the next owner when it takes the partition (``load``:
CLAIMED -> PENDING). The index mirrors every write of the rows: the store is this process's
alone, so a claim is verified against it before its row is marked PUBLISHED.

Fencing: ``confirmed`` is the highest sequence number that reached the backup (or the
lease-checked acknowledgement) in a call that succeeded; rows above it are not published
(``confirm`` moves it once the acknowledgement of the batch that wrote them succeeded).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec

from pspf import keys
from pspf.outbox.emit import SourceHeaders
from pspf.outbox.rows import (
    NEXT_KEY,
    OutboxRow,
    Page,
    RowState,
    Target,
    allowed,
    decode_done,
    done_key,
    done_value,
    move,
    now_ms,
    page_row,
    read_meta,
    row_key,
    status_value,
)

if TYPE_CHECKING:
    from pspf.broker import SentCalls
    from pspf.outbox.emit import Emitted
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.partition_outbox")

#: A row waiting in its target's queue: (seq, id, page, index in the page).
Item = tuple[int, int, Page, int]
_entry_topic = operator.itemgetter(0)
_entry_partition = operator.itemgetter(1)


class Sending:
    """A relay step's publishing calls in flight: what each carries, and the claims they rest on."""

    def __init__(
        self, sent: SentCalls, calls: list[tuple[Target, list[Item]]], claims: dict[int, int]
    ) -> None:
        self.sent = sent
        self.calls = calls
        #: claimed_ms of the rows claimed with a status record of their own, by id
        self.claims = claims


class PartitionOutbox:
    """The outbox rows of one owned partition: the store's, indexed in memory where they wait.

    ``pages`` holds the pages with a row not yet published, ``queues`` per target the rows not
    yet PUBLISHED or DEAD in sequence order, ``marked`` the status records of those pages' rows.
    ``confirmed`` is the highest sequence number that reached the backup (or the lease-checked
    acknowledgement) in a call that succeeded: rows above it are not published yet (see the
    module's fencing note).
    """

    def __init__(self, store: StateStore, app: str, partition: int, relay: str) -> None:
        self.store = store
        self.partition = partition
        self.producer = f"{app}/{partition}"
        self.headers = SourceHeaders(app, partition)
        #: the name of this worker's relay (its consumer name): what its claims say
        self.relay = relay
        self.next_seq = 1
        self.next_id = 1
        self.confirmed = 0
        #: seq of rows committed by the last commits whose acknowledgement is still to come
        self.unconfirmed = 0
        self.pages: dict[int, Page] = {}
        self.queues: dict[Target, deque[Item]] = {}
        self.marked: dict[int, OutboxRow] = {}
        self.watermarks: dict[Target, tuple[int, int]] = {}
        self.counts: dict[RowState, int] = dict.fromkeys(RowState, 0)
        #: the relay's publishing calls in flight, with what they carry
        self.sending: Sending | None = None
        #: when the relay looks for published pages to prune next (monotonic)
        self.next_prune = 0.0
        #: topic -> the layout generation its waiting rows are routed in (none yet: unchecked)
        self.layouts: dict[str, str] = {}

    # -- reading the store back ----------------------------------------------------------------

    def load(self) -> None:
        """Index the store's rows at takeover; claims from before (any relay's) are reaped."""
        counters, self.watermarks, done = read_meta(self.store.items(keys.OUTBOX_META_NAMESPACE))
        if counters is not None:
            self.next_id, self.next_seq = counters
        statuses = {int(key): raw for key, raw in self.store.items(keys.OUTBOX_STATE_NAMESPACE)}
        self.pages, self.queues, self.marked = {}, {}, {}
        self.counts = dict.fromkeys(RowState, 0)
        waiting: list[Item] = []
        writes: dict[tuple[str, str], bytes | None] = {}
        stamp = now_ms()
        for key, raw in self.store.items(keys.OUTBOX_NAMESPACE):
            first_id = int(key)
            if first_id in done:
                self.counts[RowState.PUBLISHED] += done[first_id][1]
                continue
            page = Page.decode(key, raw)
            waiting += self._index(page, statuses, stamp, writes)
            if page.unpublished:
                self.pages[first_id] = page
            else:  # published whole, but not marked so: mark it now
                writes[(keys.OUTBOX_META_NAMESPACE, done_key(first_id))] = done_value(page, stamp)
        for item in sorted(waiting, key=lambda i: i[0]):
            self._queue(item)
        if writes:
            self.write(writes)
            log.info("outbox partition=%s: claimed rows back to pending at takeover", self.partition)
        # What the store holds at takeover is in the backup (it was reconciled) or, without a
        # backup, on this machine only: either way nobody else publishes anything else.
        self.confirmed = self.next_seq - 1

    def _index(
        self, page: Page, statuses: dict[int, bytes], stamp: int, writes: dict[tuple[str, str], bytes | None]
    ) -> list[Item]:
        """Count and index a stored page's rows, reaping claims (into ``writes``); its rows to publish."""
        waiting: list[Item] = []
        page.unpublished = 0
        for index in range(len(page.rows)):
            row = page_row(page, index, self.headers, statuses, self.watermarks)
            if row.id in statuses:
                page.marked.add(row.id)
            if row.state is RowState.CLAIMED:  # reaped: no relay of before publishes now
                reap = f"claim of {row.claimed_by} reaped at takeover"
                row = move(row, RowState.PENDING, stamp, error=reap)
                writes[(keys.OUTBOX_STATE_NAMESPACE, row_key(row.id))] = status_value(row)
                page.marked.add(row.id)
            self.counts[row.state] += 1
            if row.state is not RowState.PUBLISHED:
                page.unpublished += 1
                self.marked[row.id] = row
                if row.state is RowState.PENDING:
                    waiting.append((row.seq, row.id, page, index))
        return waiting

    def _queue(self, item: Item) -> None:
        marked = self.marked.get(item[1])
        if marked is not None:  # its own record: a re-routed row's target is not its page's
            target = (marked.topic, marked.partition)
        else:
            row = item[2].rows[item[3]]
            target = (row[0], row[1])
        queue = self.queues.get(target)
        if queue is None:
            queue = self.queues[target] = deque()
        queue.append(item)

    def write(self, writes: dict[tuple[str, str], bytes | None]) -> None:
        """Store values and deletes (None) in one transaction."""
        with self.store.transaction() as tx:
            for (namespace, key), value in writes.items():
                if value is None:
                    tx.delete(namespace, key)
                else:
                    tx.set(namespace, key, value)

    # -- a batch's rows -------------------------------------------------------------------------

    def page_for(self, emitted: list[Emitted]) -> tuple[Page, dict[tuple[str, str], bytes]]:
        """A batch's emitted entries as a new page, and the store writes that make it.

        Its rows are claimed by this worker's relay in the same write (PENDING -> CLAIMED, so no
        write of their own is needed before they are published), except a row to a target whose
        earlier row waits PENDING: that one is created PENDING behind it, with a status record.
        """
        allowed(RowState.PENDING, RowState.CLAIMED, "a new page's rows")
        stamp = now_ms()
        page = Page(self.next_id, self.next_seq, stamp, self.relay, emitted)
        writes: dict[tuple[str, str], bytes] = {
            (keys.OUTBOX_NAMESPACE, row_key(page.first_id)): page.encode(),
            (keys.OUTBOX_META_NAMESPACE, NEXT_KEY): (
                f"{page.first_id + len(emitted)}/{page.first_seq + len(emitted)}".encode()
            ),
        }
        held = {(row.topic, row.partition) for row in self.marked.values() if row.state is RowState.PENDING}
        if held:
            for index, entry in enumerate(emitted):
                if (entry[0], entry[1]) in held:
                    row = page_row(page, index, self.headers)
                    row = msgspec.structs.replace(
                        row, state=RowState.PENDING, claimed_ms=None, claimed_by=None
                    )
                    writes[(keys.OUTBOX_STATE_NAMESPACE, row_key(row.id))] = status_value(row)
        return page, writes

    def committed(self, page: Page, writes: dict[tuple[str, str], bytes]) -> None:
        """After the batch commit: the page's rows are the partition's (to be confirmed)."""
        count = len(page.rows)
        self.pages[page.first_id] = page
        queues = self.queues
        first_id, first_seq = page.first_id, page.first_seq
        targets = set(zip(map(_entry_topic, page.rows), map(_entry_partition, page.rows), strict=True))
        if len(targets) == 1:  # the common case: one target, its rows in one go
            (target,) = targets
            queue = queues.get(target)
            if queue is None:
                queue = queues[target] = deque()
            queue.extend(
                zip(
                    range(first_seq, first_seq + count),
                    range(first_id, first_id + count),
                    itertools.repeat(page),
                    range(count),
                )
            )
        else:
            for index, entry in enumerate(page.rows):
                target = (entry[0], entry[1])
                queue = queues.get(target)
                if queue is None:
                    queue = queues[target] = deque()
                queue.append((first_seq + index, first_id + index, page, index))
        held = 0
        for (namespace, key), raw in writes.items():
            if namespace == keys.OUTBOX_STATE_NAMESPACE:
                row_id = int(key)
                self.marked[row_id] = page_row(page, row_id - first_id, self.headers, {row_id: raw})
                page.marked.add(row_id)
                held += 1
        page.claimed = count - held
        self.counts[RowState.CLAIMED] += count - held
        self.counts[RowState.PENDING] += held
        self.unconfirmed = first_seq + count - 1
        self.next_id, self.next_seq = first_id + count, first_seq + count

    def confirm(self) -> None:
        """The rows committed so far reached the backup under the lease: they may be published."""
        self.confirmed = max(self.confirmed, self.unconfirmed)

    # -- what a relay step does ------------------------------------------------------------------

    def publishable(self, now: int, limit: int) -> list[tuple[Target, list[Item]]]:
        """Confirmed rows to publish now, per target in sequence order, none after a waiting row.

        Rows claimed by this relay (as their page says, or by a claim of their own), and PENDING
        rows that are due (to claim). DEAD rows are passed over.
        """
        out: list[tuple[Target, list[Item]]] = []
        total = 0
        marked, relay, confirmed = self.marked, self.relay, self.confirmed
        for target, queue in self.queues.items():
            if not marked and queue[-1][0] <= confirmed:  # the common case: all claimed, confirmed
                taken = list(itertools.islice(queue, limit - total))
                total += len(taken)
                if taken:
                    out.append((target, taken))
                continue
            taken = []
            for item in queue:
                if item[0] > confirmed or total >= limit:
                    break
                row = marked.get(item[1])
                if row is None:
                    if item[2].claimed_by != relay:
                        break
                elif row.state is RowState.DEAD:
                    continue
                elif not (
                    (row.state is RowState.CLAIMED and row.claimed_by == relay)
                    or (row.state is RowState.PENDING and row.available_ms <= now)
                ):
                    break
                taken.append(item)
                total += 1
            if taken:
                out.append((target, taken))
        return out

    def update(
        self,
        rows: Sequence[tuple[RowState | None, OutboxRow]],
        extra: dict[tuple[str, str], bytes | None] | None = None,
    ) -> None:
        """Store rows' status records in one transaction, with ``extra`` writes.

        Rows are (state before, row after); None before: as its page said. The index and the
        counts follow.
        """
        writes = dict(extra or {})
        for _, row in rows:
            writes[(keys.OUTBOX_STATE_NAMESPACE, row_key(row.id))] = status_value(row)
        self.write(writes)
        page_of = self.page_finder()
        for before, row in rows:
            page = page_of(row.id)
            if before is None:  # as its page said: CLAIMED by the page
                before = RowState.CLAIMED
                if page is not None:
                    page.claimed -= 1
            self.counts[before] -= 1
            self.counts[row.state] += 1
            if page is not None:
                page.marked.add(row.id)
            self.marked[row.id] = row

    def page_finder(self) -> Callable[[int], Page | None]:
        """A function: the open page that holds a row (for as long as the open pages stay)."""
        firsts = sorted(self.pages)

        def page_of(row_id: int) -> Page | None:
            at = bisect.bisect_right(firsts, row_id) - 1
            page = self.pages[firsts[at]] if at >= 0 else None
            return page if page is not None and row_id in page else None

        return page_of

    def row(self, item: Item) -> OutboxRow:
        """A waiting row as it stands now."""
        marked = self.marked.get(item[1])
        return marked if marked is not None else page_row(item[2], item[3], self.headers)

    def trim(self, target: Target) -> None:
        """Drop the published and dead rows at the head of a target's queue."""
        queue = self.queues.get(target)
        if queue is None:
            return
        mark = self.watermarks.get(target, (0, 0))[0]
        marked = self.marked
        if not marked and queue[-1][0] <= mark:  # published whole
            del self.queues[target]
            return
        while queue:
            seq, row_id, _, _ = queue[0]
            if row_id in marked:
                if marked[row_id].state in (RowState.PENDING, RowState.CLAIMED):
                    break
            elif seq > mark:
                break
            queue.popleft()
        if not queue:
            del self.queues[target]

    # -- a repartition of a target topic ----------------------------------------------------------

    def reroute(self, topic: str, count: int) -> int:
        """Route the waiting rows to ``topic`` again with its new ``count``; how many moved.

        A row whose key (a keyless row: its partition) falls in another partition now becomes
        PENDING there, under a new sequence number: numbers above every one given before, in the
        rows' old order, so the target's record of this producer (``lua/publish.lua``) takes them
        and a key's rows keep their order. Like a replay, they are published once ``confirm``
        says the write reached the backup. Rows in flight are not looked at: call it between steps.
        """
        allowed(RowState.CLAIMED, RowState.PENDING, "a re-routed row")
        stamp = now_ms()
        found: list[tuple[RowState | None, OutboxRow, Item]] = []
        for target in [t for t in self.queues if t[0] == topic]:
            staying: deque[Item] = deque()
            for item in self.queues.pop(target):
                row = self.row(item)
                key = item[2].rows[item[3]][2]
                partition = row.partition % count if key is None else zlib.crc32(key) % count
                if partition == row.partition or row.state in (RowState.PUBLISHED, RowState.DEAD):
                    staying.append(item)
                    continue
                again = msgspec.structs.replace(
                    row, partition=partition, state=RowState.PENDING, available_ms=stamp,
                    claimed_ms=None, claimed_by=None,
                )  # fmt: skip
                found.append((row.state if item[1] in self.marked else None, again, item))
            if staying:
                self.queues[target] = staying
        if not found:
            return 0
        found.sort(key=lambda moved: moved[2][0])
        rows = [
            (before, msgspec.structs.replace(row, seq=self.next_seq + n))
            for n, (before, row, _) in enumerate(found)
        ]
        self.next_seq += len(rows)
        self.update(
            rows, {(keys.OUTBOX_META_NAMESPACE, NEXT_KEY): f"{self.next_id}/{self.next_seq}".encode()}
        )
        for (_, row), (_, _, item) in zip(rows, found, strict=True):
            self._queue((row.seq, row.id, item[2], item[3]))
        self.unconfirmed = self.next_seq - 1
        return len(rows)

    # -- replays -----------------------------------------------------------------------------------

    def replay(self, ids: Iterable[int]) -> list[int]:
        """PUBLISHED/DEAD rows among ``ids`` back to PENDING under new sequence numbers (one write).

        Others (pending, claimed, pruned) are left as they are. The replayed rows are published
        once ``confirm`` says the write reached the backup.
        """
        wanted = sorted(set(ids))
        stamp = now_ms()
        reopened: dict[int, Page] = {}
        replayed: list[tuple[RowState, OutboxRow, Page]] = []
        for key, raw in self._pages_holding(wanted):
            page = self.pages.get(int(key)) or reopened.get(int(key)) or Page.decode(key, raw)
            for row_id in wanted:
                if row_id not in page:
                    continue
                row = self.marked.get(row_id) or page_row(
                    page, row_id - page.first_id, self.headers, self._statuses([row_id]), self.watermarks
                )
                if row.state in (RowState.PUBLISHED, RowState.DEAD):
                    again = move(row, RowState.PENDING, stamp, seq=self.next_seq + len(replayed))
                    replayed.append((row.state, again, page))
                    if page.first_id not in self.pages:
                        reopened[page.first_id] = page
        if not replayed:
            return []
        writes: dict[tuple[str, str], bytes | None] = {
            (keys.OUTBOX_META_NAMESPACE, NEXT_KEY): f"{self.next_id}/{self.next_seq + len(replayed)}".encode()
        }
        for first_id, page in reopened.items():
            writes[(keys.OUTBOX_META_NAMESPACE, done_key(first_id))] = None
            page.unpublished, page.claimed = 0, 0
            page.marked = set(self._done_marked(first_id))
            self.pages[first_id] = page
        for before, row, page in replayed:
            writes[(keys.OUTBOX_STATE_NAMESPACE, row_key(row.id))] = status_value(row)
            self.counts[before] -= 1
            self.counts[RowState.PENDING] += 1
            if before is RowState.PUBLISHED:
                page.unpublished += 1
            page.marked.add(row.id)
            self.marked[row.id] = row
            self._queue((row.seq, row.id, page, row.id - page.first_id))
        self.write(writes)
        self.next_seq += len(replayed)
        self.unconfirmed = self.next_seq - 1
        return [row.id for _, row, _ in replayed]

    def _pages_holding(self, ids: list[int]) -> Iterator[tuple[str, bytes]]:
        """(key, value) of the stored pages that hold any of ``ids``."""
        pages = list(self.store.items(keys.OUTBOX_NAMESPACE))
        for n, (key, raw) in enumerate(pages):
            first, following = int(key), int(pages[n + 1][0]) if n + 1 < len(pages) else None
            if any(first <= i and (following is None or i < following) for i in ids):
                yield key, raw

    def _statuses(self, ids: list[int]) -> dict[int, bytes]:
        found = self.store.get_many(keys.OUTBOX_STATE_NAMESPACE, [row_key(i) for i in ids])
        return {int(key): raw for key, raw in found.items()}

    def _done_marked(self, first_id: int) -> list[int]:
        raw = self.store.get(keys.OUTBOX_META_NAMESPACE, done_key(first_id))
        return [] if raw is None else decode_done(raw)[2]

    @property
    def waiting(self) -> int:
        """Rows not yet PUBLISHED or DEAD."""
        return self.counts[RowState.PENDING] + self.counts[RowState.CLAIMED]
