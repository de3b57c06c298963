"""The outbox: entries handlers emit, committed with their batch and published after it.

``ctx.emit`` adds an entry to the handler's attempt (``pspf.outbox.emit``); entries of attempts that
return join the batch and are written as outbox rows in the batch's ONE store transaction (DESIGN
step 5), with the state and the checkpoint, so they follow the partition's state (and its backup)
to any owner. A handler that raises, or an entry that ends in the DLQ, emits nothing.

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

This module is the rows' model and their storage layout: the lifecycle, ``OutboxRow``, ``Page``,
the keys and values in the partition's store, and reading rows back from the store or its
backup (``rows_in_store``, ``rows_in_backup``: what the operator's views show). One owned
partition's rows in memory are ``pspf.outbox.partition_outbox``; publishing them is ``pspf.outbox.relay``.
"""

from __future__ import annotations

import enum
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec

from pspf import keys
from pspf.errors import PSPFError, StateError
from pspf.outbox.emit import SourceHeaders

if TYPE_CHECKING:
    from pspf.outbox.emit import Emitted
    from pspf.state_stores import StateStore

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

# A page's rows are ``pspf.outbox.emit.Emitted`` tuples, as the emitter made them.

_encoder = msgspec.msgpack.Encoder()
_page_decoder = msgspec.msgpack.Decoder(
    tuple[int, int, str, list[tuple[str, int, bytes | None, bytes, str, bytes, bytes | None]]]
)
_status_decoder = msgspec.msgpack.Decoder(
    tuple[RowState, int, int, int, int, int | None, str | None, int | None, str | None, int]
)
#: records written before rows could be re-routed (a repartition): no partition of their own
_status_decoder_9 = msgspec.msgpack.Decoder(
    tuple[RowState, int, int, int, int, int | None, str | None, int | None, str | None]
)
_watermark_decoder = msgspec.msgpack.Decoder(tuple[int, int])
_done_decoder = msgspec.msgpack.Decoder(tuple[int, int, list[int]])

#: ``OUTBOX_META_NAMESPACE`` keys: the counters, a watermark per target, a done mark per page.
NEXT_KEY = "next"
_SENT = "sent/"
DONE_PREFIX = "done/"


def watermark_key(target: Target) -> str:
    return f"{_SENT}{target[1]}/{target[0]}"


def done_key(first_id: int) -> str:
    return DONE_PREFIX + row_key(first_id)


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
            row.partition,  # a re-routed row's own (a repartition): its page has the old one
        )
    )


def done_value(page: Page, stamp: int) -> bytes:
    """A page's done mark: when its last row was published, its rows, its rows' status records."""
    return _encoder.encode((stamp, len(page.rows), sorted(page.marked)))


def watermark_value(seq: int, stamp: int) -> bytes:
    """A target's watermark: its rows up to ``seq`` were published, the last at ``stamp``."""
    return _encoder.encode((seq, stamp))


def decode_done(raw: bytes) -> tuple[int, int, list[int]]:
    """A done mark: (when its page's last row was published, its rows, its status records)."""
    return _done_decoder.decode(raw)


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
        try:
            state, seq, created, attempts, available, claimed_ms, claimed_by, published, error, partition = (
                _status_decoder.decode(raw)
            )
        except msgspec.ValidationError:
            state, seq, created, attempts, available, claimed_ms, claimed_by, published, error = (
                _status_decoder_9.decode(raw)
            )
            partition = row[1]
        return OutboxRow(
            row_id, seq, row[0], partition, fields, created, state, attempts, available,
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
        elif key.startswith(DONE_PREFIX):
            done[int(key[len(DONE_PREFIX) :])] = _done_decoder.decode(raw)
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
