"""The outbox: entries handlers emit, committed with their batch and published after it.

``ctx.emit`` adds an entry to the handler's attempt; entries of attempts that return join the
batch and are written as outbox rows in the batch's ONE store transaction (DESIGN step 5), with
the state and the checkpoint, so they follow the partition's state (and its backup) to any owner.
A handler that raises, or an entry that ends in the DLQ, emits nothing.

Rows follow the lifecycle of seed 000, written once in ``TRANSITIONS`` and applied only by
``move``, which refuses any other transition::

    PENDING -> CLAIMED -> PUBLISHED
    CLAIMED -> PENDING (a failed publish or an expired claim: attempts + 1, last error, backoff)
    CLAIMED -> DEAD (attempts exhausted)
    PUBLISHED / DEAD -> PENDING (replay by an operator, under a new sequence number)

A batch's rows are claimed by this worker's relay in the batch's own commit (created PENDING and
claimed in one write), so publishing them needs no write of its own first; a row waiting behind
an earlier one to the same target is created PENDING and claimed when its turn comes. Claims of a
relay that died are reaped by the next owner when it takes the partition (CLAIMED -> PENDING).
A claim is verified before its row is marked PUBLISHED against the partition's index, which
mirrors every write of the rows: the store is this process's alone.

Publishing (step 7) is idempotent on the target: each (app, source partition) is a producer that
numbers its rows; ``lua/publish.lua`` on the target partition's hash tag appends only rows whose
sequence is above the last one it recorded for that producer, and records it in the same call.
So a publish repeated after a crash, or by two relays, adds nothing. Rows to one target partition
are published in sequence order: a row that fails holds back the later rows to the same target
partition until it is published or dead (else the target would take the later sequence first and
refuse the earlier row as already seen).

Fencing: a row is published only once the call that acknowledged its batch, or an explicit backup
flush, succeeded under the partition's lease. An ex-owner's rows that never got there are never
published (the backup, and so the next owner, does not have them); rows that did are in the
backup under the same sequence numbers, so the next owner publishing them again adds nothing.
Acknowledging the input never waits for publishing: a target that refuses makes rows wait with
backoff, not the partition.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import codec, keys
from pspf.errors import BrokerError, ConfigError, NotFound, PSPFError
from pspf.failures import RetryPolicy

if TYPE_CHECKING:
    from pspf.broker import Broker, Fields
    from pspf.context import Context
    from pspf.settings import OutboxSettings
    from state_stores import StateStore

log = logging.getLogger(__name__)

#: Headers every emitted entry carries: where it came from.
SOURCE_APP_HEADER = "pspf-source-app"
SOURCE_TOPIC_HEADER = "pspf-source-topic"
SOURCE_PARTITION_HEADER = "pspf-source-partition"
SOURCE_ID_HEADER = "pspf-source-id"

#: Rows per publishing call (one Lua call appends them to one target partition).
PUBLISH_CHUNK = 500
#: Rows a relay step takes on per partition.
STEP_ROWS = 2_000
#: Rows a pruning pass looks at per partition.
PRUNE_SCAN = 5_000


class RowState(enum.StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    PUBLISHED = "published"
    DEAD = "dead"


#: Every transition a row may make (seed 000); ``move`` refuses any other.
TRANSITIONS: frozenset[tuple[RowState, RowState]] = frozenset(
    {
        (RowState.PENDING, RowState.CLAIMED),
        (RowState.CLAIMED, RowState.PUBLISHED),
        (RowState.CLAIMED, RowState.PENDING),
        (RowState.CLAIMED, RowState.DEAD),
        (RowState.PUBLISHED, RowState.PENDING),
        (RowState.DEAD, RowState.PENDING),
    }
)


class TransitionRefused(PSPFError):
    """A row was asked to make a transition the lifecycle does not allow."""


class EmitError(PSPFError):
    """``ctx.emit`` was given a topic or value it cannot emit: the entry fails like any error."""


class OutboxRow(msgspec.Struct, array_like=True, frozen=True):
    """One emitted entry and where it stands. ``id`` never changes; ``seq`` is new on replay."""

    id: int
    seq: int
    topic: str
    partition: int
    fields: dict[bytes, bytes]
    created_ms: int
    state: RowState = RowState.PENDING
    attempts: int = 0
    available_ms: int = 0
    claimed_ms: int | None = None
    claimed_by: str | None = None
    published_ms: int | None = None
    last_error: str | None = None

    @property
    def stream(self) -> str:
        return keys.stream_key(self.topic, self.partition)


# A row is stored as two values under its key: its content (written once, when the batch that
# emitted it commits) and its status (rewritten at each transition, small).
_encoder = msgspec.msgpack.Encoder()
_content_decoder = msgspec.msgpack.Decoder(tuple[str, int, dict[bytes, bytes]])
_status_decoder = msgspec.msgpack.Decoder(
    tuple[RowState, int, int, int, int, int | None, str | None, int | None, str | None]
)


def status_value(row: OutboxRow) -> bytes:
    return _encoder.encode(
        (
            row.state,
            row.seq,
            row.created_ms,
            row.attempts,
            row.available_ms,
            row.claimed_ms,
            row.claimed_by,
            row.published_ms,
            row.last_error,
        )
    )


def row_writes(row: OutboxRow, content: bool = False) -> dict[tuple[str, str], bytes]:
    """The store writes of a row's status (and with ``content``, of its content too)."""
    key = row_key(row.id)
    writes = {(keys.OUTBOX_STATE_NAMESPACE, key): status_value(row)}
    if content:
        writes[(keys.OUTBOX_NAMESPACE, key)] = _encoder.encode((row.topic, row.partition, row.fields))
    return writes


