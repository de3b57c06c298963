"""The records the service layer returns: what ``pspf ... --json`` prints and the admin API sends.

Each is a frozen msgspec Struct, so one shape serves the CLI's JSON, the admin API's bodies and
its OpenAPI document (generated from these classes, their fields and their docstrings: changing
one changes the wire). Where a record is built from another object PSPF already has (a dead
letter, an outbox row, a live member, a group's reply), it has a constructor ``of`` that does the
copying, so the service never copies fields one by one. Nothing here talks to Redis or a store.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import codec
from pspf.errors import DecodeError
from pspf.outbox.emit import SOURCE_ID_HEADER, SOURCE_TOPIC_HEADER
from pspf.worker.retention import PartitionTrim, Retention

if TYPE_CHECKING:
    from pspf.broker import GroupInfo as BrokerGroup
    from pspf.broker import StreamInfo
    from pspf.failures import DeadLetter
    from pspf.outbox.rows import OutboxRow
    from pspf.ownership.membership import Member


def iso_time(ms: int) -> str:
    """Unix milliseconds as the records show a time: ISO 8601, UTC, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def text_or_none(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    consumers: int
    pending: int
    last_delivered_id: str

    @classmethod
    def of(cls, name: str, group: BrokerGroup) -> GroupInfo:
        """A consumer group as the broker read it (XINFO GROUPS)."""
        return cls(
            name=name,
            consumers=group.consumers,
            pending=group.pending,
            last_delivered_id=group.last_delivered_id.decode(),
        )


class PartitionInfo(msgspec.Struct, frozen=True, kw_only=True):
    partition: int
    stream: str
    length: int
    last_id: str | None
    groups: list[GroupInfo]

    @classmethod
    def of(cls, partition: int, stream: str, info: StreamInfo) -> PartitionInfo:
        """One partition's stream as the broker read it (XINFO STREAM and GROUPS)."""
        return cls(
            partition=partition,
            stream=stream,
            length=info.length,
            last_id=info.last_id.decode() if info.last_id else None,
            groups=[GroupInfo.of(name, group) for name, group in info.groups.items()],
        )


class TopicInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    partitions: int


class TopicEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a topic as ``pspf topic read`` shows it: its value decoded for people to read.

    An entry a handler could not decode is still shown: a value that is not JSON as its text (or,
    when not UTF-8, the repr of its bytes), headers that are not a JSON object as their text.
    """

    id: str
    partition: int
    key: str | None
    value: Any
    #: How ``value`` was read: ``json``, ``msgpack``, ``flat`` (the entry's field map), ``text``
    #: (not JSON) or ``bytes`` (not UTF-8 either, shown as its repr).
    encoding: str
    headers: dict[str, str] | str

    @classmethod
    def of(cls, partition: int, entry_id: bytes, fields: dict[bytes, bytes]) -> TopicEntry:
        value, encoding = _shown_value(fields)
        raw_headers = fields.get(codec.HEADERS)
        headers: dict[str, str] | str
        try:
            headers = codec.decode_headers(raw_headers)
        except DecodeError:
            headers = _shown_bytes(raw_headers or b"")[0]
        key = fields.get(codec.KEY)
        return cls(
            id=entry_id.decode(),
            partition=partition,
            key=None if key is None else key.decode(errors="backslashreplace"),
            value=value,
            encoding=encoding,
            headers=headers,
        )


def _shown_value(fields: dict[bytes, bytes]) -> tuple[Any, str]:
    """An entry's value and how it was read, whatever its bytes are."""
    raw = fields.get(codec.VALUE)
    if raw is None:
        flat = {n: v for n, v in fields.items() if n != codec.HEADERS}
        return {_shown_bytes(n)[0]: _shown_bytes(v)[0] for n, v in flat.items()}, "flat"
    if fields.get(codec.ENCODING) == codec.MSGPACK:
        try:
            value = msgspec.msgpack.decode(raw)
            codec.json_encoder.encode(value)  # shown as JSON: an ext type or a bytes key is not
            return value, "msgpack"
        except (msgspec.DecodeError, msgspec.EncodeError, TypeError, RecursionError):
            return _shown_bytes(raw)
    try:
        return msgspec.json.decode(raw), "json"
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return _shown_bytes(raw)


def _shown_bytes(raw: bytes) -> tuple[str, str]:
    """Bytes that are not JSON: their text, else the repr of the bytes."""
    try:
        return raw.decode(), "text"
    except UnicodeDecodeError:
        return repr(raw), "bytes"


class TopicDescription(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    partitions: list[PartitionInfo]
    length: int
    retention: Retention
    #: per partition: its memory and what trimming by the retention would remove now
    trims: list[PartitionTrim]


class TopicTrim(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf topic trim`` did (or, with ``dry_run``, would do)."""

    name: str
    retention: Retention
    dry_run: bool
    partitions: list[PartitionTrim]
    removed: int


class DeadLetterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One DLQ entry as ``pspf dlq list`` shows it."""

    dlq_id: str
    partition: int
    source_id: str
    key: str | None
    app: str
    error_type: str
    message: str
    attempts: int
    failed_at: str

    @classmethod
    def of(cls, partition: int, entry_id: bytes, record: DeadLetter) -> DeadLetterInfo:
        """The DLQ entry ``entry_id`` of ``partition``, holding ``record``."""
        return cls(
            dlq_id=f"{partition}:{entry_id.decode()}",
            partition=partition,
            source_id=record.source_id,
            key=record.key,
            app=record.app,
            error_type=record.error_type,
            message=record.message,
            attempts=record.attempts,
            failed_at=iso_time(record.last_failed_ms),
        )


class DeadLetterDetail(msgspec.Struct, frozen=True, kw_only=True):
    """One DLQ entry whole, as ``pspf dlq show`` shows it; ``value`` is decoded when possible."""

    dlq_id: str
    source_topic: str
    source_partition: int
    source_id: str
    key: str | None
    headers: dict[str, str]
    value: Any
    value_bytes: int
    app: str
    consumer: str
    error_type: str
    message: str
    traceback: str
    attempts: int
    first_failed_at: str
    last_failed_at: str

    @classmethod
    def of(cls, dlq_id: str, record: DeadLetter) -> DeadLetterDetail:
        """The DLQ entry ``dlq_id`` holding ``record``; a value or headers it cannot decode are None, {}."""
        original = record.original
        try:
            value: Any = codec.ValueDecoder().decode(original)
        except DecodeError:
            value = None
        try:
            headers = codec.decode_headers(original.get(codec.HEADERS))
        except DecodeError:
            headers = {}
        return cls(
            dlq_id=dlq_id,
            source_topic=record.source_topic,
            source_partition=record.source_partition,
            source_id=record.source_id,
            key=record.key,
            headers=headers,
            value=value,
            value_bytes=len(original.get(codec.VALUE, b"")),
            app=record.app,
            consumer=record.consumer,
            error_type=record.error_type,
            message=record.message,
            traceback=record.traceback,
            attempts=record.attempts,
            first_failed_at=iso_time(record.first_failed_ms),
            last_failed_at=iso_time(record.last_failed_ms),
        )


class DlqChange(msgspec.Struct, frozen=True, kw_only=True):
    """What a redrive or purge did (or, with ``dry_run``, would do)."""

    selected: int
    changed: int
    dry_run: bool


class PartitionLag(msgspec.Struct, frozen=True, kw_only=True):
    """Where one app stands in one topic partition, as ``pspf lag`` shows it."""

    topic: str
    partition: int
    #: the newest entry of the partition
    last_id: str | None
    #: the group's last delivered entry
    delivered_id: str | None
    #: the app's committed checkpoint, when its state directory is reachable from here
    checkpoint: str | None
    #: entries not yet acknowledged: not delivered yet, or delivered and pending
    lag: int
    pending: int
    oldest_pending_age_s: float | None
    #: the worker holding the partition's lease (``consumer/pid/nonce``), None when nobody does
    owner: str | None
    #: consumers the app's group has in the stream (workers that read it; idle ones are deleted)
    consumers: int = 0
    #: entries of this app in the partition's DLQ
    dead_letters: int


class AppMember(msgspec.Struct, frozen=True, kw_only=True):
    """A live worker of an app, as ``pspf lag`` shows it."""

    #: the member id, also the owner part of the leases it holds (``consumer/pid/nonce``)
    id: str
    consumer: str
    host: str
    pid: int
    since: str
    last_heartbeat: str
    #: the partitions whose leases it holds now
    partitions: list[int]
    #: per global table of the app: entries its streams hold past this worker's read position,
    #: as the worker counted them (every few seconds) before its last heartbeat
    global_tables: dict[str, int] = {}

    @classmethod
    def of(cls, member: Member, partitions: list[int]) -> AppMember:
        """A live member, holding the leases of ``partitions``."""
        return cls(
            id=member.id,
            consumer=member.consumer,
            host=member.host,
            pid=member.pid,
            since=iso_time(member.joined_ms),
            last_heartbeat=iso_time(member.last_heartbeat_ms),
            partitions=partitions,
            global_tables=member.global_lag,
        )


class AppLag(msgspec.Struct, frozen=True, kw_only=True):
    """An app (its consumer group) and its lag per topic partition."""

    app: str
    topics: list[str]
    partitions: int
    lag: int
    pending: int
    oldest_pending_age_s: float | None
    owners: list[str]
    dead_letters: int
    detail: list[PartitionLag]
    #: the workers sharing the app's partitions (live members), oldest first
    members: list[AppMember] = []
    #: the most consumers its group has in one stream (names pile up when they change per pod)
    consumers: int = 0
    #: why the figures are missing (``groups`` lists an app it cannot read, e.g. a key of the
    #: wrong type, instead of failing for every app)
    error: str | None = None

    @classmethod
    def failed(cls, app: str, topics: list[str], error: str) -> AppLag:
        """An app whose figures could not be read, and why: every figure zero or empty."""
        return cls(
            app=app,
            topics=topics,
            partitions=0,
            lag=0,
            pending=0,
            oldest_pending_age_s=None,
            owners=[],
            dead_letters=0,
            detail=[],
            error=error,
        )


class AdoptResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``state_adopt`` did: per partition adopted, where its groups now start."""

    app: str
    #: partition -> topic -> the consumer group's start (the store's checkpoint, or "0")
    adopted: dict[int, dict[str, str]]
    #: partitions left alone: their group or state backup is still on the server
    kept: list[int]


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``replay`` did (or, with ``dry_run``, would do)."""

    app: str
    topics: list[str]
    #: the group's new position: entries after it are delivered again
    position: str
    partitions: int
    entries_to_replay: int
    #: replayed entries that a redriven copy, also replayed, replaces: skipped, as in the first run
    superseded: int = 0
    state_reset: bool
    dry_run: bool


class OutboxRowInfo(msgspec.Struct, frozen=True, kw_only=True):
    """An outbox row as ``pspf outbox list`` shows it."""

    #: PARTITION:ROW (the source partition and the row's number there)
    row_id: str
    state: str
    topic: str
    partition: int
    key: str | None
    seq: int
    attempts: int
    last_error: str | None
    created_at: str
    published_at: str | None
    #: the input entry that emitted it (source topic and id)
    source: str | None

    @classmethod
    def of(cls, partition: int, row: OutboxRow) -> OutboxRowInfo:
        """The outbox row ``row`` of source partition ``partition``."""
        return cls(**_row_fields(partition, row))


class OutboxRowDetail(OutboxRowInfo, frozen=True, kw_only=True):
    """One outbox row whole: also its value, headers and claim."""

    value: str
    headers: dict[str, str]
    available_at: str
    claimed_at: str | None
    claimed_by: str | None

    @classmethod
    def of(cls, partition: int, row: OutboxRow) -> OutboxRowDetail:
        """The outbox row ``row`` of source partition ``partition``, whole."""
        return cls(
            **_row_fields(partition, row),
            value=row.fields.get(codec.VALUE, b"").decode(errors="replace"),
            headers=codec.decode_headers(row.fields.get(codec.HEADERS)),
            available_at=iso_time(row.available_ms),
            claimed_at=None if row.claimed_ms is None else iso_time(row.claimed_ms),
            claimed_by=row.claimed_by,
        )


def _row_fields(partition: int, row: OutboxRow) -> dict[str, Any]:
    """The fields of ``OutboxRowInfo`` for a row (``OutboxRowDetail`` has them too)."""
    headers = codec.decode_headers(row.fields.get(codec.HEADERS))
    source_topic, source_id = headers.get(SOURCE_TOPIC_HEADER), headers.get(SOURCE_ID_HEADER)
    return {
        "row_id": f"{partition}:{row.id}",
        "state": str(row.state),
        "topic": row.topic,
        "partition": row.partition,
        "key": text_or_none(row.fields.get(codec.KEY)),
        "seq": row.seq,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "created_at": iso_time(row.created_ms),
        "published_at": None if row.published_ms is None else iso_time(row.published_ms),
        "source": f"{source_topic}/{source_id}" if source_topic and source_id else None,
    }


class OutboxReplay(msgspec.Struct, frozen=True, kw_only=True):
    """What ``outbox_replay`` selected, and what the partitions' owners did with it."""

    selected: list[str]
    dry_run: bool
    #: rows the owners put back to PENDING (published again once each)
    replayed: list[str] = msgspec.field(default_factory=list)
    #: partitions whose owner did not apply the request in time (it stays queued)
    waiting: list[int] = msgspec.field(default_factory=list)


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """What ``/health`` says: the server answers, which one it is, and how fast."""

    status: str
    #: the server's own version (Valkey's, not the Redis version it is compatible with)
    redis_version: str
    latency_ms: float
    #: "Valkey" or "Redis", as the server's INFO says
    server: str = "Redis"


class ExportCheckpoints(msgspec.Struct, frozen=True, kw_only=True, tag="checkpoints", tag_field="kind"):
    """An export line: one partition's checkpoints (it comes before the partition's values)."""

    partition: int
    checkpoints: dict[str, str]
    #: whether the partition's bookkeeping follows (``--all``), else its app state only; true in
    #: exports made before the field, which held everything
    internal: bool = True


class ExportValue(msgspec.Struct, frozen=True, kw_only=True, tag="value", tag_field="kind"):
    """An export line: one stored value, exact (``value``) and, for state, readable (``state``).

    A state value that cannot be decoded or shown as JSON has ``state`` null and ``error`` saying
    why (the field is absent otherwise); its ``value`` is exact all the same.
    """

    partition: int
    namespace: str
    key: str
    value: bytes
    state: Any = None
    error: str | msgspec.UnsetType = msgspec.UNSET


class ImportResult(msgspec.Struct, frozen=True, kw_only=True):
    partitions: int
    values: int
    #: bookkeeping values kept from the partitions' backups (an export without ``--all``)
    kept: int = 0


class OpenWindow(msgspec.Struct, frozen=True, kw_only=True):
    """One open window of a key and its accumulator so far (``pspf state get --window``)."""

    #: the window's name (``@app.window``'s ``name=``, by default its function's name); null for
    #: state written before windows had names, which a worker adopts when it loads it
    window: str | None
    topic: str
    start: int
    end: int
    value: Any


class AppRemoval(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf app delete`` removed from the server (or, with ``dry_run``, would remove)."""

    app: str
    topics: list[str]
    partitions: int
    #: streams whose consumer group of the app was destroyed
    groups: list[str]
    #: keys deleted: leases, fences, state backups and their logs, members, outbox replays, record
    keys: list[str]
    dry_run: bool
    #: the re-keying topics its streams created (``group_by``), deleted with it
    managed_topics: list[str] = []


class AppReset(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf app reset`` did (or, with ``dry_run``, would do)."""

    app: str
    #: "start" or "end": where the app's groups now stand in its topics
    to: str
    topics: list[str]
    #: table topics read again from their first entry (their rows were deleted with the state)
    tables_rebuilt: list[str]
    partitions: int
    #: entries the app will handle when it runs next (from the start; a rebuilt table's)
    entries_to_process: int
    #: entries the app had not handled yet that it now never will (moved to the end)
    entries_skipped: int
    #: entries a redriven copy replaces: skipped, and the copy applied, as in the first run
    superseded: int = 0
    state_reset: bool
    #: partitions whose store in this state dir was reset too (the others restore from the backup)
    stores_here: list[int]
    dry_run: bool


class TopicRemoval(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf topic delete`` removed (or, with ``dry_run``, would remove)."""

    topic: str
    partitions: int
    #: keys deleted: the partitions' streams, DLQs and producer records, the topic's record
    keys: list[str]
    dry_run: bool


class RepartitionResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf topic repartition`` did (or, with ``dry_run``, would do)."""

    topic: str
    #: the topics that move together: read by a common app
    topics: list[str]
    apps: list[str]
    partitions_before: int
    partitions_after: int
    #: entries moved to their key's new partition (all of the topics' entries)
    entries: int
    #: app -> entries it will handle (those it had not handled before)
    to_handle: dict[str, int]
    #: app -> its state keys in each new partition
    state_keys: dict[str, list[int]]
    #: the step a ``--resume`` took up, or None
    resumed: str | None = None
    dry_run: bool
    seconds: float
    #: the repartition under way was undone (``--abort``): the topics are as they were
    aborted: bool = False
