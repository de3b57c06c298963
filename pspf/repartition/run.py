"""Repartitioning: a topic, and the topics read with it, to a new partition count, with every app's state.

The design is in ``docs/concepts/repartitioning.md``. In short: with every app of the
topics stopped, every entry moves to its key's new partition (ids kept, old streams merged by id,
a ``pspf-moved-from`` header naming the old partition), each app's new groups start at the first
entry it has not handled, and its state backups are split or merged by key
(``pspf.repartition.state``), with the old partitions' checkpoints (``__moved``) so that it skips
the moved entries it handled. Everything is built into staged keys beside the live ones (same
slots), then swapped in (``switch``), a step recorded before it starts so a resumed run finishes
it; before it, the topic is as it was.
"""

from __future__ import annotations

import heapq
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from pspf import codec, keys
from pspf.broker import Broker, Fields
from pspf.errors import AppRunning, ConfigError, StateOutOfReach
from pspf.keys import StreamId
from pspf.ownership.membership import live_members
from pspf.repartition.state import GONE, Gone, checkpoints_of, key_of, split, spread
from pspf.state_stores.base import field as store_field
from pspf.state_stores.base import split_field

log = logging.getLogger("pspf.repartition")

#: Suffix of the staged copy of a key, in the key's own slot.
STAGED = ":next"
#: Entries read from an old stream per round trip.
PAGE = 2000


class Plan(msgspec.Struct, kw_only=True):
    """A repartition, as recorded in the server while it runs."""

    topic: str
    topics: list[str]
    apps: list[str]
    old: int
    new: int
    step: str = "planned"
    started_ms: int = 0
    #: topic -> the layout generation it switches to (producers write only in their own)
    layouts: dict[str, str] = {}


def plan_key(topic: str) -> str:
    return f"{keys.PREFIX}:repartition:{{{topic}}}"


def closure(broker: Broker, topic: str) -> tuple[list[str], list[str]]:
    """The topics that move with ``topic`` (read by a common app, transitively) and their apps."""
    readers: dict[str, list[str]] = {}
    for app in broker.apps.list_apps():
        for read in broker.apps.app_topic_list(app):
            readers.setdefault(read, []).append(app)
    topics, apps, todo = {topic}, set(), [topic]
    while todo:
        for app in readers.get(todo.pop(), []):
            if app not in apps:
                apps.add(app)
                for other in broker.apps.app_topic_list(app):
                    if other not in topics:
                        topics.add(other)
                        todo.append(other)
    return sorted(topics), sorted(apps)


def make_plan(broker: Broker, topic: str, new: int) -> Plan:
    """Check that ``topic`` can move to ``new`` partitions now; the plan (not recorded yet)."""
    keys.check_name("topic", topic)
    if not 1 <= new <= keys.MAX_PARTITIONS:
        raise ConfigError(f"partitions must be 1 to {keys.MAX_PARTITIONS}, not {new}")
    old = broker.topics.topic_partitions(topic)
    if new == old:
        raise ConfigError(f"topic {topic!r} has {old} partitions already")
    topics, apps = closure(broker, topic)
    for other in topics:
        if broker.topics.topic_partitions(other) != old:
            raise ConfigError(f"topic {other!r}, read with {topic!r}, does not have {old} partitions")
    layouts = {t: str(int(broker.topics.topic_layout(t)[1]) + 1) for t in topics}
    started = int(time.time() * 1000)
    plan = Plan(topic=topic, topics=topics, apps=apps, old=old, new=new, started_ms=started, layouts=layouts)
    check_stopped(broker, plan)
    for app in apps:
        _refuse_unmovable(broker, app, old)
    return plan


def refuse_running(broker: Broker, app: str, topics: list[str], count: int) -> None:
    """Refuse (``AppRunning``) while the app has a live member or a worker holds a lease."""
    members = sorted(m.consumer for m in live_members(broker.leases, app))
    held = broker.leases.lease_holders([keys.lease_key(t, p, app) for t in topics for p in range(count)])
    owners = sorted({owner for owner in held if owner is not None})
    if members or owners:
        raise AppRunning(f"app {app!r} is running ({', '.join(members or owners)}): stop it first")