def join_row(key: str, content: bytes, status: bytes) -> OutboxRow:
    topic, partition, fields = _content_decoder.decode(content)
    state, seq, created, attempts, available, claimed_ms, claimed_by, published, error = (
        _status_decoder.decode(status)
    )
    return OutboxRow(
        int(key),
        seq,
        topic,
        partition,
        fields,
        created,
        state,
        attempts,
        available,
        claimed_ms,
        claimed_by,
        published,
        error,
    )


def rows_in_store(store: StateStore, ids: Iterable[int] | None = None) -> list[OutboxRow]:
    """The rows a store holds (those of ``ids``), in id order."""
    if ids is None:
        statuses = dict(store.items(keys.OUTBOX_STATE_NAMESPACE))
        contents = store.items(keys.OUTBOX_NAMESPACE)
    else:
        wanted = [row_key(i) for i in ids]
        statuses = store.get_many(keys.OUTBOX_STATE_NAMESPACE, wanted)
        contents = iter(sorted(store.get_many(keys.OUTBOX_NAMESPACE, wanted).items()))
    return [join_row(key, raw, statuses[key]) for key, raw in contents if key in statuses]


def rows_in_backup(values: Iterable[tuple[bytes, bytes]]) -> list[OutboxRow]:
    """The rows among a backup's (field, value) pairs, in id order."""
    contents: dict[str, bytes] = {}
    statuses: dict[str, bytes] = {}
    for name, raw in values:
        namespace, _, key = name.partition(b"\x00")
        if namespace == keys.OUTBOX_NAMESPACE.encode():
            contents[key.decode()] = raw
        elif namespace == keys.OUTBOX_STATE_NAMESPACE.encode():
            statuses[key.decode()] = raw
    return [join_row(key, contents[key], statuses[key]) for key in sorted(contents) if key in statuses]


def row_key(row_id: int) -> str:
    """The store key of a row: zero-padded, so keys sort in id order."""
    return f"{row_id:016d}"


