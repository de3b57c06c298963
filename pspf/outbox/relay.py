"""The relay: publishes an owned partition's confirmed outbox rows, idempotently (DESIGN step 7).

One ``Relay.step`` per partition and round: settle the publishing calls of the step before
(mark their rows PUBLISHED, or back to PENDING with backoff, or DEAD after their attempts),
expire claims, claim the due rows, send the next calls without waiting for their replies, and
prune pages published longer than the retention ago. Its extension points are ``hooks.RelayHooks``.

Publishing (step 7) is idempotent on the target: each (app, source partition) is a producer that
numbers its rows; ``lua/publish.lua`` on the target partition's hash tag appends only rows whose
sequence is above the last one it recorded for that producer, and records it in the same call.
So a publish repeated after a crash, or by two relays, adds nothing. A relay step sends its calls
together and reads their replies in the next step, while the server is busy with them and this
process with the next batch; a call after the first to one target partition runs only if the one
before it did (else the target would take the later rows and refuse the earlier ones as seen).
A row that fails holds back the later rows to its target partition until it is published or dead.

Fencing: a row is published only once the call that acknowledged its batch, or an explicit backup
flush, succeeded under the partition's lease. An ex-owner's rows that never got there are never
published (the backup, and so the next owner, does not have them); rows that did are in the
backup under the same sequence numbers, so the next owner publishing them again adds nothing.
Acknowledging the input never waits for publishing: a target that refuses makes rows wait with
backoff, not the partition.
"""

from __future__ import annotations

import collections
import logging
import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from pspf import codec, keys
from pspf.broker import PublishCall, refused_layout
from pspf.failures import RetryPolicy
from pspf.hooks import RelayHooks, call_hook
from pspf.outbox.emit import EmitError
from pspf.outbox.partition_outbox import Item, PartitionOutbox, Sending
from pspf.outbox.rows import (
    DONE_PREFIX,
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
    row_key,
    watermark_key,
    watermark_value,
)

if TYPE_CHECKING:
    from pspf.broker import Publishing
    from pspf.outbox.emit import Emitter
    from pspf.settings import OutboxSettings

log = logging.getLogger("pspf.relay")

#: Rows per publishing call (one Lua call appends them to one target partition).
PUBLISH_CHUNK = 500
#: Rows a relay step takes on per partition.
STEP_ROWS = 2_000
#: Done marks (pages published whole) a pruning pass looks at per partition, and how often one
#: runs: up to 500 pages (a batch each) a second, more than a worker publishes.
PRUNE_SCAN = 500
PRUNE_EVERY_S = 1.0

#: How long rows refused for their layout wait while a repartition of their topic runs.
LAYOUT_WAIT_MS = 500

#: The fields of a published row, with and without a key.
_KEYED = (codec.KEY, codec.VALUE, codec.HEADERS)
_UNKEYED = (codec.VALUE, codec.HEADERS)
_item_page = operator.itemgetter(2)