def _refuse_unmovable(broker: Broker, app: str, old: int) -> None:
    """Refuse an app whose state is not all in its backups, or still moving from the last time."""
    first = broker.apps.app_topic_list(app)[0]
    sink = broker.apps.app_sink(app)
    if sink is not None:
        raise StateOutOfReach(
            f"app {app!r} is a sink into {sink}: its checkpoints are there, where a repartition cannot "
            f"move them. Stop the topics' producers; let the sink deliver everything (pspf lag {app}: "
            f"0) and stop it; pspf app delete {app} --yes; repartition; pspf sink reset {app} --dsn DSN "
            "--yes; start the sink with --start-from latest, then the producers"
        )
    for partition in range(old):
        backup = keys.backup_keys(first, partition, app)
        if not broker.acks.backup_meta(backup.meta).get(keys.BACKUP_IDENTITY):
            raise StateOutOfReach(
                f"app {app!r} has no state backup of partition {partition}: a repartition moves the "
                "state in the backups (run the app with the state backup on once)"
            )
        if _keyless_state(broker, backup):
            raise ConfigError(
                f"app {app!r} keeps state for keyless entries (partition {partition}): that state "
                "belongs to a partition, not to a key, so it cannot be split or merged; give the "
                "entries keys (or delete the app's state: pspf app reset) before repartitioning"
            )
        moving = next(
            broker.acks.backup_values(backup, count=100, match=keys.MOVED_NAMESPACE.encode() + b"*"),
            [],
        )
        if moving:
            raise ConfigError(
                f"app {app!r} has not yet handled the entries the last repartition moved: run it "
                "(pspf run ... --until-idle) before repartitioning again"
            )


#: Backup fields that can hold state of the empty key: (HSCAN pattern, namespace).
_KEYLESS = [
    (keys.STATE_NAMESPACE.encode() + b"\x00", keys.STATE_NAMESPACE),
    (keys.EXPIRY_NAMESPACE.encode() + b"\x00", keys.EXPIRY_NAMESPACE),
    (keys.WINDOWS_NAMESPACE.encode() + b"\x00*/", keys.WINDOWS_NAMESPACE),
    (keys.SCHEDULES_NAMESPACE.encode() + b"\x00*/", keys.SCHEDULES_NAMESPACE),
]


def _keyless_state(broker: Broker, backup: keys.BackupKeys) -> bool:
    """Whether a backup holds state, a window or a schedule of the empty key (keyless entries)."""
    for pattern, namespace in _KEYLESS:
        for page in broker.acks.backup_values(backup, count=1000, match=pattern):
            if any(key_of(namespace, split_field(name)[1]) == "" for name, _ in page):
                return True
    return False


@dataclass
class AppState:
    """What one app had handled, read from its state backups before anything moves."""

    name: str
    #: the app's first topic: its backups are under that topic's partitions
    first: str
    #: every topic it reads, in its order
    topics: list[str] = field(default_factory=list)
    #: (topic, old partition) -> entries at or below it were handled (checkpoint or group start)
    handled_to: dict[tuple[str, int], StreamId] = field(default_factory=dict)
    #: entry names at or below the checkpoint that still need a handler (parked, dead, foreign)
    exceptions: set[str] = field(default_factory=set)
    #: the old partitions' backup values, page by page
    values: list[list[tuple[bytes, bytes]]] = field(default_factory=list)

    def handled(self, topic: str, partition: int, entry_id: StreamId, name: str) -> bool:
        upto = self.handled_to.get((topic, partition))
        return upto is not None and entry_id <= upto and name not in self.exceptions


_PENDING_WORK = (keys.FAILURES_NAMESPACE, keys.DEAD_NAMESPACE, keys.FOREIGN_NAMESPACE)


def read_app(broker: Broker, app: str, topics: list[str], old: int) -> AppState:
    """The app's positions and backup values over the old partitions."""
    read = broker.apps.app_topic_list(app)
    state = AppState(app, read[0], read)
    for partition in range(old):
        backup = keys.backup_keys(read[0], partition, app)
        meta = broker.acks.backup_meta(backup.meta)
        checkpoints = checkpoints_of(meta)
        pages = [pair for page in broker.acks.backup_values(backup) for pair in page]
        state.values.append(pages)
        for topic in read:
            start = broker.apps.group_start(app, topic, partition)
            upto = max((c for c in (checkpoints.get(topic), start) if c is not None), default=None)
            if upto is not None:
                state.handled_to[(topic, partition)] = upto
        for name, _ in pages:
            namespace, _, key = name.partition(b"\x00")
            if namespace.decode() in _PENDING_WORK:
                state.exceptions.add(key.decode())
    return state


