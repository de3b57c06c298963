"""The outbox: entries handlers emit, committed with their batch and published after it.

``ctx.emit`` adds an entry to the handler's attempt; entries of attempts that return join the
batch and are written as outbox rows in the batch's ONE store transaction (DESIGN step 5), with
the state and the checkpoint, so they follow the partition's state (and its backup) to any owner.
A handler that raises, or an entry that ends in the DLQ, emits nothing.

Rows follow the lifecycle of seed 000, written once in ``TRANSITIONS`` and checked by ``allowed``
for every transition, of one row (``move``) or of many at once::

    PENDING -> CLAIMED -> PUBLISHED
    CLAIMED -> PENDING (a failed publish or an expired claim: attempts + 1, last error, backoff)
    CLAIMED -> DEAD (attempts exhausted)
    PUBLISHED / DEAD -> PENDING (replay by an operator, under a new sequence number)

How rows are stored, so that a row costs no store write of its own on the way that works:

- a batch's rows are ONE value, its ``Page``, written by the batch's commit and never rewritten.
  They are created claimed by this worker's relay (PENDING -> CLAIMED in the same write);
- the relay marks what it published with a watermark per target partition: every row to that
  target with a sequence number up to it is PUBLISHED (rows to one target are published in
  sequence order), and a page whose rows are all published gets a ``done`` mark;
- a row whose state is anything else (it failed, waits behind a failed row, was claimed again,
  died, was replayed) has a status record of its own, which wins over what its page says.

A row created while an earlier row to the same target waits PENDING is created PENDING behind it.
Claims of a relay that died are reaped by the next owner when it takes the partition (CLAIMED ->
PENDING). A claim is verified before its row is marked PUBLISHED against the partition's index,
which mirrors every write of the rows: the store is this process's alone.

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

import bisect
import collections
import enum
import itertools
import logging
import operator
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pspf import codec, keys
from pspf.broker import PublishCall
from pspf.errors import ConfigError, NotFound, PSPFError, StateError
from pspf.failures import RetryPolicy

if TYPE_CHECKING:
    from pspf.broker import Broker, Fields, SentCalls
    from pspf.context import Context, Emitted
    from pspf.settings import OutboxSettings
    from pspf.state_stores import StateStore

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
#: Done marks (pages published whole) a pruning pass looks at per partition, and how often one
#: runs: up to 500 pages (a batch each) a second, more than a worker publishes.
PRUNE_SCAN = 500
PRUNE_EVERY_S = 1.0

#: The fields of a published row, with and without a key.
_KEYED = (codec.KEY, codec.VALUE, codec.HEADERS)
_UNKEYED = (codec.VALUE, codec.HEADERS)

#: A target partition: (topic, partition).
Target = tuple[str, int]


class RowState(enum.StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    PUBLISHED = "published"
    DEAD = "dead"


#: Every transition a row may make (seed 000); ``allowed`` refuses any other.
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


def allowed(before: RowState, after: RowState, what: str = "an outbox row") -> None:
    """Refuse (TransitionRefused) a transition the lifecycle does not have."""
    if (before, after) not in TRANSITIONS:
        raise TransitionRefused(f"{what}: {before} -> {after} is not a transition of the lifecycle")


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
    allowed(row.state, to, f"outbox row {row.id}")
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


def row_key(row_id: int) -> str:
    """The store key of a row's status record, or of a page (its first row's id).

    Zero-padded, so keys sort in id order.
    """
    return f"{row_id:016d}"


# -- how rows are stored -------------------------------------------------------------------------

# An emitted entry (``context.Emitted``), as a page stores it:
# (topic, partition, key or None, value, source topic, source entry id, headers or None). Headers
# are stored only when the handler gave some (merged with the source headers); else they are
# the source headers, made when the row is published or shown.

_encoder = msgspec.msgpack.Encoder()
_page_decoder = msgspec.msgpack.Decoder(
    tuple[int, int, str, list[tuple[str, int, bytes | None, bytes, str, bytes, bytes | None]]]
)
_status_decoder = msgspec.msgpack.Decoder(
    tuple[RowState, int, int, int, int, int | None, str | None, int | None, str | None]
)
_watermark_decoder = msgspec.msgpack.Decoder(tuple[int, int])
_done_decoder = msgspec.msgpack.Decoder(tuple[int, int, list[int]])

#: ``OUTBOX_META_NAMESPACE`` keys: the counters, a watermark per target, a done mark per page.
NEXT_KEY = "next"
_SENT = "sent/"
_DONE = "done/"


def watermark_key(target: Target) -> str:
    return f"{_SENT}{target[1]}/{target[0]}"


def done_key(first_id: int) -> str:
    return _DONE + row_key(first_id)


class Page:
    """The rows one batch emitted: ONE store value, written by the batch's commit, never again.

    Its rows are numbered on from ``first_id`` and ``first_seq``, and claimed by ``claimed_by`` at
    ``created_ms`` unless a status record of their own says otherwise. In memory it also counts
    its rows not published yet and those still claimed as the page says, and knows which rows
    have a status record (``marked``).
    """

    __slots__ = (
        "claimed",
        "claimed_by",
        "created_ms",
        "first_id",
        "first_seq",
        "marked",
        "rows",
        "unpublished",
    )

    def __init__(
        self, first_id: int, first_seq: int, created_ms: int, claimed_by: str, rows: list[Emitted]
    ) -> None:
        self.first_id = first_id
        self.first_seq = first_seq
        self.created_ms = created_ms
        self.claimed_by = claimed_by
        self.rows = rows
        self.unpublished = len(rows)
        self.claimed = 0
        self.marked: set[int] = set()

    def encode(self) -> bytes:
        """msgpack, compressed (level 1: fast).

        Emitted rows repeat themselves (JSON, headers), and a page stays in the store and the
        backup (in the server's memory) until its retention is over.
        """
        return zlib.compress(
            _encoder.encode((self.first_seq, self.created_ms, self.claimed_by, self.rows)), 1
        )

    @classmethod
    def decode(cls, key: str, raw: bytes) -> Page:
        try:
            first_seq, created, claimed_by, rows = _page_decoder.decode(zlib.decompress(raw))
        except (zlib.error, msgspec.DecodeError) as exc:
            raise StateError(
                f"outbox rows {int(key)} and after cannot be read (written by another version of "
                f"PSPF?): {exc}"
            ) from None
        return cls(int(key), first_seq, created, claimed_by, rows)

    def __contains__(self, row_id: int) -> bool:
        return self.first_id <= row_id < self.first_id + len(self.rows)


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


class SourceHeaders:
    """The ``pspf-source-*`` headers of a partition's rows, made without a JSON encoding per row."""

    def __init__(self, app: str, partition: int) -> None:
        self.app = app
        self.partition = partition
        #: per source topic, what ``head`` returns
        self.heads: dict[str, bytes] = {}

    def of(self, row: Emitted) -> bytes:
        """The headers field of a row."""
        given = row[6]
        if given is not None:
            return given
        return self.head(row[4]) + row[5] + b'"}'

    def head(self, source_topic: str) -> bytes:
        """The headers' JSON up to the source entry id's value (ids need no escaping)."""
        head = self.heads.get(source_topic)
        if head is None:
            encoded = codec.json_encoder.encode({**self.source(source_topic, ""), SOURCE_ID_HEADER: ""})
            head = self.heads[source_topic] = encoded[: -len(b'"}')]
        return head

    def source(self, source_topic: str, source_id: str) -> dict[str, str]:
        return {
            SOURCE_APP_HEADER: self.app,
            SOURCE_TOPIC_HEADER: source_topic,
            SOURCE_PARTITION_HEADER: str(self.partition),
            SOURCE_ID_HEADER: source_id,
        }

    def fields(self, row: Emitted) -> Fields:
        """The stream fields of a row, as published."""
        fields: Fields = {} if row[2] is None else {codec.KEY: row[2]}
        fields[codec.VALUE] = row[3]
        fields[codec.HEADERS] = self.of(row)
        return fields


def page_row(
    page: Page,
    index: int,
    headers: SourceHeaders,
    statuses: dict[int, bytes] | None = None,
    watermarks: dict[Target, tuple[int, int]] | None = None,
    done_ms: int | None = None,
) -> OutboxRow:
    """Row ``index`` of a page as it stands.

    Its status record if it has one, else what the page and its target's watermark say: PUBLISHED
    up to the watermark, else CLAIMED as the page was.
    """
    row = page.rows[index]
    row_id = page.first_id + index
    fields = headers.fields(row)
    raw = None if statuses is None else statuses.get(row_id)
    if raw is not None:
        state, seq, created, attempts, available, claimed_ms, claimed_by, published, error = (
            _status_decoder.decode(raw)
        )
        return OutboxRow(
            row_id, seq, row[0], row[1], fields, created, state, attempts, available,
            claimed_ms, claimed_by, published, error,
        )  # fmt: skip
    seq = page.first_seq + index
    mark = None if watermarks is None else watermarks.get((row[0], row[1]))
    claimed = OutboxRow(
        row_id, seq, row[0], row[1], fields, page.created_ms, RowState.CLAIMED,
        available_ms=page.created_ms, claimed_ms=page.created_ms, claimed_by=page.claimed_by,
    )  # fmt: skip
    if mark is not None and seq <= mark[0]:
        return msgspec.structs.replace(
            claimed,
            state=RowState.PUBLISHED,
            published_ms=mark[1] if done_ms is None else done_ms,
            claimed_ms=None,
            claimed_by=None,
        )
    return claimed


def outbox_rows(values: Iterable[tuple[str, str, bytes]], app: str, partition: int) -> list[OutboxRow]:
    """The rows among a partition's outbox values, in id order.

    Values are (namespace, key, value), from the partition's store or its backup.
    """
    pages: list[tuple[str, bytes]] = []
    statuses: dict[int, bytes] = {}
    meta: list[tuple[str, bytes]] = []
    for namespace, key, raw in values:
        if namespace == keys.OUTBOX_NAMESPACE:
            pages.append((key, raw))
        elif namespace == keys.OUTBOX_STATE_NAMESPACE:
            statuses[int(key)] = raw
        elif namespace == keys.OUTBOX_META_NAMESPACE:
            meta.append((key, raw))
    _, watermarks, done = read_meta(meta)
    headers = SourceHeaders(app, partition)
    found: list[OutboxRow] = []
    for key, raw in sorted(pages):
        page = Page.decode(key, raw)
        done_ms = done[page.first_id][0] if page.first_id in done else None
        found += (
            page_row(page, index, headers, statuses, watermarks, done_ms) for index in range(len(page.rows))
        )
    return found


def read_meta(
    items: Iterable[tuple[str, bytes]],
) -> tuple[tuple[int, int] | None, dict[Target, tuple[int, int]], dict[int, tuple[int, int, list[int]]]]:
    """The outbox's counters (next id, next seq), watermarks and done marks among its meta values."""
    counters = None
    watermarks: dict[Target, tuple[int, int]] = {}
    done: dict[int, tuple[int, int, list[int]]] = {}
    for key, raw in items:
        if key == NEXT_KEY:
            next_id, next_seq = raw.decode().split("/")
            counters = (int(next_id), int(next_seq))
        elif key.startswith(_SENT):
            target_partition, _, topic = key[len(_SENT) :].partition("/")
            watermarks[(topic, int(target_partition))] = _watermark_decoder.decode(raw)
        elif key.startswith(_DONE):
            done[int(key[len(_DONE) :])] = _done_decoder.decode(raw)
    return counters, watermarks, done


def rows_in_store(store: StateStore, app: str, partition: int) -> list[OutboxRow]:
    """The outbox rows a partition's store holds, in id order."""
    return outbox_rows(_store_values(store), app, partition)


def _store_values(store: StateStore) -> Iterator[tuple[str, str, bytes]]:
    for namespace in (keys.OUTBOX_NAMESPACE, keys.OUTBOX_STATE_NAMESPACE, keys.OUTBOX_META_NAMESPACE):
        for key, raw in store.items(namespace):
            yield namespace, key, raw


def rows_in_backup(values: Iterable[tuple[bytes, bytes]], app: str, partition: int) -> list[OutboxRow]:
    """The outbox rows among a partition's backup (field, value) pairs, in id order."""

    def split() -> Iterator[tuple[str, str, bytes]]:
        for name, raw in values:
            namespace, _, key = name.partition(b"\x00")
            yield namespace.decode(), key.decode(), raw

    return outbox_rows(split(), app, partition)


# -- emitting ------------------------------------------------------------------------------------


class Topics(Protocol):
    """Where an emitter finds a topic's partition count: the broker (``pspf.testing``: its own)."""

    def topic_partitions(self, topic: str) -> int: ...


class Emitter:
    """Turns ``ctx.emit`` calls into rows: checks the topic, encodes, picks the partition."""

    def __init__(self, topics: Topics, app: str) -> None:
        self.topics = topics
        self.app = app
        self._partitions: dict[str, int] = {}

    def partitions(self, topic: str) -> int:
        known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            keys.check_name("topic", topic)
            count = self.topics.topic_partitions(topic)
        except (ConfigError, NotFound) as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {exc}") from None
        self._partitions[topic] = count
        return count

    def entry(
        self, ctx: Context, topic: str, value: Any, key: str | None, headers: dict[str, str] | None
    ) -> Emitted:
        """One emitted entry, as its page stores it (this runs for every emit: kept lean)."""
        partitions = self._partitions.get(topic) or self.partitions(topic)
        try:
            if isinstance(value, bytes | bytearray | memoryview):
                encoded = bytes(value)
            else:
                encoded = _json_encode(value)
            key_bytes = None if key is None else key.encode()
            given = None
            if headers:
                source = SourceHeaders(self.app, ctx.partition).source(ctx.topic, ctx.id)
                given = codec.entry_fields(b"", None, {**headers, **source})[codec.HEADERS]
        except (TypeError, UnicodeEncodeError, msgspec.EncodeError, ConfigError) as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {_emit_error(exc, value, key)}") from None
        if key_bytes is None:
            return (topic, ctx.partition % partitions, None, encoded, ctx.topic, ctx._id, given)
        return (topic, zlib.crc32(key_bytes) % partitions, key_bytes, encoded, ctx.topic, ctx._id, given)

    def result(self, topic: str, key: str, value: Any, source: tuple[str, bytes], partition: int) -> Emitted:
        """A closed window's result, its source the entry that moved stream time past it."""
        partitions = self._partitions.get(topic) or self.partitions(topic)
        encoded = _json_encode(value)
        source_topic, source_id = source
        if not key:
            return (topic, partition % partitions, None, encoded, source_topic, source_id, None)
        key_bytes = key.encode()
        return (topic, zlib.crc32(key_bytes) % partitions, key_bytes, encoded, source_topic, source_id, None)


_json_encode = codec.json_encoder.encode


def _emit_error(exc: Exception, value: Any, key: str | None) -> str:
    """What was wrong with an emit, as the producer's checks say it."""
    if isinstance(exc, ConfigError):
        return str(exc)
    try:
        codec.encode_value(value)
        if key is not None:
            codec.encode_text("key", key)
    except ConfigError as error:
        return str(error)
    return str(exc)


# -- one partition's rows --------------------------------------------------------------------------

#: A row waiting in its target's queue: (seq, id, page, index in the page).
Item = tuple[int, int, Page, int]
_item_page = operator.itemgetter(2)
_entry_topic = operator.itemgetter(0)
_entry_partition = operator.itemgetter(1)


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
                writes[(keys.OUTBOX_META_NAMESPACE, done_key(first_id))] = _done_value(page, stamp)
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
        return [] if raw is None else _done_decoder.decode(raw)[2]

    @property
    def waiting(self) -> int:
        """Rows not yet PUBLISHED or DEAD."""
        return self.counts[RowState.PENDING] + self.counts[RowState.CLAIMED]


def _done_value(page: Page, stamp: int) -> bytes:
    """A page's done mark: when its last row was published, its rows, its rows' status records."""
    return _encoder.encode((stamp, len(page.rows), sorted(page.marked)))


# -- the relay -----------------------------------------------------------------------------------


class RelayHooks:
    """The relay's extension points (``ProcessorHooks`` has them too); the defaults do nothing."""

    def on_outbox_claimed(self, partition: int, rows: int) -> None:
        """A partition's relay claimed ``rows`` rows (durably) and is about to publish them."""

    def on_outbox_sent(self, partition: int, stream: str, rows: int, appended: int) -> None:
        """One publishing call to ``stream`` returned: ``appended`` of its ``rows`` were new there."""

    def on_outbox_settled(
        self, partition: int, published: list[tuple[int, int]], failed: list[OutboxRow]
    ) -> None:
        """The claimed rows are marked: published, or back to pending / dead after a failure.

        ``published`` has (created_ms, published_ms) of each row published.
        """

    def on_outbox_rows(self, partition: int, counts: dict[RowState, int]) -> None:
        """A partition's outbox rows by state, after a relay step."""


def call_hook(hook: Any, *args: Any) -> None:
    """Call a hook; a failing hook is logged, never the worker's failure."""
    try:
        hook(*args)
    except Exception:
        log.exception("a hook failed: %s", getattr(hook, "__qualname__", hook))


class Sending:
    """A relay step's publishing calls in flight: what each carries, and the claims they rest on."""

    def __init__(
        self, sent: SentCalls, calls: list[tuple[Target, list[Item]]], claims: dict[int, int]
    ) -> None:
        self.sent = sent
        self.calls = calls
        #: claimed_ms of the rows claimed with a status record of their own, by id
        self.claims = claims


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
        """One round over a partition's rows; (published, failed) rows of the calls it settled.

        Settles the calls of the step before, then sends the next calls without waiting for them.
        """
        published, failed = self.settle(outbox)
        self._expire_claims(outbox)
        work = outbox.publishable(self.clock(), STEP_ROWS)
        if work:
            claims = self._claim(outbox, work) if outbox.marked else {}
            call_hook(self.hooks.on_outbox_claimed, outbox.partition, sum(len(items) for _, items in work))
            calls = self._calls(outbox, work)
            sent = self.broker.send_publish(outbox.producer, [call for call, _ in calls])
            outbox.sending = Sending(sent, [(call.target, items) for call, items in calls], claims)
        self._prune(outbox)
        return published, failed

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
        """The publishing calls of a step, each with its rows: ``Broker.send_publish``'s calls.

        One call per target and PUBLISH_CHUNK rows, also split where rows' shape changes (a call's
        rows share their field names and source topic); a call after the first to a target names
        the last row of the one before it, so it runs only if that one did.
        """
        headers = outbox.headers
        calls: list[tuple[PublishCall, list[Item]]] = []
        for target, items in work:
            prev = 0
            start = 0
            while start < len(items):
                chunk = items[start : start + PUBLISH_CHUNK]
                first = chunk[0][2].rows[chunk[0][3]]
                shape = (first[2] is not None, first[4], first[6] is None)
                keyed, source_topic, sourced = shape
                values: list[bytes] = []
                runs: list[list[int]] = []
                for n, (seq, _, page, index) in enumerate(chunk):
                    entry = page.rows[index]
                    if (entry[2] is not None, entry[4], entry[6] is None) != shape:
                        chunk = chunk[:n]
                        break
                    if runs and runs[-1][0] + runs[-1][1] == seq:
                        runs[-1][1] += 1
                    else:
                        runs.append([seq, 1])
                    last = entry[5] if sourced else entry[6]
                    if keyed:
                        values += (entry[2], entry[3], last)  # type: ignore[arg-type]
                    else:
                        values += (entry[3], last)  # type: ignore[arg-type]
                call = PublishCall(
                    target,
                    prev,
                    ",".join(f"{first}:{count}" for first, count in runs),
                    _KEYED if keyed else _UNKEYED,
                    headers.head(source_topic) if sourced else b"",
                    values,
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
        for (target, items), reply in zip(sending.calls, sending.sent.replies(), strict=True):
            stream = keys.stream_key(*target)
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
        done, dead_or_pending = self._mark(outbox, sending, published, failed)
        call_hook(self.hooks.on_outbox_settled, outbox.partition, done, dead_or_pending)
        return len(done), len(dead_or_pending)

    def _mark(
        self,
        outbox: PartitionOutbox,
        sending: Sending,
        published: list[tuple[Target, list[Item]]],
        failed: list[tuple[Item, str]],
    ) -> tuple[list[tuple[int, int]], list[OutboxRow]]:
        """Mark what was published and what failed in ONE store write.

        A watermark per target, the status records of rows that have one, a done mark per page
        published whole. Returns what ``on_outbox_settled`` gets.
        """
        now = self.clock()
        records, marks, finished, done = self._published(outbox, sending, published, now)
        dead_or_pending: list[OutboxRow] = []
        for item, error in failed:
            row = outbox.row(item)
            if self._still_claimed(outbox, sending, row):
                after = self._failed(row, error, now)
                records.append((RowState.CLAIMED if item[1] in outbox.marked else None, after))
                dead_or_pending.append(after)
        writes: dict[tuple[str, str], bytes | None] = {}
        for target, seq in marks.items():
            outbox.watermarks[target] = (seq, now)
            writes[(keys.OUTBOX_META_NAMESPACE, watermark_key(target))] = _encoder.encode((seq, now))
        for page in finished:
            page.marked.update(row.id for _, row in records if row.id in page)
            writes[(keys.OUTBOX_META_NAMESPACE, done_key(page.first_id))] = _done_value(page, now)
        outbox.update(records, writes)
        for page in finished:
            outbox.pages.pop(page.first_id, None)
            for row_id in page.marked:
                outbox.marked.pop(row_id, None)
        for target, _ in sending.calls:
            outbox.trim(target)
        return done, dead_or_pending

    def _published(
        self, outbox: PartitionOutbox, sending: Sending, published: list[tuple[Target, list[Item]]], now: int
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
                if self._still_claimed(outbox, sending, row):
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

    def _still_claimed(self, outbox: PartitionOutbox, sending: Sending, row: OutboxRow) -> bool:
        """Whether a row is still under the claim it was published under (by this relay)."""
        if row.id in outbox.marked:
            mine = row.state is RowState.CLAIMED and row.claimed_ms == sending.claims.get(row.id)
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
        for looked, (key, raw) in enumerate(outbox.store.items(keys.OUTBOX_META_NAMESPACE, _DONE)):
            if looked >= PRUNE_SCAN:
                break
            stamp, rows, marked = _done_decoder.decode(raw)
            if stamp > cutoff:
                continue
            writes[(keys.OUTBOX_META_NAMESPACE, key)] = None
            writes[(keys.OUTBOX_NAMESPACE, key[len(_DONE) :])] = None
            writes.update(((keys.OUTBOX_STATE_NAMESPACE, row_key(i)), None) for i in marked)
            pruned += rows
        if writes:
            outbox.write(writes)
            outbox.counts[RowState.PUBLISHED] -= pruned