def move(
    row: OutboxRow,
    to: RowState,
    now_ms: int,
    *,
    relay: str | None = None,
    error: str | None = None,
    retry_in_ms: int = 0,
    seq: int | None = None,
) -> OutboxRow:
    """The row after the transition to ``to``; TransitionRefused for any the lifecycle forbids.

    PENDING -> CLAIMED needs ``relay`` (claimed_by) and a row whose ``available_ms`` has come;
    CLAIMED -> PENDING counts the attempt, keeps ``error`` and waits ``retry_in_ms``;
    CLAIMED -> DEAD counts the last attempt; a replay (PUBLISHED/DEAD -> PENDING) needs the new
    ``seq``, and starts the attempts again.
    """
    if (row.state, to) not in TRANSITIONS:
        raise TransitionRefused(
            f"outbox row {row.id}: {row.state} -> {to} is not a transition of the lifecycle"
        )
    if to is RowState.CLAIMED:
        if relay is None:
            raise TransitionRefused(f"outbox row {row.id}: a claim needs the relay that makes it")
        if row.available_ms > now_ms:
            raise TransitionRefused(f"outbox row {row.id}: not available before {row.available_ms}")
        return msgspec.structs.replace(row, state=to, claimed_ms=now_ms, claimed_by=relay)
    if to is RowState.PUBLISHED:
        return msgspec.structs.replace(row, state=to, published_ms=now_ms)
    if row.state is RowState.CLAIMED:  # a failed attempt: back to PENDING, or DEAD
        return msgspec.structs.replace(
            row,
            state=to,
            attempts=row.attempts + 1,
            last_error=error,
            available_ms=now_ms + retry_in_ms,
            claimed_ms=None,
            claimed_by=None,
        )
    if seq is None:
        raise TransitionRefused(f"outbox row {row.id}: a replay needs the row's new sequence number")
    return msgspec.structs.replace(
        row,
        state=to,
        seq=seq,
        attempts=0,
        available_ms=now_ms,
        published_ms=None,
        claimed_ms=None,
        claimed_by=None,
    )


def now_ms() -> int:
    return int(time.time() * 1000)


# -- emitting ------------------------------------------------------------------------------------


class Emitter:
    """Turns ``ctx.emit`` calls into entries: checks the topic, encodes, adds the source headers."""

    def __init__(self, broker: Broker, app: str) -> None:
        self.broker = broker
        self.app = app
        self._partitions: dict[str, int] = {}
        self._heads: dict[tuple[str, int], bytes] = {}

    def partitions(self, topic: str) -> int:
        known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            keys.check_name("topic", topic)
            count = self.broker.topic_partitions(topic)
        except (ConfigError, NotFound) as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {exc}") from None
        self._partitions[topic] = count
        return count

    def entry(
        self, ctx: Context, topic: str, value: Any, key: str | None, headers: dict[str, str] | None
    ) -> tuple[str, int, Fields]:
        """(topic, partition, fields) of one emitted entry."""
        partitions = self.partitions(topic)
        try:
            encoded = codec.encode_value(value)
            if headers:
                fields = codec.entry_fields(encoded, key, {**headers, **self._source(ctx)})
            else:  # the common case, without a JSON encoding of the same headers per entry
                fields = codec.entry_fields(encoded, key)
                fields[codec.HEADERS] = self._headers_head(ctx) + ctx._id + b'"}'
        except ConfigError as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {exc}") from None
        partition = (
            keys.partition_for(fields[codec.KEY], partitions)
            if key is not None
            else ctx.partition % partitions
        )
        return topic, partition, fields

    def _source(self, ctx: Context) -> dict[str, str]:
        return {
            SOURCE_APP_HEADER: self.app,
            SOURCE_TOPIC_HEADER: ctx.topic,
            SOURCE_PARTITION_HEADER: str(ctx.partition),
            SOURCE_ID_HEADER: ctx.id,
        }

    def _headers_head(self, ctx: Context) -> bytes:
        """The source headers' JSON up to the entry id's value (ids need no escaping)."""
        head = self._heads.get((ctx.topic, ctx.partition))
        if head is None:
            encoded = codec.json_encoder.encode({**self._source(ctx), SOURCE_ID_HEADER: ""})
            head = self._heads[(ctx.topic, ctx.partition)] = encoded[: -len(b'"}')]
        return head


# -- one partition's rows --------------------------------------------------------------------------


