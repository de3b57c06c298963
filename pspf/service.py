"""Operations the CLI, the admin API and its web page share, written once, returning msgspec records."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from pspf import codec, keys, retention
from pspf.backup import field, snapshot, split_field
from pspf.broker import Broker
from pspf.emit import SOURCE_ID_HEADER, SOURCE_TOPIC_HEADER
from pspf.errors import (
    AppRunning,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    DecodeError,
    NotFound,
    ParameterError,
    StateError,
    StateValueError,
)
from pspf.failures import DeadLetter
from pspf.keys import (
    BACKUP_IDENTITY,
    BACKUP_NAMESPACE,
    DEAD_NAMESPACE,
    FAILURES_NAMESPACE,
    FOREIGN_NAMESPACE,
    ORIGINAL_ID_HEADER,
    REDRIVE_APP_HEADER,
    REDRIVE_COUNT_HEADER,
    STATE_NAMESPACE,
    SUPERSEDED_NAMESPACE,
    StreamId,
)
from pspf.membership import live_members
from pspf.outbox import OutboxRow, RowState, rows_in_backup, rows_in_store
from pspf.ownership import check_partition_count
from pspf.producer import Producer
from pspf.retention import PartitionTrim, Retention
from pspf.settings import Settings
from pspf.state_stores import StateStore, StoreTransaction, missing_state, open_store, stored_partitions
from pspf.wording import counted

_json_any = msgspec.json.Decoder()


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    consumers: int
    pending: int
    last_delivered_id: str


class PartitionInfo(msgspec.Struct, frozen=True, kw_only=True):
    partition: int
    stream: str
    length: int
    last_id: str | None
    groups: list[GroupInfo]


class TopicInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    partitions: int


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
    #: why the figures are missing (``groups`` lists an app it cannot read, e.g. a key of the
    #: wrong type, instead of failing for every app)
    error: str | None = None


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


class OutboxRowDetail(OutboxRowInfo, frozen=True, kw_only=True):
    """One outbox row whole: also its value, headers and claim."""

    value: str
    headers: dict[str, str]
    available_at: str
    claimed_at: str | None
    claimed_by: str | None


class OutboxReplay(msgspec.Struct, frozen=True, kw_only=True):
    """What ``outbox_replay`` selected, and what the partitions' owners did with it."""

    selected: list[str]
    dry_run: bool
    #: rows the owners put back to PENDING (published again once each)
    replayed: list[str] = msgspec.field(default_factory=list)
    #: partitions whose owner did not apply the request in time (it stays queued)
    waiting: list[int] = msgspec.field(default_factory=list)