@dataclass
class Moved:
    """What the copy of one topic found: per new partition, its last id and each app's start."""

    last: dict[int, StreamId] = field(default_factory=dict)
    #: (app, new partition) -> the first entry there the app has not handled
    first_unhandled: dict[tuple[str, int], StreamId] = field(default_factory=dict)
    #: app -> how many of the moved entries it has not handled
    unhandled: dict[str, int] = field(default_factory=dict)
    #: entries moved
    count: int = 0
    #: entry name -> its key (for the bookkeeping that names it); renamed ids
    entry_keys: dict[str, bytes | None] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)

    def place(self, partition: int, entry_id: StreamId) -> StreamId:
        """The id an entry gets in its new partition: its own, unless one as high is there already."""
        last = self.last.get(partition)
        placed = entry_id if last is None or entry_id > last else last.next()
        self.last[partition] = placed
        return placed

    def start(self, app: str, partition: int) -> StreamId:
        """Where the app's group starts in a new partition: before the first entry it has not handled."""
        first = self.first_unhandled.get((app, partition))
        return first.previous() if first is not None else self.last.get(partition, keys.ZERO_ID)


def _entries(broker: Broker, stream: str) -> Iterator[tuple[bytes, Fields]]:
    start = "-"
    while True:
        page = broker.requests.dlq_range(stream, start, "+", PAGE)
        yield from page
        if len(page) < PAGE:
            return
        start = "(" + page[-1][0].decode()


def _merged(broker: Broker, topic: str, old: int) -> Iterator[tuple[StreamId, int, bytes, Fields]]:
    """Every entry of the old streams in id order (ties: the lower old partition first)."""
    sources = [_numbered(broker, topic, p) for p in range(old)]
    yield from heapq.merge(*sources, key=lambda e: (e[0], e[1]))


def _numbered(broker: Broker, topic: str, partition: int) -> Iterator[tuple[StreamId, int, bytes, Fields]]:
    for raw_id, fields in _entries(broker, keys.stream_key(topic, partition)):
        yield StreamId.parse(raw_id), partition, raw_id, fields


def _with_headers(fields: Fields, partition: int, original: str | None) -> Fields:
    """The entry's fields with the moved headers added to its own."""
    headers = codec.decode_headers(fields.get(codec.HEADERS))
    headers[keys.MOVED_FROM_HEADER] = str(partition)
    if original is not None:
        headers[keys.MOVED_ID_HEADER] = original
    return {**fields, codec.HEADERS: msgspec.json.encode(headers)}


class _Staging:
    """The staged new streams of a topic, written in chunks; a dry run writes nothing."""

    def __init__(self, broker: Broker, topic: str, count: int, write: bool) -> None:
        self.broker = broker
        self.write = write
        self.streams = {q: keys.stream_key(topic, q) + STAGED for q in range(count)}
        self.buffers: dict[int, list[tuple[str, Fields]]] = {q: [] for q in range(count)}
        if write:  # a resumed copy starts over; every staged stream exists, an empty one too, so
            for stream in self.streams.values():  # the switch knows one gone was renamed in
                broker.moving.empty_stream(stream)

    def add(self, partition: int, entry_id: StreamId, fields: Fields, old: int, original: str | None) -> None:
        """One entry, with the headers that say where it came from."""
        if self.write:
            buffer = self.buffers[partition]
            buffer.append((str(entry_id), _with_headers(fields, old, original)))
            if len(buffer) >= PAGE:
                self.broker.moving.add_with_ids(self.streams[partition], buffer)
                self.buffers[partition] = []

    def finish(self, readers: list[AppState], moved: Moved) -> None:
        """The last chunks, then each app's group at its start in each new stream."""
        if not self.write:
            return
        for q, entries in self.buffers.items():
            if entries:
                self.broker.moving.add_with_ids(self.streams[q], entries)
        for app in readers:
            for q, stream in self.streams.items():
                self.broker.apps.ensure_group(stream, app.name, str(moved.start(app.name, q)))