class PartitionOutbox:
    """The outbox rows of one owned partition: the store's, indexed in memory where they wait.

    ``open`` holds the rows not yet PUBLISHED or DEAD. ``confirmed`` is the highest sequence
    number that reached the backup (or the lease-checked acknowledgement) in a call that
    succeeded: rows above it are not published yet (see the module's fencing note).
    """

    def __init__(self, store: StateStore, app: str, partition: int, relay: str) -> None:
        self.store = store
        self.partition = partition
        self.producer = f"{app}/{partition}"
        #: the name of this worker's relay (its consumer name): what its claims say
        self.relay = relay
        self.next_seq = 1
        self.next_id = 1
        self.confirmed = 0
        self.open: dict[int, OutboxRow] = {}
        self.counts: dict[RowState, int] = dict.fromkeys(RowState, 0)
        #: seq of rows committed by the last commits whose acknowledgement is still to come
        self.unconfirmed = 0
        #: when the relay looks for published rows to prune next (monotonic)
        self.next_prune = 0.0

    def load(self) -> None:
        """Index the store's rows at takeover; claims from before (any relay's) are reaped."""
        raw_next = self.store.get(keys.OUTBOX_META_NAMESPACE, "next")
        if raw_next is not None:
            self.next_id, self.next_seq = (int(x) for x in raw_next.decode().split("/"))
        self.open.clear()
        self.counts = dict.fromkeys(RowState, 0)
        reaped: list[tuple[RowState | None, OutboxRow]] = []
        stamp = now_ms()
        for row in rows_in_store(self.store):
            if row.state is RowState.CLAIMED:
                reap = f"claim of {row.claimed_by} reaped at takeover"
                reaped.append((None, move(row, RowState.PENDING, stamp, error=reap)))
                continue
            self.counts[row.state] += 1
            if row.state is RowState.PENDING:
                self.open[row.id] = row
        if reaped:
            self.write(reaped)
            log.info("outbox partition=%s: %s claimed rows back to pending", self.partition, len(reaped))
        # What the store holds at takeover is in the backup (it was reconciled) or, without a
        # backup, on this machine only: either way nobody else publishes anything else.
        self.confirmed = self.next_seq - 1

    def rows_for(self, emitted: list[tuple[str, int, Fields]]) -> list[OutboxRow]:
        """A batch's emitted entries as new rows, numbered on from the partition's counters.

        Each is claimed by this worker's relay in the same write (PENDING -> CLAIMED, so no write
        of its own is needed before it is published), unless an earlier row to the same target
        waits: then it waits PENDING behind it.
        """
        stamp = now_ms()
        held = self.held_targets()
        rows = []
        for i, (topic, partition, fields) in enumerate(emitted):
            row = OutboxRow(
                self.next_id + i, self.next_seq + i, topic, partition, fields, stamp, available_ms=stamp
            )
            rows.append(
                row if (topic, partition) in held else move(row, RowState.CLAIMED, stamp, relay=self.relay)
            )
        return rows

    @staticmethod
    def counters(rows: list[OutboxRow]) -> bytes:
        """The counters' value after ``rows`` (stored with them)."""
        return f"{rows[-1].id + 1}/{rows[-1].seq + 1}".encode()

    def committed(self, rows: list[OutboxRow]) -> None:
        """After the batch commit: its rows are the partition's (to be confirmed)."""
        for row in rows:
            self.open[row.id] = row
            self.counts[row.state] += 1
        self.unconfirmed = rows[-1].seq
        self.next_id, self.next_seq = rows[-1].id + 1, rows[-1].seq + 1

    def confirm(self) -> None:
        """The rows committed so far reached the backup under the lease: they may be published."""
        self.confirmed = max(self.confirmed, self.unconfirmed)

    def write(
        self,
        changes: Iterable[tuple[RowState | None, OutboxRow]],
        extra: dict[tuple[str, str], bytes | None] | None = None,
    ) -> None:
        """Store changed rows (state before, row after) in one transaction; keep index and counts in step."""
        changes = list(changes)
        with self.store.transaction() as tx:
            for _, row in changes:
                tx.set(keys.OUTBOX_STATE_NAMESPACE, row_key(row.id), status_value(row))
            for (namespace, key), value in (extra or {}).items():
                if value is None:
                    tx.delete(namespace, key)
                else:
                    tx.set(namespace, key, value)
        for before, row in changes:
            if before is not None:
                self.counts[before] -= 1
            self.counts[row.state] += 1
            if row.state in (RowState.PENDING, RowState.CLAIMED):
                self.open[row.id] = row
            else:
                self.open.pop(row.id, None)

    def replay(self, ids: Iterable[int]) -> list[int]:
        """PUBLISHED/DEAD rows among ``ids`` back to PENDING under new sequence numbers (one write).

        Others (pending, claimed, pruned) are left as they are. The replayed rows are published
        once ``confirm`` says the write reached the backup.
        """
        stamp = now_ms()
        replayed: list[tuple[RowState | None, OutboxRow]] = []
        for row in sorted(self.current(ids).values(), key=lambda r: r.id):
            if row.state in (RowState.PUBLISHED, RowState.DEAD):
                again = move(row, RowState.PENDING, stamp, seq=self.next_seq + len(replayed))
                replayed.append((row.state, again))
        if replayed:
            counters = f"{self.next_id}/{self.next_seq + len(replayed)}".encode()
            self.write(replayed, {(keys.OUTBOX_META_NAMESPACE, "next"): counters})
            self.next_seq += len(replayed)
            self.unconfirmed = self.next_seq - 1
        return [row.id for _, row in replayed]

    def current(self, ids: Iterable[int]) -> dict[int, OutboxRow]:
        """The rows as the store has them now."""
        return {row.id: row for row in rows_in_store(self.store, ids)}

    def held_targets(self) -> set[tuple[str, int]]:
        """Targets with a row waiting (backing off, or claimed and not yet published)."""
        return {(row.topic, row.partition) for row in self.open.values()}

    def publishable(self, now: int, limit: int) -> list[OutboxRow]:
        """Confirmed rows to publish now, in sequence order, none after a waiting row to the same target.

        Rows this relay claimed when their batch committed, and PENDING rows that are due (to claim).
        """
        out: list[OutboxRow] = []
        held: set[tuple[str, int]] = set()
        for row in sorted(self.open.values(), key=lambda r: r.seq):
            target = (row.topic, row.partition)
            if target in held:
                continue
            ready = (row.state is RowState.CLAIMED and row.claimed_by == self.relay) or (
                row.state is RowState.PENDING and row.available_ms <= now
            )
            if not ready or row.seq > self.confirmed:
                held.add(target)
                continue
            out.append(row)
            if len(out) >= limit:
                break
        return out

    @property
    def waiting(self) -> int:
        """Rows not yet PUBLISHED or DEAD."""
        return len(self.open)