class Health(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    redis_version: str
    latency_ms: float


class ExportCheckpoints(msgspec.Struct, frozen=True, kw_only=True, tag="checkpoints", tag_field="kind"):
    """An export line: one partition's checkpoints (it comes before the partition's values)."""

    partition: int
    checkpoints: dict[str, str]


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


_export_encoder = msgspec.json.Encoder()
_export_decoder: msgspec.json.Decoder[ExportCheckpoints | ExportValue] = msgspec.json.Decoder(
    ExportCheckpoints | ExportValue
)


def _stream_entries(
    broker: Broker, stream: str, after: StreamId | None = None, page_size: int = 500
) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of one stream (a DLQ, or a partition's), after ``after``, in id order.

    ``Broker.dlq_range`` is a plain XRANGE, read ``page_size`` entries at a time.
    """
    start = "-" if after is None or after == keys.ZERO_ID else str(after.next())
    while True:
        page = broker.dlq_range(stream, start, "+", page_size)
        yield from page
        if len(page) < page_size:
            return
        start = str(StreamId.parse(page[-1][0]).next())


class DeadLetterCounts:
    """DLQ entries per app of each topic partition, each DLQ read once (it is shared by apps)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._counts: dict[tuple[str, int], Counter[str]] = {}

    def of(self, topic: str, partition: int, app: str) -> int:
        counts = self._counts.get((topic, partition))
        if counts is None:
            counts = self._counts[(topic, partition)] = self._read(keys.dlq_key(topic, partition))
        return counts[app]

    def _read(self, dlq: str) -> Counter[str]:
        return Counter(fields.get(b"app", b"").decode() for _, fields in _stream_entries(self.broker, dlq))


class Service:
    """Topic, produce and state operations over one broker and one state directory."""

    def __init__(self, settings: Settings, local_state: bool = False) -> None:
        self.settings = settings
        #: Read state from the stores under the state directory, not from the backups in Redis.
        self.local_state = local_state
        # Connects on first use; one pool, shared by the admin API's request threads.
        self.broker = Broker(settings.redis)

    def close(self) -> None:
        self.broker.close()

    # -- topics ---------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> tuple[TopicInfo, bool]:
        """Create a topic; also returns False when it already existed with that partition count."""
        keys.check_name("topic", name)
        if not 1 <= partitions <= keys.MAX_PARTITIONS:
            raise ConfigError(f"partitions must be between 1 and {keys.MAX_PARTITIONS}")
        created = self.broker.create_topic(name, partitions)
        return TopicInfo(name=name, partitions=partitions), created

    def list_topics(self) -> list[TopicInfo]:
        return [
            TopicInfo(name=name, partitions=self.broker.topic_partitions(name))
            for name in self.broker.list_topics()
        ]

    def _partitions(self, topic: str) -> int:
        """The partition count of a topic named by a user: a malformed name is their mistake."""
        return self.broker.topic_partitions(keys.check_name("topic", topic))

    def describe_topic(self, name: str) -> TopicDescription:
        count = self._partitions(name)
        partitions = []
        for partition in range(count):
            stream = keys.stream_key(name, partition)
            info = self.broker.stream_info(stream)
            partitions.append(
                PartitionInfo(
                    partition=partition,
                    stream=stream,
                    length=info.length,
                    last_id=info.last_id.decode() if info.last_id else None,
                    groups=[
                        GroupInfo(
                            name=name,
                            consumers=g.consumers,
                            pending=g.pending,
                            last_delivered_id=g.last_delivered_id.decode(),
                        )
                        for name, g in info.groups.items()
                    ],
                )
            )
        kept = retention.stored(self.broker, name)
        return TopicDescription(
            name=name,
            partitions=partitions,
            length=sum(p.length for p in partitions),
            retention=kept,
            trims=retention.plan(self.broker, name, range(count), kept),
        )

    def set_retention(self, name: str, wanted: Retention) -> Retention:
        """Store a topic's retention (running workers apply it at their next trim pass)."""
        self._partitions(name)
        retention.store(self.broker, name, wanted)
        return retention.stored(self.broker, name)

    def trim_topic(self, name: str, dry_run: bool = False, override: Retention | None = None) -> TopicTrim:
        """Trim a topic's partitions by its retention (or ``override``), never past what is needed."""
        count = self._partitions(name)
        applied = override if override is not None else retention.stored(self.broker, name)
        if not applied.active:
            raise ConfigError(
                f"topic {name!r} has no retention: set one (pspf topic retention {name} --max-age 7d) "
                "or give --max-age / --max-len"
            )
        plans = retention.plan(self.broker, name, range(count), applied, count=dry_run)
        if not dry_run:
            plans = retention.trim(self.broker, plans)
        removed = 0 if dry_run else sum(p.removable for p in plans)
        return TopicTrim(name=name, retention=applied, dry_run=dry_run, partitions=plans, removed=removed)

    # -- producing ------------------------------------------------------------------------------

    def produce_lines(self, topic: str, lines: Iterable[bytes], key_field: str | None = None) -> int:
        """Write NDJSON lines as entries (the line is the value); the number written.

        Each line must be JSON; with ``key_field`` it must be an object whose field is the key.
        A bad line stops the run with its line number; the lines before it are written.
        """
        with Producer(self.broker, batch_size=2000) as producer:
            producer.broker.topic_partitions(topic)
            for number, raw in enumerate(lines, start=1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    key = _line_key(line, key_field)
                except ConfigError as exc:
                    producer.flush()
                    raise ConfigError(
                        f"line {number}: {exc} ({counted(producer.sent, 'entry')} written before it)"
                    ) from None
                producer.send_raw(topic, line, key)
        return producer.sent

    def produce(self, topic: str, value: bytes, key: str | None = None) -> None:
        """Write one JSON value."""
        _line_key(value, None)
        with Producer(self.broker) as producer:
            producer.send_raw(topic, value, key)

    # -- DLQ ------------------------------------------------------------------------------------

    def _dead_letters(self, topic: str) -> Iterator[tuple[int, bytes, DeadLetter]]:
        """Every DLQ entry of ``topic``, partition by partition, in id order."""
        for partition in range(self._partitions(topic)):
            for entry_id, fields in _stream_entries(self.broker, keys.dlq_key(topic, partition)):
                yield partition, entry_id, DeadLetter.from_fields(fields)

    def dlq_list(
        self, topic: str, app: str | None = None, error_type: str | None = None, limit: int | None = None
    ) -> list[DeadLetterInfo]:
        """DLQ entries of ``topic``, optionally of one app or error type, at most ``limit``."""
        found = []
        for partition, entry_id, record in self._dead_letters(topic):
            if (app and record.app != app) or (error_type and record.error_type != error_type):
                continue
            found.append(
                DeadLetterInfo(
                    dlq_id=f"{partition}:{entry_id.decode()}",
                    partition=partition,
                    source_id=record.source_id,
                    key=record.key,
                    app=record.app,
                    error_type=record.error_type,
                    message=record.message,
                    attempts=record.attempts,
                    failed_at=_iso(record.last_failed_ms),
                )
            )
            if limit is not None and len(found) >= limit:
                break
        return found

    def dlq_show(self, topic: str, dlq_id: str) -> DeadLetterDetail:
        partition, entry_id = parse_dlq_id(dlq_id)
        if partition >= self._partitions(topic):
            raise NotFound(f"topic {topic!r} has no partition {partition}")
        page = self.broker.dlq_range(keys.dlq_key(topic, partition), entry_id.decode(), entry_id.decode(), 1)
        if not page:
            raise NotFound(f"no DLQ entry {dlq_id} in topic {topic!r}")
        record = DeadLetter.from_fields(page[0][1])
        original = record.original
        try:
            value: Any = codec.ValueDecoder().decode(original)
        except DecodeError:
            value = None
        try:
            headers = codec.decode_headers(original.get(codec.HEADERS))
        except DecodeError:
            headers = {}
        return DeadLetterDetail(
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
            first_failed_at=_iso(record.first_failed_ms),
            last_failed_at=_iso(record.last_failed_ms),
        )

    def _select(
        self,
        topic: str,
        ids: Sequence[str],
        all_entries: bool,
        error_type: str | None,
        app: str | None,
        older_than_ms: int | None,
        offered: Sequence[str],
    ) -> list[tuple[int, bytes, DeadLetter]]:
        """The DLQ entries ``ids`` name, or those of a selection; ``offered`` names its parameters."""
        if ids and (all_entries or error_type or older_than_ms is not None):
            raise ParameterError(f"give {{ids}} or a selection ({_alternatives(offered)}), not both")
        if not ids and not (all_entries or error_type or app or older_than_ms is not None):
            raise ParameterError(f"nothing selected: give {_alternatives(['ids', *offered])}")
        if ids:
            wanted = {parse_dlq_id(i) for i in ids}
            selected = [(p, e, r) for p, e, r in self._dead_letters(topic) if (p, e) in wanted]
            missing = wanted - {(p, e) for p, e, _ in selected}
            if missing:
                names = ", ".join(sorted(f"{p}:{e.decode()}" for p, e in missing))
                raise NotFound(f"no DLQ entry {names} in topic {topic!r}")
            return selected
        cutoff = None if older_than_ms is None else int(time.time() * 1000) - older_than_ms
        return [
            (p, e, r)
            for p, e, r in self._dead_letters(topic)
            if (not error_type or r.error_type == error_type)
            and (not app or r.app == app)
            and (cutoff is None or r.last_failed_ms < cutoff)
        ]

    def dlq_redrive(
        self,
        topic: str,
        ids: Sequence[str] = (),
        all_entries: bool = False,
        error_type: str | None = None,
        app: str | None = None,
        limit: int | None = None,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> DlqChange:
        """Put selected DLQ entries back into their source partitions (DEAD -> PENDING).

        Each entry moves in one atomic call (added to its partition, removed from the DLQ), so a
        redrive run twice, or killed and run again, moves each entry once. The entry keeps its
        key, value and headers and gains headers with its redrive count, its original id and the
        app that dead-lettered it (only that app runs it again).
        """
        offered = ["all", "error_type", "app"]
        selected = self._select(topic, ids, all_entries, error_type, app, None, offered)[:limit]
        moved = 0
        for partition, entry_id, record in selected:
            if not dry_run:
                fields = _redrive_fields(record)
                stream = keys.stream_key(topic, partition)
                if self.broker.redrive(keys.dlq_key(topic, partition), stream, entry_id, fields) is not None:
                    moved += 1
            if progress is not None:
                progress(1)
        return DlqChange(selected=len(selected), changed=moved, dry_run=dry_run)

    def dlq_purge(
        self,
        topic: str,
        ids: Sequence[str] = (),
        all_entries: bool = False,
        older_than_ms: int | None = None,
        dry_run: bool = False,
    ) -> DlqChange:
        """Delete selected DLQ entries for good."""
        selected = self._select(topic, ids, all_entries, None, None, older_than_ms, ["all", "older_than"])
        deleted = 0
        if not dry_run:
            by_partition: dict[int, list[bytes]] = {}
            for partition, entry_id, _ in selected:
                by_partition.setdefault(partition, []).append(entry_id)
            for partition, entry_ids in by_partition.items():
                deleted += self.broker.dlq_delete(keys.dlq_key(topic, partition), entry_ids)
        return DlqChange(selected=len(selected), changed=deleted, dry_run=dry_run)

    # -- apps: lag, groups, replay --------------------------------------------------------------

    def health(self) -> Health:
        """Whether Redis answers, and how fast."""
        started = time.perf_counter()
        version = self.broker.check_server().version
        return Health(status="ok", redis_version=version, latency_ms=(time.perf_counter() - started) * 1000)

    def apps(self) -> list[str]:
        """The apps that have run against this broker."""
        return self.broker.list_apps()

    def lag(self, app: str, dead_letters: DeadLetterCounts | None = None) -> AppLag:
        """Per topic partition of ``app``: newest id, checkpoint, lag, pending, owner, DLQ entries.

        ``dead_letters`` shares the DLQ counts between the apps of one ``groups`` call.
        """
        keys.check_name("app", app)
        counts = dead_letters if dead_letters is not None else DeadLetterCounts(self.broker)
        partitions = self.broker.app_partitions(app)
        topics = sorted(self.broker.app_topics(app))
        checkpoints = self._checkpoints(app, partitions)
        owners = self.broker.lease_holders(
            [keys.lease_key(t, p, app) for t in topics for p in range(partitions)]
        )
        now_ms = time.time() * 1000
        detail = []
        for index, (topic, partition) in enumerate((t, p) for t in topics for p in range(partitions)):
            position = self.broker.group_position(keys.stream_key(topic, partition), app)
            oldest = position.oldest_pending_id
            checkpoint = checkpoints.get(partition, {}).get(topic)
            detail.append(
                PartitionLag(
                    topic=topic,
                    partition=partition,
                    last_id=_text_or_none(position.last_id),
                    delivered_id=_text_or_none(position.delivered_id),
                    checkpoint=None if checkpoint is None else str(checkpoint),
                    lag=position.lag,
                    pending=position.pending,
                    oldest_pending_age_s=None
                    if oldest is None
                    else max(0.0, (now_ms - StreamId.parse(oldest).ms) / 1000),
                    owner=owners[index],
                    dead_letters=counts.of(topic, partition, app),
                )
            )
        ages = [d.oldest_pending_age_s for d in detail if d.oldest_pending_age_s is not None]
        return AppLag(
            app=app,
            topics=topics,
            partitions=partitions,
            lag=sum(d.lag for d in detail),
            pending=sum(d.pending for d in detail),
            oldest_pending_age_s=max(ages) if ages else None,
            owners=sorted({d.owner for d in detail if d.owner is not None}),
            dead_letters=sum(d.dead_letters for d in detail),
            detail=detail,
            members=[
                AppMember(
                    id=m.id,
                    consumer=m.consumer,
                    host=m.host,
                    pid=m.pid,
                    since=_iso(m.joined_ms),
                    last_heartbeat=_iso(m.last_heartbeat_ms),
                    partitions=sorted({d.partition for d in detail if d.owner == m.id}),
                )
                for m in sorted(live_members(self.broker, app), key=lambda m: (m.joined_ms, m.id))
            ],
        )

    def groups(self) -> list[AppLag]:
        """Every app that has run against this broker, with its lag."""
        counts = DeadLetterCounts(self.broker)
        found = []
        for app in self.apps():
            try:
                found.append(self.lag(app, counts))
            except BrokerUnavailable:
                raise
            except (BrokerError, NotFound, StateError) as exc:
                found.append(
                    AppLag(
                        app=app,
                        topics=sorted(self.broker.app_topics(app)),
                        partitions=0,
                        lag=0,
                        pending=0,
                        oldest_pending_age_s=None,
                        owners=[],
                        dead_letters=0,
                        detail=[],
                        error=str(exc),
                    )
                )
        return found

    def replay(
        self,
        app: str,
        topics: Sequence[str],
        position: StreamId,
        keep_state: bool = False,
        dry_run: bool = False,
    ) -> ReplayResult:
        """Deliver the entries of ``topics`` after ``position`` to ``app`` again.

        The app must be stopped. The group moves first (re-created at ``position``, with an
        empty pending list); then each partition's store is rewound in one write: checkpoints to
        ``position``, retry bookkeeping dropped, and the state cleared unless ``keep_state``. A
        crash in between leaves the old state with its old checkpoints, which skip the
        re-delivered entries: nothing is applied twice, and running replay again completes it.

        The same write marks the replayed entries that a redrive for ``app`` replaced with a copy
        that is replayed too (each link of a chain of redrives but the last): the app skips them
        and applies the copy, as the first run did, even if the original now succeeds. With
        ``keep_state`` too: the state already holds each entry's effect once, through its copy,
        and the replay applies it once more the same way, never once per copy.
        """
        keys.check_name("app", app)
        partitions = self.broker.app_partitions(app)
        read = sorted(self.broker.app_topics(app))
        chosen = self._replay_topics(app, read, topics, keep_state)
        self._refuse_if_running(app, read, partitions)
        self._refuse_moving_forward(app, chosen, partitions, position)
        state = self.settings.state
        self._need_state_dir(app, "replay resets the app's checkpoints there")
        stores: dict[int, StateStore] = {}
        try:
            for partition in stored_partitions(state.engine, state.dir, app):  # locks them: a worker
                stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)
            self._refuse_if_running(app, read, partitions)  # starting now waits for us
            marks = self._superseded(app, chosen, partitions, position)
            streams = [keys.stream_key(t, p) for t in chosen for p in range(partitions)]
            if not dry_run:
                for partition in sorted(set(marks) - set(stores)):  # the marks need a store
                    stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)
                for stream in streams:
                    self.broker.reset_group(stream, app, str(position))
                self._rewind(app, stores, chosen, partitions, position, marks, keep_state)
            entries = sum(self._entries_after(stream, position) for stream in streams)
        finally:
            for store in stores.values():
                store.close()
        return ReplayResult(
            app=app,
            topics=chosen,
            position=str(position),
            partitions=partitions,
            entries_to_replay=entries,
            superseded=sum(len(found) for found in marks.values()),
            state_reset=not keep_state,
            dry_run=dry_run,
        )

    def _need_state_dir(self, app: str, why: str) -> None:
        state = self.settings.state
        if not (Path(state.dir) / app).is_dir():
            raise NotFound(
                f"no state of app {app!r} under {state.dir}: {why}, "
                "give the app's state directory (--state-dir)"
            )

    def _rewind(
        self,
        app: str,
        stores: dict[int, StateStore],
        topics: list[str],
        partitions: int,
        position: StreamId,
        marks: dict[int, dict[tuple[str, str], bytes]],
        keep_state: bool,
    ) -> None:
        """Rewind the stores here, then the backups, to ``position`` under one new identity."""
        checkpoint = None if position == keys.ZERO_ID else position
        clear = {FAILURES_NAMESPACE, DEAD_NAMESPACE, FOREIGN_NAMESPACE, SUPERSEDED_NAMESPACE}
        clear |= set() if keep_state else {STATE_NAMESPACE}
        identity = f"replay{int(time.time() * 1000)}-0"
        for partition, store in stores.items():
            values = {**marks.get(partition, {}), (BACKUP_NAMESPACE, BACKUP_IDENTITY): identity.encode()}
            store.rewind(clear, {topic: checkpoint for topic in topics}, values)
        self._rewind_backups(app, partitions, clear, {t: checkpoint for t in topics}, marks, identity)

    def _superseded(
        self, app: str, topics: list[str], partitions: int, position: StreamId
    ) -> dict[int, dict[tuple[str, str], bytes]]:
        """Per partition, the marks of the entries after ``position`` that a redrive replaced.

        A redriven copy for ``app`` names the entry it was redriven from (its original id
        header), in the same partition. Both are replayed when the original is after
        ``position``; the copy's id is the mark's value.
        """
        marks: dict[int, dict[tuple[str, str], bytes]] = {}
        for topic in topics:
            for partition in range(partitions):
                stream = keys.stream_key(topic, partition)
                for entry_id, fields in _stream_entries(self.broker, stream, position, page_size=1000):
                    replaced = _redriven_from(fields, app)
                    if replaced is not None and position < replaced < StreamId.parse(entry_id):
                        name = keys.entry_name(topic, str(replaced).encode())
                        marks.setdefault(partition, {})[(SUPERSEDED_NAMESPACE, name)] = entry_id
        return marks

    def _rewind_backups(
        self,
        app: str,
        partitions: int,
        clear: set[str],
        checkpoints: dict[str, StreamId | None],
        marks: dict[int, dict[tuple[str, str], bytes]],
        identity: str,
    ) -> None:
        """Rewind the state backups like the stores, under the identity the stores here got.

        Stores elsewhere then differ from their backup and are restored from it when their
        partition is next taken. A crash before this leaves the old backups, which a takeover
        restores: the old state with its old checkpoints, as when replay stops before the stores.
        """
        first = self.broker.app_topic_list(app)[0]
        for partition in range(partitions):
            values = {field(ns, key): value for (ns, key), value in marks.get(partition, {}).items()}
            self.broker.rewind_backup(
                keys.backup_keys(first, partition, app),
                clear,
                checkpoints,
                values,
                identity,
            )

    @staticmethod
    def _replay_topics(app: str, read: list[str], topics: Sequence[str], keep_state: bool) -> list[str]:
        """The topics to replay; all the app reads unless its state is kept."""
        chosen = sorted(set(topics))
        if not chosen:
            raise ConfigError("give at least one topic to replay")
        unknown = [t for t in chosen if t not in read]
        if unknown:
            raise NotFound(f"app {app!r} does not read topic(s) {unknown}; it reads {read}")
        others = [t for t in read if t not in chosen]
        if others and not keep_state:
            raise ParameterError(
                "app {app!r} also reads {others}, and its state comes from all its topics: replay "
                "them too (name them in {topics}), or keep the state with {keep_state}",
                app=app,
                others=others,
            )
        return chosen

    def _refuse_moving_forward(self, app: str, topics: list[str], partitions: int, to: StreamId) -> None:
        for topic in topics:
            for partition in range(partitions):
                # XINFO GROUPS alone: group_position might also count the lag, not needed here.
                mine = self.broker.stream_info(keys.stream_key(topic, partition)).groups.get(app)
                delivered = None if mine is None else mine.last_delivered_id
                if delivered is not None and to > StreamId.parse(delivered):
                    raise ConfigError(
                        f"{to} is after where app {app!r} stands in {topic!r} partition "
                        f"{partition} ({delivered.decode()}): replay only moves back"
                    )

    def _refuse_if_running(self, app: str, topics: list[str], partitions: int) -> None:
        leases = [keys.lease_key(t, p, app) for t in topics for p in range(partitions)]
        held = self.broker.lease_holders(leases)
        owners = sorted({owner for owner in held if owner is not None})
        if owners:
            raise AppRunning(f"app {app!r} is running ({', '.join(owners)} holds leases): stop it first")

    def _entries_after(self, stream: str, position: StreamId) -> int:
        length = self.broker.stream_info(stream).length
        if position == keys.ZERO_ID or length == 0:
            return length
        return self.broker.count_after(stream, str(position))

    def _checkpoints(self, app: str, partitions: int) -> dict[int, dict[str, StreamId]]:
        """The committed checkpoints of each partition store found here (read without locking)."""
        state = self.settings.state
        found: dict[int, dict[str, StreamId]] = {}
        for partition in stored_partitions(state.engine, state.dir, app):
            if partition < partitions:
                with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                    found[partition] = store.checkpoints()
        return found

    # -- state ----------------------------------------------------------------------------------

    def _no_state(self, app: str) -> str:
        """What was looked for and not found: the backups (unless read locally) and the stores here."""
        state = self.settings.state
        text = missing_state(state.engine, state.dir, app)
        return text if self.local_state else f"no state backup of app {app!r} in Redis, and {text}"

    def _backup_keys(self, app: str, partition: int) -> keys.BackupKeys | None:
        """The keys of a partition's state backup, None when it has none (the backup is off)."""
        first = self.broker.app_topic_list(app)[:1]
        if not first:
            return None
        backup = keys.backup_keys(first[0], partition, app)
        return backup if self.broker.backup_meta(backup.meta).get(BACKUP_IDENTITY) else None

    def state_get(self, app: str, key: str) -> dict[str, Any]:
        """The state of ``key`` in ``app``, from the partition's backup in Redis (any machine).

        Without a backup (it is off), from the partition's store here, read without locking it.
        """
        keys.check_name("app", app)
        partition = keys.partition_for(codec.encode_text("key", key), self.broker.app_partitions(app))
        backup = None if self.local_state else self._backup_keys(app, partition)
        if backup is not None:
            raw = self.broker.backup_value(backup.values, field(STATE_NAMESPACE, key))
        else:
            with open_store(
                self.settings.state.engine, self.settings.state.dir, app, partition, readonly=True
            ) as store:
                raw = store.get(STATE_NAMESPACE, key)
        if raw is None:
            raise NotFound(f"app {app!r} has no state for key {key!r}")
        return _shown_state(key, raw)

    def state_windows(self, app: str, key: str) -> list[dict[str, Any]]:
        """The open windows of ``key`` in ``app``'s window aggregations, oldest first.

        From the partition's backup in Redis, or without one from its store here, as
        ``state_get``; each is ``{"topic", "start", "end", "value"}`` (the accumulator so far).
        """
        keys.check_name("app", app)
        partition = keys.partition_for(codec.encode_text("key", key), self.broker.app_partitions(app))
        backup = None if self.local_state else self._backup_keys(app, partition)
        found: list[tuple[str, bytes]] = []
        if backup is not None:
            pattern = field(keys.WINDOWS_NAMESPACE, "*/" + _glob_escape(key))
            for page in self.broker.backup_values(backup.values, match=pattern):
                found += ((split_field(name)[1], raw) for name, raw in page)
        else:
            with open_store(
                self.settings.state.engine, self.settings.state.dir, app, partition, readonly=True
            ) as store:
                found = list(store.items(keys.WINDOWS_NAMESPACE))
        windows = []
        for name, raw in found:
            topic, kind, window_key, start, end = keys.split_window_key(name)
            if kind == "w" and window_key == key:
                value = msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True)
                windows.append({"topic": topic, "start": start, "end": int(end), "value": value})
        if not windows:
            raise NotFound(f"app {app!r} has no open window for key {key!r}")
        return sorted(windows, key=lambda w: (w["start"], w["end"], w["topic"]))

    def state_export(
        self, app: str, partition: int | None = None, warn: Callable[[str], None] | None = None
    ) -> Iterator[bytes]:
        """NDJSON lines of an app's state: per partition its checkpoints, then every value.

        From the partitions' backups in Redis (any machine) unless the service reads local
        state; a partition without a backup (it is off) from its store here. Each partition is
        one consistent snapshot (a running app keeps committing meanwhile). ``value`` is the
        stored msgpack, base64: exact; ``state`` repeats a state value readably. A state value
        that cannot be shown is exported all the same, with ``error`` instead of ``state``, and
        ``warn`` hears of it: a backup must not stop at a value the app cannot read either.
        """
        keys.check_name("app", app)
        state = self.settings.state
        backups: dict[int, keys.BackupKeys] = {}
        if not self.local_state:
            wanted = range(self._app_partitions(app)) if partition is None else [partition]
            backups = {p: b for p in wanted if (b := self._backup_keys(app, p))}
        stored = stored_partitions(state.engine, state.dir, app)
        partitions = sorted({*backups, *stored}) if partition is None else [partition]
        if not partitions:
            raise NotFound(self._no_state(app))
        for p in partitions:
            if p in backups:
                copy = snapshot(self.broker, backups[p])
                if copy is not None:
                    checkpoints, values = copy
                    sorted_rows = ((ns, key, value) for (ns, key), value in sorted(values.items()))
                    yield from _export_lines(app, p, checkpoints, sorted_rows, warn)
                    continue
            with open_store(state.engine, state.dir, app, p, readonly=True) as store:
                checkpoints, rows = store.dump()
                try:
                    yield from _export_lines(app, p, checkpoints, rows, warn)
                finally:
                    # Ends the snapshot while the store is open, also when the reader stops early
                    # (a closed pipe): closed later, by the garbage collector, it fails.
                    _close(rows)

    def _app_partitions(self, app: str) -> int:
        """The app's partition count, 0 when it never ran against this broker."""
        try:
            return self.broker.app_partitions(app)
        except NotFound:
            return 0

    def state_adopt(
        self, app: str, partitions: Sequence[int] = (), topics: Sequence[str] = ()
    ) -> AdoptResult:
        """Take the stores here as an app's state on a server that lost its groups and backups.

        For each partition with a store here (and each of ``partitions`` without one, which
        starts anew): its consumer groups are created at the store's checkpoints, past which the
        streams' last ids are moved, and the app is recorded with its partition count. The next
        worker uploads each store as the backup. Partitions whose group or backup the server
        still has are left alone: their state is there. The app must be stopped.
        """
        keys.check_name("app", app)
        state = self.settings.state
        local = stored_partitions(state.engine, state.dir, app)
        stores: dict[int, tuple[dict[str, StreamId], int | None]] = {}
        for partition in local:
            with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                built = store.get(keys.BACKUP_NAMESPACE, keys.BACKUP_PARTITIONS)
                stores[partition] = store.checkpoints(), None if built is None else int(built)
        read = sorted(
            {*topics, *self.broker.app_topics(app), *(t for cps, _ in stores.values() for t in cps)}
        )
        if not read:
            raise ParameterError(
                "no store of app {app} under {dir} and no topic named: give the app's topics with {topics}",
                app=repr(app),
                dir=state.dir,
            )
        counts = {topic: self.broker.topic_partitions(topic) for topic in read}
        count = next(iter(counts.values()))
        if len(set(counts.values())) > 1:
            raise ConfigError(f"the topics of app {app!r} must have the same partition count: {counts}")
        for partition, (_, recorded) in stores.items():
            check_partition_count(app, read, recorded, count, f"the store of partition {partition}")
        self._refuse_if_running(app, read, count)
        adopted: dict[int, dict[str, str]] = {}
        kept: list[int] = []
        for partition in sorted({*local, *partitions}):
            if partition >= count:
                raise ParameterError.invalid(
                    "partitions", f"{partition} is not one of the {count} partitions"
                )
            if not self._lost(app, read, partition):
                kept.append(partition)
                continue
            checkpoints = stores.get(partition, ({}, None))[0]
            adopted[partition] = {}
            for topic in read:
                stream, start = keys.stream_key(topic, partition), checkpoints.get(topic)
                self.broker.ensure_group(stream, app, str(start or "0"))  # creates the stream
                last = self.broker.last_id(stream)
                if start is not None and (last is None or StreamId.parse(last) < start):
                    self.broker.move_last_id(stream, str(start))
                self.broker.record_group_start(app, topic, partition, stream)
                adopted[partition][topic] = str(start or "0")
        self.broker.register_app(app, read, count)
        return AdoptResult(app=app, adopted=adopted, kept=kept)

    def _lost(self, app: str, topics: list[str], partition: int) -> bool:
        """Whether the server has neither the partition's groups nor its state backup."""
        if self._backup_keys(app, partition) is not None:
            return False
        return all(app not in self.broker.stream_info(keys.stream_key(t, partition)).groups for t in topics)

    def state_import(self, app: str, lines: Iterable[bytes]) -> ImportResult:
        """Load ``state_export`` lines into an app's stores, which must be empty and not in use."""
        keys.check_name("app", app)
        state = self.settings.state
        partitions = values = 0
        current: tuple[int, StateStore, StoreTransaction] | None = None
        try:
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                line = _parse_export_line(number, raw)
                if current is None or current[0] != line.partition:
                    if current is not None:
                        current[2].commit()
                        current[1].close()
                        current = None
                    store = open_store(
                        state.engine, state.dir, app, line.partition, durability=state.durability
                    )
                    current = (line.partition, store, store.transaction())
                    if store.checkpoints() or _has_values(store):
                        raise ConfigError(
                            f"app {app!r} partition {line.partition} already has state under {state.dir}: "
                            "import into an empty state directory"
                        )
                    partitions += 1
                if isinstance(line, ExportCheckpoints):
                    for topic, entry_id in line.checkpoints.items():
                        current[2].set_checkpoint(topic, StreamId.parse(entry_id))
                else:
                    current[2].set(line.namespace, line.key, line.value)
                    values += 1
            if current is not None:
                current[2].commit()
        finally:
            if current is not None:
                current[1].close()
        # The imported stores are the state now: their backups go, and the next worker to take
        # each partition uploads its store.
        first = self.broker.app_topic_list(app)[:1]
        for topic in first:
            for partition in range(self.broker.app_partitions(app)):
                self.broker.delete_backup(keys.backup_keys(topic, partition, app))
        return ImportResult(partitions=partitions, values=values)

    # -- outbox ---------------------------------------------------------------------------------

    def _outbox_rows(self, app: str, partition: int | None = None) -> Iterator[tuple[int, OutboxRow]]:
        """(partition, row) of an app's outbox rows: from the backups, else from the stores here."""
        keys.check_name("app", app)
        state = self.settings.state
        wanted = range(self._app_partitions(app)) if partition is None else [partition]
        backups = {} if self.local_state else {p: b for p in wanted if (b := self._backup_keys(app, p))}
        stored = [p for p in stored_partitions(state.engine, state.dir, app) if partition in (None, p)]
        partitions = sorted({*backups, *stored})
        if not partitions:
            raise NotFound(f"no outbox of app {app!r} in Redis or under {state.dir}")
        for p in partitions:
            if p in backups:
                pages = self.broker.backup_values(
                    backups[p].values, match=keys.OUTBOX_NAMESPACE.encode() + b"*"
                )
                yield from (
                    (p, row) for row in rows_in_backup((pair for page in pages for pair in page), app, p)
                )
                continue
            with open_store(state.engine, state.dir, app, p, readonly=True) as store:
                found = rows_in_store(store, app, p)
            yield from ((p, row) for row in found)

    def outbox_list(
        self, app: str, row_state: str | None = None, partition: int | None = None, limit: int | None = None
    ) -> list[OutboxRowInfo]:
        """An app's outbox rows (those in ``row_state``), by partition and row number."""
        wanted = None if row_state is None else _row_state(row_state)
        found = []
        for p, row in self._outbox_rows(app, partition):
            if wanted is None or row.state is wanted:
                found.append(_row_info(p, row))
                if limit is not None and len(found) >= limit:
                    break
        return found

    def outbox_show(self, app: str, row_id: str) -> OutboxRowDetail:
        """One outbox row whole (ROW_ID as ``outbox_list`` gives it)."""
        partition, number = parse_row_id(row_id)
        row = self._outbox_row(app, partition, number)
        return OutboxRowDetail(
            **msgspec.structs.asdict(_row_info(partition, row)),
            value=row.fields.get(codec.VALUE, b"").decode(errors="replace"),
            headers=codec.decode_headers(row.fields.get(codec.HEADERS)),
            available_at=_iso(row.available_ms),
            claimed_at=None if row.claimed_ms is None else _iso(row.claimed_ms),
            claimed_by=row.claimed_by,
        )

    def outbox_replay(
        self,
        app: str,
        ids: Sequence[str] = (),
        dead: bool = False,
        all_rows: bool = False,
        limit: int | None = None,
        dry_run: bool = False,
        wait_s: float = 30.0,
    ) -> OutboxReplay:
        """Publish outbox rows again: DEAD or PUBLISHED -> PENDING, under new sequence numbers.

        Select rows by id, every DEAD row, or every DEAD and PUBLISHED row. The partition's
        owner applies the request (its store holds the rows); this waits up to ``wait_s`` for
        it, and a request no worker applied in time stays queued for the next owner.
        """
        if sum(1 for given in (bool(ids), dead, all_rows) if given) != 1:
            raise ParameterError("give exactly one of {ids}, {dead} or {all}")
        replayable = (RowState.PUBLISHED, RowState.DEAD)
        selected: list[tuple[int, int]] = []
        if ids:
            for row_id in ids:
                partition, number = parse_row_id(row_id)
                row = self._outbox_row(app, partition, number)
                if row.state not in replayable:
                    raise ConfigError(
                        f"outbox row {row_id} is {row.state}: only published or dead rows replay"
                    )
                selected.append((partition, number))
        else:
            states = (RowState.DEAD,) if dead else replayable
            selected = [(p, row.id) for p, row in self._outbox_rows(app) if row.state in states]
        selected = selected[:limit] if limit is not None else selected
        names = [f"{p}:{n}" for p, n in selected]
        if dry_run or not selected:
            return OutboxReplay(selected=names, dry_run=dry_run)
        by_partition: dict[int, list[int]] = {}
        for p, n in selected:
            by_partition.setdefault(p, []).append(n)
        for p, numbers in by_partition.items():
            self.broker.request_outbox_replay(app, p, numbers)
        deadline = time.monotonic() + wait_s
        outcomes: dict[int, bytes | None] = {}
        while True:
            outcomes = self.broker.outbox_replay_outcomes(app, sorted(by_partition))
            if all(outcomes.values()) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        replayed = [
            f"{p}:{n}"
            for p, raw in outcomes.items()
            if raw
            for n in _json_any.decode(raw).get("replayed", [])
        ]
        return OutboxReplay(
            selected=names,
            dry_run=False,
            replayed=replayed,
            waiting=[p for p, raw in outcomes.items() if not raw],
        )

    def _outbox_row(self, app: str, partition: int, number: int) -> OutboxRow:
        """One row, from the partition's backup, else from its store here."""
        found = [row for p, row in self._outbox_rows(app, partition) if row.id == number]
        if not found:
            raise NotFound(f"app {app!r} has no outbox row {partition}:{number}")
        return found[0]

    def state_keys(self, app: str, prefix: str = "", limit: int | None = None) -> list[str]:
        """The keys that have state in ``app``, over every partition store found, sorted."""
        keys.check_name("app", app)
        state = self.settings.state
        backups = {}
        if not self.local_state:
            backups = {p: b for p in range(self._app_partitions(app)) if (b := self._backup_keys(app, p))}
        partitions = sorted({*backups, *stored_partitions(state.engine, state.dir, app)})
        if not partitions:
            raise NotFound(self._no_state(app))
        found: list[str] = []
        head = field(STATE_NAMESPACE, prefix)
        for partition in partitions:
            if partition in backups:
                found.extend(
                    name.decode()[len(STATE_NAMESPACE) + 1 :]
                    for page in self.broker.backup_values(backups[partition].values)
                    for name, _ in page
                    if name.startswith(head)
                )
                continue
            with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                found.extend(key for key, _ in store.items(STATE_NAMESPACE, prefix))
        found.sort()
        return found if limit is None else found[:limit]


def parse_row_id(row_id: str) -> tuple[int, int]:
    """``"2:17"`` -> (partition 2, row 17)."""
    partition, sep, number = row_id.partition(":")
    if not (sep and partition.isascii() and partition.isdigit() and number.isascii() and number.isdigit()):
        raise ConfigError(
            f"invalid outbox row id {row_id!r}: expected PARTITION:ROW as `pspf outbox list` prints it"
        )
    return int(partition), int(number)


def _row_info(partition: int, row: OutboxRow) -> OutboxRowInfo:
    headers = codec.decode_headers(row.fields.get(codec.HEADERS))
    source_topic, source_id = headers.get(SOURCE_TOPIC_HEADER), headers.get(SOURCE_ID_HEADER)
    return OutboxRowInfo(
        row_id=f"{partition}:{row.id}",
        state=str(row.state),
        topic=row.topic,
        partition=row.partition,
        key=_text_or_none(row.fields.get(codec.KEY)),
        seq=row.seq,
        attempts=row.attempts,
        last_error=row.last_error,
        created_at=_iso(row.created_ms),
        published_at=None if row.published_ms is None else _iso(row.published_ms),
        source=f"{source_topic}/{source_id}" if source_topic and source_id else None,
    )


def parse_dlq_id(dlq_id: str) -> tuple[int, bytes]:
    """``"2:1700000000000-0"`` -> (partition 2, the DLQ stream's entry id)."""
    partition, sep, entry_id = dlq_id.partition(":")
    if not sep or not partition.isascii() or not partition.isdigit():
        raise ConfigError(f"invalid DLQ id {dlq_id!r}: expected PARTITION:ID as `pspf dlq list` prints it")
    return int(partition), str(StreamId.parse(entry_id)).encode()


def _row_state(text: str) -> RowState:
    try:
        return RowState(text)
    except ValueError:
        raise ParameterError.invalid(
            "state", f"invalid outbox state {text!r}: use {', '.join(RowState)}"
        ) from None


def parse_duration_ms(text: str, param: str) -> int:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"`` or ``"500ms"`` in milliseconds.

    ``param`` names the parameter that gave ``text``, for the error.
    """
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    for unit in ("ms", "s", "m", "h", "d"):
        number = text[: -len(unit)]
        if text.endswith(unit) and number.isdigit():
            return int(number) * units[unit]
    problem = f"invalid duration {text!r}: use a number and ms, s, m, h or d (e.g. 7d)"
    raise ParameterError.invalid(param, problem)


def parse_position(
    from_start: bool = False, to_id: str | None = None, to_time: str | None = None
) -> StreamId:
    """A replay position from exactly one of: the start, an entry id, a time.

    ``to_id`` replays the entries after that id. ``to_time`` (ISO 8601, UTC unless it names an
    offset, or unix milliseconds) replays the entries added at or after that time.
    """
    if sum(1 for given in (from_start, to_id, to_time) if given) != 1:
        raise ParameterError("give exactly one of {from_start}, {to_id} or {to_time}")
    if from_start:
        return keys.ZERO_ID
    if to_id is not None:
        try:
            return StreamId.parse(to_id)
        except ConfigError as exc:
            raise ParameterError.invalid("to_id", str(exc)) from None
    assert to_time is not None
    if to_time.isdigit():
        ms = int(to_time)
    else:
        try:
            moment = datetime.fromisoformat(to_time)
        except ValueError:
            problem = f"invalid time {to_time!r}: use ISO 8601 (2026-11-21T10:00:00Z) or unix milliseconds"
            raise ParameterError.invalid("to_time", problem) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        ms = int(moment.timestamp() * 1000)
    return keys.ZERO_ID if ms <= 0 else StreamId(ms - 1, keys.MAX_SEQ)


def _alternatives(params: Sequence[str]) -> str:
    """``{a}, {b} or {c}``: a ``ParameterError`` template naming each of ``params``."""
    named = [f"{{{p}}}" for p in params]
    return f"{', '.join(named[:-1])} or {named[-1]}" if len(named) > 1 else "".join(named)


def _text_or_none(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode()


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def _redrive_fields(record: DeadLetter) -> dict[bytes, bytes]:
    fields = dict(record.original)
    try:
        headers = codec.decode_headers(fields.get(codec.HEADERS))
    except DecodeError:
        headers = {}
    count = headers.get(REDRIVE_COUNT_HEADER, "0")
    headers[REDRIVE_COUNT_HEADER] = str((int(count) if count.isdigit() else 0) + 1)
    headers[ORIGINAL_ID_HEADER] = record.source_id
    headers[REDRIVE_APP_HEADER] = record.app
    fields[codec.HEADERS] = codec.json_encoder.encode(headers)
    return fields


def _redriven_from(fields: dict[bytes, bytes], app: str) -> StreamId | None:
    """The id an entry was redriven from, when a redrive for ``app`` added it; else None."""
    raw = fields.get(codec.HEADERS)
    if raw is None or REDRIVE_APP_HEADER.encode() not in raw:
        return None
    try:
        headers = codec.decode_headers(raw)
        if headers.get(REDRIVE_APP_HEADER) != app:
            return None
        return StreamId.parse(headers.get(ORIGINAL_ID_HEADER, ""))
    except (DecodeError, ConfigError):
        return None  # headers a producer wrote by hand: not a redrive's


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern (HSCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _shown_state(key: str, raw: bytes) -> dict[str, Any]:
    """A stored state value as JSON shows it; StateValueError when it cannot be decoded or shown.

    Such a value can predate the check when a handler writes it, or be written by hand.
    """
    try:
        value = codec.state_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise StateValueError(f"stored state of key {key!r} cannot be decoded: {exc}") from None
    try:
        shown: dict[str, Any] = msgspec.to_builtins(value, str_keys=True)
    except (TypeError, RecursionError) as exc:
        raise StateValueError(f"stored state of key {key!r} cannot be shown as JSON: {exc}") from None
    return shown


def _has_values(store: StateStore) -> bool:
    rows = store.dump()[1]
    try:
        return next(rows, None) is not None
    finally:
        _close(rows)


def _close(rows: Iterator[Any]) -> None:
    """End a store snapshot's rows (``StateStore.dump``) before the store closes."""
    if isinstance(rows, Generator):
        rows.close()


def _export_lines(
    app: str,
    partition: int,
    checkpoints: dict[str, StreamId],
    rows: Iterator[tuple[str, str, bytes]],
    warn: Callable[[str], None] | None,
) -> Iterator[bytes]:
    """The export lines of one store snapshot (see ``Service.state_export``)."""
    yield _export_encoder.encode(
        ExportCheckpoints(partition=partition, checkpoints={t: str(c) for t, c in checkpoints.items()})
    )
    for namespace, key, value in rows:
        if namespace == keys.BACKUP_NAMESPACE:
            continue  # which backup this store matches: meaningless in another store
        line = ExportValue(partition=partition, namespace=namespace, key=key, value=value)
        if namespace == STATE_NAMESPACE:
            try:
                line = msgspec.structs.replace(line, state=_shown_state(key, value))
            except StateValueError as exc:
                line = msgspec.structs.replace(line, error=str(exc))
                if warn is not None:
                    warn(f"app {app!r} partition {partition}: {exc}; exported exactly, with state null")
        yield _export_encoder.encode(line)


def _parse_export_line(number: int, raw: bytes) -> ExportCheckpoints | ExportValue:
    try:
        return _export_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"line {number}: not a `pspf state export` line: {exc}") from None


def _line_key(line: bytes, key_field: str | None) -> str | None:
    """Check that ``line`` is JSON and pick its key field, if asked."""
    try:
        record = _json_any.decode(line)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"invalid JSON: not valid UTF-8 ({exc.reason})") from None
    if key_field is None:
        return None
    if not isinstance(record, dict):
        raise ConfigError(f"expected a JSON object with field {key_field!r}")
    key = record.get(key_field)
    if key is None:
        raise ConfigError(f"no field {key_field!r}")
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise ConfigError(f"field {key_field!r} must be a string or an integer")