class Relay:
    """Publishes the owned partitions' confirmed rows: claim, publish, settle (seed 000)."""

    def __init__(
        self,
        publishing: Publishing,
        name: str,
        settings: OutboxSettings,
        emitter: Emitter,
        hooks: RelayHooks | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.publishing = publishing
        self.name = name
        self.settings = settings
        #: the worker's emitter: the layout each target topic's rows are routed in
        self.emitter = emitter
        self.hooks = hooks or RelayHooks()
        self.clock = clock
        #: the same backoff as failing entries': doubling, capped, with jitter
        self.backoff = RetryPolicy(
            base_delay_ms=settings.base_delay_ms, factor=2.0, max_delay_ms=settings.max_delay_ms
        )

    def step(self, outbox: PartitionOutbox) -> tuple[int, int]:
        """One round over a partition's rows; (published, failed) rows of the calls it settled.

        Settles the calls of the step before, then sends the next calls without waiting for them.
        """
        published, failed = self.settle(outbox)
        self.follow_layouts(outbox)
        self._expire_claims(outbox)
        work = outbox.publishable(self.clock(), STEP_ROWS)
        if work:
            claims = self._claim(outbox, work) if outbox.marked else {}
            call_hook(self.hooks.on_outbox_claimed, outbox.partition, sum(len(items) for _, items in work))
            calls = self._calls(outbox, work)
            sent = self.publishing.send_publish(outbox.producer, [call for call, _ in calls])
            outbox.sending = Sending(sent, [(call.target, items) for call, items in calls], claims)
        self._prune(outbox)
        return published, failed

    def follow_layouts(self, outbox: PartitionOutbox) -> None:
        """Re-route the waiting rows of a target topic whose layout the emitter knows newer.

        Called at takeover too, before the partition's first batch: rows it emits are routed in
        today's layout, and a key's rows from before must be routed again ahead of them.
        """
        for topic in {target[0] for target in outbox.queues}:
            layout = self.emitter.layouts.get(topic)
            if layout is None:  # rows from the store (a takeover): check them in today's layout
                try:
                    self.emitter.partitions(topic)
                except EmitError:
                    continue  # the topic is gone: publishing says so
                layout = self.emitter.layouts[topic]
            if outbox.layouts.get(topic) != layout:
                self._published_before(outbox, topic)
                moved = outbox.reroute(topic, self.emitter.partitions(topic))
                outbox.layouts[topic] = layout
                if moved:
                    log.info(
                        "outbox partition=%s: %s rows to topic %s routed again (it was repartitioned)",
                        outbox.partition,
                        moved,
                        topic,
                    )

    def _published_before(self, outbox: PartitionOutbox, topic: str) -> None:
        """Mark the waiting rows to ``topic`` that its partitions' records say were appended.

        A kill between a publish and its mark leaves such rows; sent again they are skipped, but
        routed again (a repartition) they would be appended twice. Rows to one target are
        appended in sequence order, so every row at or below the record was.
        """
        targets = [target for target in outbox.queues if target[0] == topic]
        records = self.publishing.published_up_to(outbox.producer, targets) if targets else []
        now = self.clock()
        published: list[tuple[Target, list[Item]]] = []
        claims: dict[int, int] = {}
        reclaimed: list[tuple[RowState | None, OutboxRow]] = []
        for target, record in zip(targets, records, strict=True):
            items = [
                item
                for item in outbox.queues[target]
                if item[0] <= record and outbox.row(item).state not in (RowState.PUBLISHED, RowState.DEAD)
            ]
            for item in items:
                row = outbox.marked.get(item[1])
                if row is None:
                    continue  # claimed by this relay, as its page says
                if not (row.state is RowState.CLAIMED and row.claimed_by == self.name):
                    mine = msgspec.structs.replace(
                        row, state=RowState.CLAIMED, claimed_ms=now, claimed_by=self.name
                    )
                    reclaimed.append((row.state, mine))
                    row = mine
                claims[item[1]] = row.claimed_ms or now
            if items:
                published.append((target, items))
        if reclaimed:
            outbox.update(reclaimed)
        if published:
            done, _ = self._mark(outbox, claims, published, [], published)
            call_hook(self.hooks.on_outbox_settled, outbox.partition, done, [])

    def _claim(self, outbox: PartitionOutbox, work: list[tuple[Target, list[Item]]]) -> dict[int, int]:
        """Claim the due PENDING rows among ``work`` (one write); the claims of rows with a record."""
        claimed_at = self.clock()
        due: list[tuple[RowState | None, OutboxRow]] = [
            (RowState.PENDING, move(row, RowState.CLAIMED, claimed_at, relay=self.name))
            for _, items in work
            for item in items
            if (row := outbox.marked.get(item[1])) is not None and row.state is RowState.PENDING
        ]
        if due:
            outbox.update(due)
        return {
            item[1]: row.claimed_ms or 0
            for _, items in work
            for item in items
            if (row := outbox.marked.get(item[1])) is not None
        }

    def _calls(
        self, outbox: PartitionOutbox, work: list[tuple[Target, list[Item]]]
    ) -> list[tuple[PublishCall, list[Item]]]:
        """The publishing calls of a step, each with its rows: ``Publishing.send_publish``'s calls.

        One call per target and PUBLISH_CHUNK rows, also split where rows' shape changes (a call's
        rows share their field names and source topic); a call after the first to a target names
        the last row of the one before it, so it runs only if that one did.
        """
        headers = outbox.headers
        calls: list[tuple[PublishCall, list[Item]]] = []
        for target, items in work:
            layout = outbox.layouts.get(target[0], "0")
            prev = 0
            start = 0
            while start < len(items):
                chunk = items[start : start + PUBLISH_CHUNK]
                first = chunk[0][2].rows[chunk[0][3]]
                keyed, source_topic, sourced = first[2] is not None, first[4], first[6] is None
                values: list[bytes] = []
                add = values.append
                runs: list[tuple[int, int]] = []
                run_first = run_next = chunk[0][0]
                for n, (seq, _, page, index) in enumerate(chunk):  # per row: kept lean
                    entry = page.rows[index]
                    if (
                        (entry[2] is not None) is not keyed
                        or entry[4] != source_topic
                        or (entry[6] is None) is not sourced
                    ):
                        chunk = chunk[:n]
                        break
                    if seq != run_next:
                        runs.append((run_first, run_next - run_first))
                        run_first = seq
                    run_next = seq + 1
                    if keyed:
                        add(entry[2])  # type: ignore[arg-type]
                    add(entry[3])
                    add(entry[5] if sourced else entry[6])  # type: ignore[arg-type]
                runs.append((run_first, run_next - run_first))
                call = PublishCall(
                    target,
                    prev,
                    ",".join(f"{first}:{count}" for first, count in runs),
                    _KEYED if keyed else _UNKEYED,
                    headers.head(source_topic) if sourced else b"",
                    values,
                    layout,
                )
                calls.append((call, chunk))
                prev = chunk[-1][0]
                start += len(chunk)
        return calls

    def settle(self, outbox: PartitionOutbox) -> tuple[int, int]:
        """Read the replies of the calls in flight and mark their rows; (published, failed) rows."""
        sending = outbox.sending
        if sending is None:
            return 0, 0
        outbox.sending = None
        published: list[tuple[Target, list[Item]]] = []
        failed: list[tuple[Item, str]] = []
        broken: dict[Target, str] = {}
        refused: list[Item] = []
        for (target, items), reply in zip(sending.calls, sending.sent.replies(), strict=True):
            stream = keys.stream_key(*target)
            if refused_layout(reply) is not None:  # a repartition: nothing of the call was written
                refused += items
                broken.setdefault(target, str(reply))
                continue
            if target in broken or isinstance(reply, BaseException):
                if target not in broken:
                    broken[target] = str(reply)
                    log.warning(
                        "outbox publish to %s failed partition=%s: %s", stream, outbox.partition, reply
                    )
                failed += ((item, broken[target]) for item in items)
                continue
            call_hook(self.hooks.on_outbox_sent, outbox.partition, stream, len(items), int(reply[0]))
            published.append((target, items))
        done, dead_or_pending = self._mark(outbox, sending.claims, published, failed, sending.calls)
        if refused:
            self._wait_for_layout(outbox, sending.claims, refused)
        call_hook(self.hooks.on_outbox_settled, outbox.partition, done, dead_or_pending)
        return len(done), len(dead_or_pending)

    def _mark(
        self,
        outbox: PartitionOutbox,
        claims: dict[int, int],
        published: list[tuple[Target, list[Item]]],
        failed: list[tuple[Item, str]],
        calls: list[tuple[Target, list[Item]]],
    ) -> tuple[list[tuple[int, int]], list[OutboxRow]]:
        """Mark what was published and what failed in ONE store write (the rows under ``claims``).

        A watermark per target, the status records of rows that have one, a done mark per page
        published whole. Returns what ``on_outbox_settled`` gets.
        """
        now = self.clock()
        records, marks, finished, done = self._published(outbox, claims, published, now)
        dead_or_pending: list[OutboxRow] = []
        for item, error in failed:
            row = outbox.row(item)
            if self._still_claimed(outbox, claims, row):
                after = self._failed(row, error, now)
                records.append((RowState.CLAIMED if item[1] in outbox.marked else None, after))
                dead_or_pending.append(after)
        writes: dict[tuple[str, str], bytes | None] = {}
        for target, seq in marks.items():
            outbox.watermarks[target] = (seq, now)
            writes[(keys.OUTBOX_META_NAMESPACE, watermark_key(target))] = watermark_value(seq, now)
        for page in finished:
            page.marked.update(row.id for _, row in records if row.id in page)
            writes[(keys.OUTBOX_META_NAMESPACE, done_key(page.first_id))] = done_value(page, now)
        outbox.update(records, writes)
        for page in finished:
            outbox.pages.pop(page.first_id, None)
            for row_id in page.marked:
                outbox.marked.pop(row_id, None)
        for target, _ in calls:
            outbox.trim(target)
        return done, dead_or_pending

    def _published(
        self,
        outbox: PartitionOutbox,
        claims: dict[int, int],
        published: list[tuple[Target, list[Item]]],
        now: int,
    ) -> tuple[list[tuple[RowState | None, OutboxRow]], dict[Target, int], list[Page], list[tuple[int, int]]]:
        """What marks the published rows that are still claimed by this relay.

        Their status records (of those that have one), the watermarks, the pages they finish, and
        (created_ms, published_ms) of each.

        The claim is verified against the partition's index, which mirrors every write to the rows
        in the store (the store is this process's alone: no other relay can change it).
        """
        allowed(RowState.CLAIMED, RowState.PUBLISHED, "published page rows")
        records: list[tuple[RowState | None, OutboxRow]] = []
        marks: dict[Target, int] = {}
        as_page_says: collections.Counter[Page] = collections.Counter()
        per_page: collections.Counter[Page] = collections.Counter()
        for target, items in published:
            if not outbox.marked:  # the common case: every row claimed as its page says
                as_page_says.update(map(_item_page, items))
                marks[target] = items[-1][0]
                continue
            for item in items:
                row = outbox.row(item)
                if self._still_claimed(outbox, claims, row):
                    if item[1] in outbox.marked:
                        records.append((RowState.CLAIMED, move(row, RowState.PUBLISHED, now)))
                        per_page[item[2]] += 1
                    else:
                        as_page_says[item[2]] += 1
                    marks[target] = item[0]
        for page, rows in as_page_says.items():
            page.claimed -= rows
            outbox.counts[RowState.CLAIMED] -= rows
            outbox.counts[RowState.PUBLISHED] += rows
        per_page.update(as_page_says)
        finished: list[Page] = []
        done: list[tuple[int, int]] = []
        for page, rows in per_page.items():
            page.unpublished -= rows
            if not page.unpublished:
                finished.append(page)
            done += [(page.created_ms, now)] * rows
        return records, marks, finished, done

    def _wait_for_layout(self, outbox: PartitionOutbox, claims: dict[int, int], refused: list[Item]) -> None:
        """Rows a target refused for their layout wait, no attempt counted, for the switch.

        The emitter reads the topics' layouts again: after the switch the next step re-routes the
        rows (``follow_layouts``); while the repartition runs they wait ``LAYOUT_WAIT_MS``.
        """
        topics = {outbox.row(item).topic for item in refused}
        moved = {topic for topic in topics if self.emitter.refresh(topic)}
        later = self.clock() + (0 if moved else LAYOUT_WAIT_MS)
        rows: list[tuple[RowState | None, OutboxRow]] = []
        for item in refused:
            row = outbox.row(item)
            if self._still_claimed(outbox, claims, row):
                again = msgspec.structs.replace(
                    row, state=RowState.PENDING, available_ms=later, claimed_ms=None, claimed_by=None
                )
                rows.append((RowState.CLAIMED if item[1] in outbox.marked else None, again))
        if rows:
            outbox.update(rows)
        if not moved:
            log.info(
                "outbox partition=%s: rows to %s wait for a repartition", outbox.partition, sorted(topics)
            )

    def _still_claimed(self, outbox: PartitionOutbox, claims: dict[int, int], row: OutboxRow) -> bool:
        """Whether a row is still under the claim it was published under (by this relay)."""
        if row.id in outbox.marked:
            mine = row.state is RowState.CLAIMED and row.claimed_ms == claims.get(row.id)
        else:
            mine = row.claimed_by == self.name
        if not mine:
            log.warning("outbox row %s: claim lost before it was settled", row.id)
        return mine

    def _failed(self, row: OutboxRow, error: str, now: int) -> OutboxRow:
        s = self.settings
        if row.attempts + 1 >= s.max_attempts:
            log.error(
                "outbox row %s to %s is dead after %s attempts: %s",
                row.id,
                row.stream,
                row.attempts + 1,
                error,
            )
            return move(row, RowState.DEAD, now, error=error)
        delay_s = self.backoff.delay_s(row.attempts + 1)
        return move(row, RowState.PENDING, now, error=error, retry_in_ms=int(delay_s * 1000))

    def _expire_claims(self, outbox: PartitionOutbox) -> None:
        now = self.clock()
        timeout = self.settings.claim_timeout_ms
        expired: list[tuple[RowState | None, OutboxRow]] = [
            (RowState.CLAIMED, self._failed(row, "claim expired", now))
            for row in outbox.marked.values()
            if row.state is RowState.CLAIMED and (row.claimed_ms or 0) + timeout <= now
        ]
        for page in outbox.pages.values():
            if page.claimed and page.created_ms + timeout <= now:
                for index in range(len(page.rows)):
                    row = page_row(page, index, outbox.headers, None, outbox.watermarks)
                    if row.id not in outbox.marked and row.state is RowState.CLAIMED:
                        expired.append((None, self._failed(row, "claim expired", now)))
        if expired:
            outbox.update(expired)

    def finish(self, outbox: PartitionOutbox) -> None:
        """Settle the calls in flight before the partition goes (what cannot be read counts as failed)."""
        if outbox.sending is not None:
            self.settle(outbox)

    def _prune(self, outbox: PartitionOutbox) -> None:
        """Delete pages published longer than the retention ago (a bounded look per pass)."""
        if not outbox.counts[RowState.PUBLISHED] or time.monotonic() < outbox.next_prune:
            return
        outbox.next_prune = time.monotonic() + PRUNE_EVERY_S
        cutoff = self.clock() - int(self.settings.retention_s * 1000)
        writes: dict[tuple[str, str], bytes | None] = {}
        pruned = 0
        for looked, (key, raw) in enumerate(outbox.store.items(keys.OUTBOX_META_NAMESPACE, DONE_PREFIX)):
            if looked >= PRUNE_SCAN:
                break
            stamp, rows, marked = decode_done(raw)
            if stamp > cutoff:
                continue
            writes[(keys.OUTBOX_META_NAMESPACE, key)] = None
            writes[(keys.OUTBOX_NAMESPACE, key[len(DONE_PREFIX) :])] = None
            writes.update(((keys.OUTBOX_STATE_NAMESPACE, row_key(i)), None) for i in marked)
            pruned += rows
        if writes:
            outbox.write(writes)
            outbox.counts[RowState.PUBLISHED] -= pruned