def copy_topic(
    broker: Broker, plan: Plan, topic: str, apps: list[AppState], wanted: set[str], write: bool = True
) -> Moved:
    """Copy ``topic``'s old streams into the staged new ones; what each app must start at.

    Without ``write`` nothing is written: the counts a dry run shows.
    """
    moved = Moved()
    staging = _Staging(broker, topic, plan.new, write)
    readers = [a for a in apps if topic in broker.apps.app_topics(a.name)]
    for entry_id, partition, raw_id, fields in _merged(broker, topic, plan.old):
        key = fields.get(codec.KEY)
        q = keys.partition_for(key, plan.new) if key is not None else spread(raw_id.decode(), plan.new)
        new_id = moved.place(q, entry_id)
        moved.count += 1
        name = keys.entry_name(topic, raw_id)
        original = None if new_id == entry_id else str(entry_id)
        if original is not None:
            moved.renamed[name] = keys.entry_name(topic, str(new_id).encode())
        if name in wanted:
            moved.entry_keys[name] = key
        for app in readers:
            if not app.handled(topic, partition, entry_id, name):
                moved.unhandled[app.name] = moved.unhandled.get(app.name, 0) + 1
                moved.first_unhandled.setdefault((app.name, q), new_id)
        staging.add(q, new_id, fields, partition, original)
    staging.finish(readers, moved)
    return moved


def copy_dlqs(broker: Broker, plan: Plan, topic: str) -> None:
    """Each DLQ entry into the DLQ of its key's new partition (staged): redrives land there."""
    staged = {q: keys.dlq_key(topic, q) + STAGED for q in range(plan.new)}
    for stream in staged.values():
        broker.moving.empty_stream(stream)
    for partition in range(plan.old):
        batch: dict[int, list[tuple[bytes, Fields]]] = {}
        for dlq_id, fields in _entries(broker, keys.dlq_key(topic, partition)):
            key = fields.get(codec.KEY)
            q = keys.partition_for(key, plan.new) if key is not None else spread(dlq_id.decode(), plan.new)
            batch.setdefault(q, []).append((dlq_id, {**fields, b"source_partition": str(q).encode()}))
        for q, entries in batch.items():
            broker.publishing.add_entries([(staged[q], fields) for _, fields in entries])


def stage_state(broker: Broker, plan: Plan, app: AppState, moved: dict[str, Moved], identity: str) -> None:
    """The app's new backups, staged: its state split by key, its new checkpoints and moved map."""
    parts = split(app.values, plan.new, _entry_keys(moved))
    for q, values in enumerate(parts):
        renamed = {_renamed(name, moved): value for name, value in values.items()}
        meta: dict[bytes | str, bytes | str] = {
            keys.BACKUP_IDENTITY: identity,
            keys.BACKUP_MARKED: "1",
            keys.BACKUP_PARTITIONS: str(plan.new),
        }
        for topic in app.topics:
            found = moved.get(topic)
            if found is None:
                continue
            at = found.start(app.name, q)
            if at != keys.ZERO_ID:
                meta[f"cp:{topic}"] = str(at)
            last = found.last.get(q)
            if last is not None and at < last:  # handled entries may follow the start
                for partition in range(plan.old):
                    upto = app.handled_to.get((topic, partition))
                    if upto is not None:
                        renamed[store_field(keys.MOVED_NAMESPACE, f"{topic}/{partition}")] = str(
                            upto
                        ).encode()
                renamed[store_field(keys.MOVED_NAMESPACE, f"{topic}/until")] = str(last).encode()
        renamed[keys.BACKUP_MARK] = identity.encode()
        backup = keys.backup_keys(app.first, q, app.name)
        broker.moving.replace_hash(backup.values + STAGED, renamed)
        broker.moving.replace_hash(backup.meta + STAGED, meta)


def _entry_keys(moved: dict[str, Moved]) -> Callable[[str, str], bytes | Gone | None]:
    """The key of an entry some bookkeeping names, as the copy saw it (GONE: not in the stream)."""

    def entry_key(topic: str, entry_id: str) -> bytes | Gone | None:
        found = moved.get(topic)
        name = f"{topic}/{entry_id}"
        return found.entry_keys[name] if found is not None and name in found.entry_keys else GONE

    return entry_key


def _named_entries(apps: list[AppState]) -> set[str]:
    """The entries the apps' bookkeeping names (``topic/id``): the copy notes their keys."""
    return {
        key.decode()
        for app in apps
        for page in app.values
        for name, _ in page
        for namespace, _, key in [name.partition(b"\x00")]
        if namespace.decode() in (*_PENDING_WORK, keys.SUPERSEDED_NAMESPACE)
    }


