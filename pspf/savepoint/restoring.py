"""Restoring a savepoint: an app, or a fork under a new name, put at the savepoint's cut.

Everything is built beside the live keys first (each partition's state backup, staged as the
repartition stages its own, in the same slot), while the app is stopped and nothing live changes: a
restore killed there leaves the app as it was. Then the plan (the groups' positions and the record)
is written into the app's record, which from then on keeps its workers from starting, and the
switch swaps the staged backups in, re-creates each group at its position with an empty pending
list and writes the record; a resumed switch (``--resume``) does what is left, as each of its steps
can be done twice. Stores in state dirs anywhere are rebuilt from the restored backups when their
partitions are taken (their identity is not the backup's, and the backup's log is gone).

Positions: a group restarts after the partition's checkpoint, or before the first entry at or
below it that still needs a handler (a parked retry, a dead entry to move, a foreign one), whose
handled neighbours are then skipped by the checkpoint as after a crash. When the topics were
repartitioned since (one layout generation later, another count), the saved state is split or
merged by key, and the moved entries the cut had handled are skipped by their old partition's
checkpoint, as a repartition does (``pspf.repartition``).

What a fork takes: the state, its timers and bookkeeping, but no outbox rows nor view writes
(they belong to the original, which publishes them itself); its producers are its own, so its
outputs are what its code emits for the entries after the cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import suppress

import msgspec

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import BrokerError, ConfigError, StateOutOfReach, UnderWay
from pspf.keys import StreamId
from pspf.repartition.run import STAGED, AppState, Moved, Plan, refuse_running, stage_state, swap_in_staged
from pspf.savepoint.manifest import Location, Manifest, PartitionCut, TopicCut
from pspf.state_stores.base import field, split_field

#: The record field holding a restore's plan while its switch runs (``refuse_restoring``).
RESTORING = "restoring"
#: Namespaces no restore takes: the new owners start them anew.
_NEVER = frozenset({keys.BACKUP_NAMESPACE, keys.CONSUMERS_NAMESPACE})
#: And those a fork does not take: the original's outputs on their way out.
_NOT_FORKED = frozenset(
    {keys.OUTBOX_NAMESPACE, keys.OUTBOX_STATE_NAMESPACE, keys.OUTBOX_META_NAMESPACE, keys.VIEWS_NAMESPACE}
)
#: The outbox's counters (kept by a fork: its sequence numbers go on from the original's).
_COUNTERS = field(keys.OUTBOX_META_NAMESPACE, "next")
#: Pending work at or below a checkpoint: the entry is delivered to a handler again.
_PENDING_WORK = (keys.FAILURES_NAMESPACE, keys.DEAD_NAMESPACE, keys.FOREIGN_NAMESPACE)
#: Entries read from a stream per round trip while looking for the moved ones.
PAGE = 2000


class RestorePlan(msgspec.Struct, kw_only=True):
    """A restore's switch, as recorded in the target app's record while it runs."""

    source: str
    app: str
    target: str
    #: the count the savepoint was taken at, and the one restored into
    saved_partitions: int
    partitions: int
    topics: list[str]
    #: topic -> each partition's group position
    positions: dict[str, list[str]]
    #: the record's fields to set (a fork's whole record; the app itself keeps its own)
    record: dict[str, str]
    started_ms: int


class Restoring(msgspec.Struct, kw_only=True):
    """What a restore does (or would do: a dry run)."""

    plan: RestorePlan
    #: "same": the saved count; "split": the topics were repartitioned since
    mode: str
    keys: int
    values: int
    #: entries the target will handle after the cut
    to_handle: int


def recorded(broker: Broker, target: str) -> RestorePlan | None:
    """The restore of ``target`` whose switch is under way, if any."""
    raw = broker.moving.hash_fields(keys.app_key(target)).get(RESTORING)
    return None if raw is None else msgspec.json.decode(raw, type=RestorePlan)


def refuse_restoring(broker: Broker, app: str) -> None:
    """Refuse to run an app while a restore switches it (a worker's start calls this)."""
    plan = recorded(broker, app)
    if plan is not None:
        raise UnderWay(
            f"a restore of app {app!r} from {plan.source} is under way: finish it with "
            f"`pspf app restore {plan.app} --from {plan.source}"
            f"{'' if plan.target == plan.app else ' --as ' + plan.target} --resume`"
        )


def prepare(
    broker: Broker,
    directory: Location,
    app: str,
    target: str,
    expect: int | None,
    write: bool,
    crash_at: Callable[[str], None] = lambda step: None,
) -> Restoring:
    """Check a restore of ``app``'s savepoint into ``target``, and stage its backups (if ``write``)."""
    manifest = directory.read_manifest()
    if manifest.app != app:
        raise ConfigError(
            f"the savepoint at {directory.url} is of app {manifest.app!r}, not {app!r} (a fork "
            f"of it: pspf app restore {manifest.app} --from {directory.url} --as NEW_APP)"
        )
    fork = target != manifest.app
    count, mode = _layout(broker, manifest, expect)
    _refuse_target(broker, manifest, directory.url, target, fork, count)
    try:
        if mode == "same":
            return _stage_same(broker, manifest, directory, target, fork, write, crash_at)
        return _stage_split(broker, manifest, directory, target, fork, count, write, crash_at)
    except Exception:  # a damaged file, a lost connection: leave no staged copy behind
        if write:
            staged = [keys.backup_keys(manifest.topics[0], q, target) for q in range(count)]
            with suppress(BrokerError):
                broker.moving.delete_keys([k + STAGED for b in staged for k in (b.values, b.meta)])
        raise


def switch(broker: Broker, plan: RestorePlan, crash_at: Callable[[str], None] = lambda step: None) -> None:
    """Swap the staged backups in, move the groups and write the record (each step idempotent)."""
    record = keys.app_key(plan.target)
    broker.moving.set_fields(record, {RESTORING: msgspec.json.encode(plan).decode()})
    crash_at("switch")
    for partition in range(plan.partitions):
        swap_in_staged(broker, keys.backup_keys(plan.topics[0], partition, plan.target))
        for topic in plan.topics:
            position = plan.positions[topic][partition]
            broker.apps.reset_group(keys.stream_key(topic, partition), plan.target, position)
        crash_at(f"switched {partition}")
    starts = [name for name in broker.moving.hash_fields(record) if name.startswith("start:")]
    broker.moving.delete_fields(record, starts)
    broker.moving.set_fields(record, plan.record)
    broker.apps.register_app(plan.target, plan.topics, plan.partitions)
    broker.moving.delete_fields(record, [RESTORING])


def _refuse_target(
    broker: Broker, manifest: Manifest, source: str, target: str, fork: bool, count: int
) -> None:
    keys.check_name("app", target)
    refuse_restoring(broker, target)
    refuse_running(broker, target, manifest.topics, count)
    if not fork:
        return
    if broker.apps.app_topic_list(target):
        done = broker.moving.hash_fields(keys.app_key(target)).get("restored_from") == source
        raise ConfigError(
            f"app {target!r} exists"
            + (": it was restored from this savepoint already" if done else "")
            + f": a fork gets a new name (or delete it first: pspf app delete {target})"
        )
    managed = [t for t in manifest.record.get("managed", "").split(",") if t]
    if managed:
        raise ConfigError(
            f"app {manifest.app!r} re-keys through {', '.join(managed)}: a fork would read and write "
            "the same topics as the original; restore the app itself instead"
        )


def _layout(broker: Broker, manifest: Manifest, expect: int | None) -> tuple[int, str]:
    """The topics' partition count now, and "same" or "split" (repartitioned once since)."""
    counts = set()
    modes = set()
    for topic in manifest.topics:
        count, layout, moving = broker.topics.topic_layout(topic)
        if moving:
            raise UnderWay(f"topic {topic!r} is being repartitioned: restore once that is done")
        saved = manifest.layouts[topic]
        counts.add(count)
        if layout == saved.layout and count == saved.partitions:
            modes.add("same")
        elif layout.isdigit() and saved.layout.isdigit() and int(layout) == int(saved.layout) + 1:
            modes.add("split")
        else:
            raise ConfigError(
                f"topic {topic!r} was repartitioned more than once since the savepoint (layout "
                f"{saved.layout} then, {layout} now): a savepoint follows one repartition at most"
            )
    count = counts.pop()
    if counts or len(modes) > 1:
        raise ConfigError(f"the topics of app {manifest.app!r} no longer share one layout")
    if expect is not None and expect != count:
        raise ConfigError(
            f"the topics of app {manifest.app!r} have {count} partitions now, not {expect} "
            f"(the savepoint has {manifest.partitions})"
        )
    return count, modes.pop()


def _kept(name: bytes, fork: bool) -> bool:
    namespace = name.partition(b"\x00")[0].decode()
    if namespace in _NEVER:
        return False
    return not (fork and namespace in _NOT_FORKED and name != _COUNTERS)


def _pairs(directory: Location, part: PartitionCut, fork: bool) -> Iterator[list[tuple[bytes, bytes]]]:
    for frame in directory.read_pairs(part):
        yield [(name, value) for name, value in frame if _kept(name, fork)]


def _identity(started_ms: int) -> str:
    return f"restore{started_ms}-0"


def _target_record(manifest: Manifest, source: str, fork: bool, count: int, split: bool) -> dict[str, str]:
    """The record fields a restore writes: the group starts (same layout), a fork's whole record."""
    kept = {
        name: value
        for name, value in manifest.record.items()
        if fork or (name.startswith("start:") and not split)
    }
    if split:
        kept = {name: value for name, value in kept.items() if not name.startswith("start:")}
    kept.pop("views", None)
    kept.pop("stop", None)
    kept["restored_from"] = source
    kept.update({"topics": ",".join(manifest.topics), "partitions": str(count)})
    return kept


def _stage_same(
    broker: Broker,
    manifest: Manifest,
    directory: Location,
    target: str,
    fork: bool,
    write: bool,
    crash_at: Callable[[str], None],
) -> Restoring:
    """The saved layout: each partition's backup as saved, its groups after what it handled."""
    started = int(time.time() * 1000)
    identity = _identity(started)
    positions: dict[str, list[str]] = {topic: [] for topic in manifest.topics}
    to_handle = 0
    for part in manifest.parts:  # every check before anything is staged
        _refuse_trimmed(broker, manifest, part)
    for part in manifest.parts:
        backup = keys.backup_keys(manifest.topics[0], part.partition, target)
        staged = _Staged(broker, backup.values + STAGED, write)
        for page in _pairs(directory, part, fork):
            staged.add(page)
        staged.add([(keys.BACKUP_MARK, identity.encode())])
        meta = {
            keys.BACKUP_IDENTITY: identity,
            keys.BACKUP_MARKED: "1",
            keys.BACKUP_PARTITIONS: str(manifest.partitions),
        }
        for topic, cut in part.topics.items():
            if cut.checkpoint is not None:
                meta[f"cp:{topic}"] = cut.checkpoint
            position = _position(cut)
            positions[topic].append(str(position))
            to_handle += broker.topics.count_after(keys.stream_key(topic, part.partition), str(position))
        if write:
            broker.moving.replace_hash(backup.meta + STAGED, meta)
        crash_at(f"staged {part.partition}")
    plan = RestorePlan(
        source=directory.url,
        app=manifest.app,
        target=target,
        saved_partitions=manifest.partitions,
        partitions=manifest.partitions,
        topics=manifest.topics,
        positions=positions,
        record=_target_record(manifest, directory.url, fork, manifest.partitions, split=False),
        started_ms=started,
    )
    values = sum(part.values for part in manifest.parts)
    return Restoring(plan=plan, mode="same", keys=manifest.keys, values=values, to_handle=to_handle)


def _position(cut: TopicCut) -> StreamId:
    """Where a group restarts: after the checkpoint, or before the first entry still to handle."""
    at = StreamId.parse(cut.checkpoint or cut.start or str(keys.ZERO_ID))
    waiting = [entry for entry in map(StreamId.parse, cut.waiting) if entry <= at]
    return min(waiting).previous() if waiting else at


class _Staged:
    """A staged values hash written page by page (a dry run writes nothing)."""

    def __init__(self, broker: Broker, key: str, write: bool) -> None:
        self.broker = broker
        self.key = key
        self.write = write
        if write:
            broker.moving.delete_keys([key])

    def add(self, page: list[tuple[bytes, bytes]]) -> None:
        if self.write and page:
            self.broker.moving.add_fields(self.key, page)


def _refuse_trimmed(broker: Broker, manifest: Manifest, part: PartitionCut) -> None:
    """Refuse when the streams no longer hold the entries after the saved positions."""
    for topic, cut in part.topics.items():
        stream = keys.stream_key(topic, part.partition)
        lost = _trimmed(broker, stream, cut)
        if lost is not None:
            after = cut.checkpoint or cut.start or "the start"
            raise StateOutOfReach(
                f"topic {topic!r} partition {part.partition} no longer holds the entries after the "
                f"savepoint's position {after} ({lost}): app {manifest.app!r} cannot go on from the "
                "savepoint without them; nothing was restored"
            )


def _trimmed(broker: Broker, stream: str, cut: TopicCut) -> str | None:
    """What of the entries after a saved position is gone (None: nothing, as far as can be told).

    The first entry after it then must still be there. With none then, every entry added since is
    after the stream's last id then; trimming removes from the head, so none is gone while the first
    entry now is at or before that id, or while as many are left as were added (Redis 7+ and Valkey
    count them). A server that does not count them cannot tell once every entry of the cut is gone.
    """
    for waiting in cut.waiting:
        if not broker.requests.dlq_range(stream, waiting, waiting, 1):
            return f"{waiting}, which still needed a handler, was trimmed"
    entry = cut.next_entry
    if entry is not None:
        return None if broker.requests.dlq_range(stream, entry, entry, 1) else f"{entry} was trimmed"
    length, added, first, last = broker.topics.stream_tally(stream)
    then = StreamId.parse(cut.last) if cut.last is not None else None
    if then is not None and (last is None or StreamId.parse(last) <= then):
        return None  # nothing added since
    if then is not None and first is not None and StreamId.parse(first) <= then:
        return None
    if added is not None and cut.added is not None:
        since = added - cut.added
        return f"{since - length} of the {since} entries added since were trimmed" if length < since else None
    if then is None:
        return None  # nothing there at the cut, and no count of what was added: nothing to tell by
    return (
        "every entry there at the cut was trimmed; this server does not count the entries added "
        "to a stream (Redis 7+ and Valkey do), so some added since may be gone too"
    )


def _stage_split(
    broker: Broker,
    manifest: Manifest,
    directory: Location,
    target: str,
    fork: bool,
    count: int,
    write: bool,
    crash_at: Callable[[str], None],
) -> Restoring:
    """Another count: the saved state split or merged by key, the moved entries it handled skipped."""
    started = int(time.time() * 1000)
    app = _saved_app(manifest, directory, target, fork)
    if not fork:
        app.values.append(_published_since(broker, manifest, target, count))
    wanted = {
        split_field(name)[1]
        for page in app.values
        for name, _ in page
        if split_field(name)[0] in (*_PENDING_WORK, keys.SUPERSEDED_NAMESPACE)
    }
    moved = {topic: _found(broker, manifest, topic, count, app, wanted) for topic in manifest.topics}
    plan = Plan(
        topic=manifest.topics[0], topics=manifest.topics, apps=[target], old=manifest.partitions, new=count
    )
    if write:
        stage_state(broker, plan, app, moved, _identity(started))
    crash_at("staged")
    positions = {
        topic: [str(moved[topic].start(target, q)) for q in range(count)] for topic in manifest.topics
    }
    restore_plan = RestorePlan(
        source=directory.url,
        app=manifest.app,
        target=target,
        saved_partitions=manifest.partitions,
        partitions=count,
        topics=manifest.topics,
        positions=positions,
        record=_target_record(manifest, directory.url, fork, count, split=True),
        started_ms=started,
    )
    return Restoring(
        plan=restore_plan,
        mode="split",
        keys=manifest.keys,
        values=sum(part.values for part in manifest.parts),
        to_handle=sum(m.unhandled.get(target, 0) for m in moved.values()),
    )


def _saved_app(manifest: Manifest, directory: Location, target: str, fork: bool) -> AppState:
    """The savepoint as a repartition reads an app: its values and what it had handled, by old partition."""
    app = AppState(target, manifest.topics[0], manifest.topics)
    for part in manifest.parts:
        pages = [pair for page in _pairs(directory, part, fork) for pair in page]
        if any(name.startswith(keys.MOVED_NAMESPACE.encode() + b"\x00") for name, _ in pages):
            raise ConfigError(
                f"app {manifest.app!r} had not yet handled the entries a repartition moved when the "
                f"savepoint was taken (partition {part.partition}): it cannot follow another one"
            )
        app.values.append(pages)
        for topic, cut in part.topics.items():
            upto = max((StreamId.parse(p) for p in (cut.checkpoint, cut.start) if p), default=None)
            if upto is not None:
                app.handled_to[(topic, part.partition)] = upto
            app.exceptions.update(f"{topic}/{entry}" for entry in cut.waiting)
    return app


def _published_since(
    broker: Broker, manifest: Manifest, target: str, count: int
) -> list[tuple[bytes, bytes]]:
    """The outbox counters the app's partitions reached since the savepoint (the largest).

    Its producers' records in the targets are that far: in another layout the rows it emits again
    are not those numbers' rows, so they are numbered above them (published again, never dropped).
    """
    reached = [
        broker.acks.backup_value(keys.backup_keys(manifest.topics[0], q, target), _COUNTERS)
        for q in range(count)
    ]
    found = [tuple(int(n) for n in raw.decode().split("/")) for raw in reached if raw]
    if not found:
        return []
    return [(_COUNTERS, f"{max(f[0] for f in found)}/{max(f[1] for f in found)}".encode())]


def _found(
    broker: Broker, manifest: Manifest, topic: str, count: int, app: AppState, wanted: set[str]
) -> Moved:
    """What the target must handle in each of the topic's new partitions, read from the streams.

    An entry a repartition moved carries its old partition (and its old id when it had to change):
    the cut handled it when it is at or below that partition's saved position and needs no handler
    there. Entries added since have no such header: none was handled.
    """
    found = Moved()
    needed = {
        (part.partition, cut.next_entry)
        for part in manifest.parts
        if (cut := part.topics.get(topic)) is not None and cut.next_entry is not None
    }
    for q in range(count):
        stream = keys.stream_key(topic, q)
        start = "-"
        while page := broker.requests.dlq_range(stream, start, "+", PAGE):
            for raw_id, fields in page:
                entry_id = StreamId.parse(raw_id)
                found.last[q] = entry_id
                old, original = _moved_from(fields, raw_id)
                name = keys.entry_name(topic, original.encode())
                needed.discard((old, original))
                if name in wanted:
                    found.entry_keys[name] = fields.get(codec.KEY)
                if original != raw_id.decode():
                    found.renamed[name] = keys.entry_name(topic, raw_id)
                if old is None or not app.handled(topic, old, StreamId.parse(original), name):
                    found.unhandled[app.name] = found.unhandled.get(app.name, 0) + 1
                    found.first_unhandled.setdefault((app.name, q), entry_id)
            if len(page) < PAGE:
                break
            start = "(" + page[-1][0].decode()
    if needed:
        old, entry = sorted(needed, key=lambda n: (n[0] or 0, n[1] or ""))[0]
        raise StateOutOfReach(
            f"topic {topic!r}: the entries after the savepoint's position in its old partition {old} "
            f"are gone (the first of them, {entry}, was trimmed): app {manifest.app!r} cannot go on "
            "from the savepoint without them; nothing was restored"
        )
    return found


def _moved_from(fields: dict[bytes, bytes], raw_id: bytes) -> tuple[int | None, str]:
    """The old partition a repartition moved an entry from (None: added since) and its old id."""
    raw = fields.get(codec.HEADERS)
    if raw is None or keys.MOVED_FROM_HEADER.encode() not in raw:
        return None, raw_id.decode()
    headers = codec.decode_headers(raw)
    return int(headers[keys.MOVED_FROM_HEADER]), headers.get(keys.MOVED_ID_HEADER, raw_id.decode())