# -- the relay -----------------------------------------------------------------------------------


class RelayHooks:
    """The relay's extension points (``ProcessorHooks`` has them too); the defaults do nothing."""

    def on_outbox_claimed(self, partition: int, rows: int) -> None:
        """A partition's relay claimed ``rows`` rows (durably) and is about to publish them."""

    def on_outbox_sent(self, partition: int, stream: str, rows: int, appended: int) -> None:
        """One publishing call to ``stream`` returned: ``appended`` of its ``rows`` were new there."""

    def on_outbox_settled(self, partition: int, published: list[OutboxRow], failed: list[OutboxRow]) -> None:
        """The claimed rows are marked: published, or back to pending / dead after a failure."""

    def on_outbox_rows(self, partition: int, counts: dict[RowState, int]) -> None:
        """A partition's outbox rows by state, after a relay step."""


def call_hook(hook: Any, *args: Any) -> None:
    """Call a hook; a failing hook is logged, never the worker's failure."""
    try:
        hook(*args)
    except Exception:
        log.exception("a hook failed: %s", getattr(hook, "__qualname__", hook))


class Relay:
    """Publishes the owned partitions' confirmed rows: claim, publish, settle (seed 000)."""

    def __init__(
        self,
        broker: Broker,
        name: str,
        settings: OutboxSettings,
        hooks: RelayHooks | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.broker = broker
        self.name = name
        self.settings = settings
        self.hooks = hooks or RelayHooks()
        self.clock = clock
        #: the same backoff as failing entries': doubling, capped, with jitter
        self.backoff = RetryPolicy(
            base_delay_ms=settings.base_delay_ms, factor=2.0, max_delay_ms=settings.max_delay_ms
        )

    def step(self, outbox: PartitionOutbox) -> tuple[int, int]:
        """One round over a partition's rows; (published, failed) rows."""
        self._expire_claims(outbox)
        rows = outbox.publishable(self.clock(), STEP_ROWS)
        published: list[OutboxRow] = []
        failed: list[OutboxRow] = []
        if rows:
            claimed_at = self.clock()
            due = [
                move(row, RowState.CLAIMED, claimed_at, relay=self.name)
                for row in rows
                if row.state is RowState.PENDING
            ]
            if due:
                outbox.write((RowState.PENDING, row) for row in due)
            claimed = [outbox.open[row.id] for row in rows]
            call_hook(self.hooks.on_outbox_claimed, outbox.partition, len(claimed))
            sent, errors = self._publish(outbox, claimed)
            published, failed = self._settle(outbox, claimed, sent, errors)
            call_hook(self.hooks.on_outbox_settled, outbox.partition, published, failed)
        self._prune(outbox)
        return len(published), len(failed)

    def _publish(self, outbox: PartitionOutbox, rows: list[OutboxRow]) -> tuple[set[int], dict[int, str]]:
        """Publish rows by target partition, in sequence order; (ids sent, error per id not sent)."""
        by_target: dict[tuple[str, int], list[OutboxRow]] = {}
        for row in rows:
            by_target.setdefault((row.topic, row.partition), []).append(row)
        sent: set[int] = set()
        errors: dict[int, str] = {}
        for (topic, partition), target_rows in by_target.items():
            for start in range(0, len(target_rows), PUBLISH_CHUNK):
                chunk = target_rows[start : start + PUBLISH_CHUNK]
                try:
                    appended = self.broker.publish(
                        topic, partition, outbox.producer, [(r.seq, r.fields) for r in chunk]
                    )
                except BrokerError as exc:
                    for row in target_rows[start:]:  # the later rows wait for the failed one
                        errors[row.id] = str(exc)
                    log.warning(
                        "outbox publish to %s failed partition=%s: %s", chunk[0].stream, outbox.partition, exc
                    )
                    break
                sent.update(r.id for r in chunk)
                call_hook(self.hooks.on_outbox_sent, outbox.partition, chunk[0].stream, len(chunk), appended)
        return sent, errors

    def _settle(
        self, outbox: PartitionOutbox, claimed: list[OutboxRow], sent: set[int], errors: dict[int, str]
    ) -> tuple[list[OutboxRow], list[OutboxRow]]:
        """Mark what was published, and count the failed attempts; only rows still claimed by us.

        The claim is verified against the partition's index, which mirrors every write to the rows
        in the store (the store is this process's alone: no other relay can change it).
        """
        now = self.clock()
        published: list[OutboxRow] = []
        failed: list[OutboxRow] = []
        for row in claimed:
            stored = outbox.open.get(row.id)
            if stored is None or stored.claimed_by != self.name or stored.claimed_ms != row.claimed_ms:
                log.warning("outbox row %s: claim lost before it was settled", row.id)
                continue
            if row.id in sent:
                published.append(move(stored, RowState.PUBLISHED, now))
            else:
                failed.append(self._failed(stored, errors.get(row.id, "not published"), now))
        outbox.write((RowState.CLAIMED, row) for row in [*published, *failed])
        return published, failed

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
        expired = [
            row
            for row in outbox.open.values()
            if row.state is RowState.CLAIMED and (row.claimed_ms or 0) + self.settings.claim_timeout_ms <= now
        ]
        if expired:
            outbox.write((RowState.CLAIMED, self._failed(row, "claim expired", now)) for row in expired)

    def _prune(self, outbox: PartitionOutbox) -> None:
        """Delete rows published longer than the retention ago (a bounded look per pass)."""
        if time.monotonic() < outbox.next_prune:
            return
        outbox.next_prune = time.monotonic() + max(1.0, self.settings.retention_s / 10)
        cutoff = self.clock() - int(self.settings.retention_s * 1000)
        doomed = _published_before(outbox.store, cutoff)
        if doomed:
            with outbox.store.transaction() as tx:
                for key in doomed:
                    tx.delete(keys.OUTBOX_NAMESPACE, key)
                    tx.delete(keys.OUTBOX_STATE_NAMESPACE, key)
            outbox.counts[RowState.PUBLISHED] -= len(doomed)


def _published_before(store: StateStore, cutoff: int) -> list[str]:
    """Keys of rows published at or before ``cutoff``, from the oldest on (a bounded look).

    Row ids grow with creation time: the look stops at the first row created after the cutoff.
    """
    doomed = []
    for looked, (key, raw) in enumerate(store.items(keys.OUTBOX_STATE_NAMESPACE)):
        state, _, created, *_, published, _ = _status_decoder.decode(raw)
        if created > cutoff or looked >= PRUNE_SCAN:
            break
        if state is RowState.PUBLISHED and (published or 0) <= cutoff:
            doomed.append(key)
    return doomed