def _renamed(name: bytes, moved: dict[str, Moved]) -> bytes:
    """A bookkeeping field named after an entry whose id changed gets the new id."""
    namespace, _, key = name.partition(b"\x00")
    if namespace.decode() not in (*_PENDING_WORK, keys.SUPERSEDED_NAMESPACE):
        return name
    text = key.decode()
    topic = text.rpartition("/")[0]
    found = moved.get(topic)
    if found is None or text not in found.renamed:
        return name
    return namespace + b"\x00" + found.renamed[text].encode()


def seal(broker: Broker, plan: Plan) -> None:
    """From here producers write nothing into the topics: they wait for the switch (``lua/add.lua``)."""
    for topic in plan.topics:
        broker.moving.set_fields(keys.topic_key(topic), {"moving": "1"})
        for partition in range(plan.old):
            broker.moving.set_value(keys.layout_key(topic, partition), "moving")


def unseal(broker: Broker, plan: Plan) -> None:
    """Undo ``seal`` before anything was copied, and forget the plan: the topics stay as they were."""
    for topic in plan.topics:
        layout = broker.topics.topic_layout(topic)[1]
        for partition in range(plan.old):
            broker.moving.set_value(keys.layout_key(topic, partition), layout)
        broker.moving.delete_fields(keys.topic_key(topic), ["moving"])
    broker.moving.delete_keys([plan_key(topic) for topic in plan.topics])


def swap_in_staged(broker: Broker, backup: keys.BackupKeys) -> None:
    """Put a backup staged as one hash (``STAGED``) in the live one's place; its log goes.

    The live layout's other buckets go first, while the staged hash still exists: once it is
    renamed in, the meta names the new layout. Each step may run again after a crash.
    """
    if broker.moving.exists(backup.values + STAGED):
        broker.moving.delete_keys(broker.acks.backup_layout(backup)[0][1:])
    broker.moving.rename_over(backup.values + STAGED, backup.values)
    broker.moving.rename_over(backup.meta + STAGED, backup.meta)
    broker.moving.delete_keys([backup.log])


def switch(broker: Broker, plan: Plan, crash_at: Callable[[str], None] = lambda step: None) -> None:
    """Swap the staged keys in (idempotent: a resumed switch renames what is left)."""
    for topic in plan.topics:
        for q in range(plan.new):
            broker.moving.set_value(keys.layout_key(topic, q), plan.layouts[topic])
            for live in (keys.stream_key(topic, q), keys.dlq_key(topic, q)):
                broker.moving.rename_over(
                    live + STAGED, live
                )  # a new partition with nothing staged has no key yet
            if q == 0:
                crash_at(f"switched {topic} 0")
        gone = [
            name
            for p in range(plan.new, plan.old)
            for name in (keys.stream_key(topic, p), keys.dlq_key(topic, p))
        ]
        broker.moving.delete_keys(gone)
        # A retired partition keeps its guard at the new generation: a producer that still routes
        # with the old count is refused there too (an absent guard would read as generation "0").
        # It keeps its producers' records too: a relay routing its rows again skips those they
        # say were published (``Relay._published_before``).
        for p in range(plan.new, plan.old):
            broker.moving.set_value(keys.layout_key(topic, p), plan.layouts[topic])
        guards = int(broker.moving.hash_fields(keys.topic_key(topic)).get("guards", "0"))
        broker.moving.set_fields(keys.topic_key(topic), {"guards": str(max(guards, plan.old))})
    for app in plan.apps:
        read = broker.apps.app_topic_list(app)
        for q in range(plan.new):
            swap_in_staged(broker, keys.backup_keys(read[0], q, app))
        old_only = [
            name
            for p in range(plan.new, plan.old)
            for name in (
                *broker.acks.backup_keys(keys.backup_keys(read[0], p, app)),
                *(keys.lease_key(t, p, app) for t in read),
                *(keys.fence_key(t, p, app) for t in read),
            )
        ]
        broker.moving.delete_keys(old_only)
        record = keys.app_key(app)
        starts = [name for name in broker.moving.hash_fields(record) if name.startswith("start:")]
        broker.moving.delete_fields(record, starts)
        broker.moving.set_fields(record, {"partitions": str(plan.new)})
    for topic in plan.topics:  # producers waiting read the new count and layout from here
        broker.moving.set_fields(
            keys.topic_key(topic), {"partitions": str(plan.new), "layout": plan.layouts[topic]}
        )
        broker.moving.delete_fields(keys.topic_key(topic), ["moving"])


class Repartition:
    """Runs (or resumes) a plan, step by step; ``crash_at`` is called at each step's start (tests)."""

    def __init__(
        self, broker: Broker, plan: Plan, crash_at: Callable[[str], None] = lambda step: None
    ) -> None:
        self.broker = broker
        self.plan = plan
        self.crash_at = crash_at
        #: what the copy found (None when a resumed run had copied before)
        self.summary: Summary | None = None

    def record(self, step: str) -> None:
        """Record the plan at ``step`` under every topic it moves: none can start another."""
        self.plan.step = step
        encoded = msgspec.json.encode(self.plan).decode()
        for topic in self.plan.topics:
            self.broker.moving.set_fields(plan_key(topic), {"plan": encoded})

    def run(self) -> Plan:
        plan = self.plan
        if plan.step == "planned":
            self.record("planned")
            seal(self.broker, plan)
            try:  # a worker that started after the plan's check, before the seal
                check_stopped(self.broker, plan)
            except AppRunning:
                unseal(self.broker, plan)
                raise
            self.crash_at("copy")
            self._stage()
            self.record("switching")
        if plan.step == "switching":
            self.crash_at("switch")
            switch(self.broker, plan, self.crash_at)
            self.broker.moving.delete_keys([plan_key(topic) for topic in plan.topics])
            plan.step = "done"
        return plan

    def _stage(self) -> None:
        """Copy the entries and DLQs and build the new backups, all into staged keys."""
        plan = self.plan
        apps = [read_app(self.broker, app, plan.topics, plan.old) for app in plan.apps]
        wanted = _named_entries(apps)
        moved = {}
        for topic in plan.topics:
            moved[topic] = copy_topic(self.broker, plan, topic, apps, wanted)
            copy_dlqs(self.broker, plan, topic)
            self.crash_at(f"copied {topic}")
        identity = f"repartition{int(time.time() * 1000)}-0"
        for app in apps:
            stage_state(self.broker, plan, app, moved, identity)
            self.crash_at(f"staged {app.name}")
        self.summary = summarize(plan, apps, moved)


def crash_point() -> Callable[[str], None]:
    """The test hook: ``PSPF_REPARTITION_CRASH_AT=<step>`` kills this process (SIGKILL) there."""
    wanted = os.environ.get("PSPF_REPARTITION_CRASH_AT")

    def crash_at(step: str) -> None:
        if step == wanted:
            os.kill(os.getpid(), signal.SIGKILL)

    return crash_at


def check_stopped(broker: Broker, plan: Plan) -> None:
    """Refuse while a worker of an app of the plan is alive."""
    for app in plan.apps:
        refuse_running(broker, app, plan.topics, plan.old)


def recorded(broker: Broker, topic: str) -> Plan | None:
    """The repartition of ``topic`` under way, if any."""
    raw = broker.moving.hash_fields(plan_key(topic)).get("plan")
    return None if raw is None else msgspec.json.decode(raw, type=Plan)


class Summary(NamedTuple):
    """What a repartition moves: entries each app will handle, its state keys per new partition."""

    to_handle: dict[str, int]
    state_keys: dict[str, list[int]]
    entries: int


def summarize(plan: Plan, apps: list[AppState], moved: dict[str, Moved]) -> Summary:
    to_handle = {app.name: sum(m.unhandled.get(app.name, 0) for m in moved.values()) for app in apps}
    state = keys.STATE_NAMESPACE.encode() + b"\x00"
    state_keys = {
        app.name: [
            sum(1 for name in part if name.startswith(state))
            for part in split(app.values, plan.new, _entry_keys(moved))
        ]
        for app in apps
    }
    return Summary(to_handle, state_keys, sum(m.count for m in moved.values()))


def dry_run(broker: Broker, plan: Plan) -> Summary:
    """What a run would do, writing nothing."""
    apps = [read_app(broker, app, plan.topics, plan.old) for app in plan.apps]
    wanted = _named_entries(apps)
    moved = {topic: copy_topic(broker, plan, topic, apps, wanted, write=False) for topic in plan.topics}
    return summarize(plan, apps, moved)
