"""Taking a savepoint: each partition's state backup read at one consistent point, with its positions.

A partition's cut is its last batch the backup holds: the backup is updated in the same atomic call
that acknowledges the batch (DESIGN step 6), so its values and its checkpoints (``cp:TOPIC``) agree,
and a copy read while the owner writes is made consistent by the backup's log
(``partition.backup.snapshot``). Partitions are cut one after another, each at its own point; they
share no state, so together they are a cut of the app. Nothing of the app is changed: a savepoint
killed at any step leaves the app as it was, and is taken again under its name (``--resume``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import msgspec

from pspf import keys
from pspf.broker import Broker
from pspf.errors import ConfigError, NotFound, StateOutOfReach, UnderWay
from pspf.keys import StreamId
from pspf.partition.copies import snapshot_fields
from pspf.savepoint.manifest import (
    Location,
    Manifest,
    PartitionCut,
    SavepointEntry,
    TopicCut,
    TopicLayout,
)
from pspf.state_stores.base import field

#: App record fields a savepoint does not keep: a restore or a stop under way.
_NOT_KEPT = frozenset({"restoring", "stop", "restored_from"})

_entry_decoder = msgspec.json.Decoder(SavepointEntry)
_STATE = field(keys.STATE_NAMESPACE, "")
#: Bookkeeping of entries that still need a handler, by "topic/id".
_WAITING = tuple(
    field(ns, "") for ns in (keys.FAILURES_NAMESPACE, keys.DEAD_NAMESPACE, keys.FOREIGN_NAMESPACE)
)
_OUTBOX = field(keys.OUTBOX_NAMESPACE, "")


def default_name(now_ms: int) -> str:
    """A savepoint's name when none is given: the UTC time it was taken, to the millisecond."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_ms / 1000)) + f"{now_ms % 1000:03d}Z"


def listed(broker: Broker, app: str) -> list[SavepointEntry]:
    """The app's savepoints the server knows of, oldest first."""
    found = broker.moving.hash_fields(keys.savepoints_key(app))
    return sorted((_entry_decoder.decode(raw) for raw in found.values()), key=lambda e: e.taken_ms)


def record(broker: Broker, app: str, entry: SavepointEntry) -> None:
    broker.moving.set_fields(keys.savepoints_key(app), {entry.name: msgspec.json.encode(entry).decode()})


def forget(broker: Broker, app: str, name: str) -> None:
    broker.moving.delete_fields(keys.savepoints_key(app), [name])


def crash_point(variable: str) -> Callable[[str], None]:
    """The test hook: the environment's ``variable=<step>`` kills this process (SIGKILL) at that step."""
    wanted = os.environ.get(variable)

    def crash_at(step: str) -> None:
        if step == wanted:
            os.kill(os.getpid(), signal.SIGKILL)

    return crash_at


def take(
    broker: Broker,
    app: str,
    directory: Location,
    name: str,
    stopped: bool,
    crash_at: Callable[[str], None] = lambda step: None,
) -> Manifest:
    """Write the savepoint ``name`` of ``app`` into ``directory`` (``URL/NAME``); its manifest.

    ``stopped``: the app has no worker now (checked by the caller), so nothing is in flight.
    """
    started = time.perf_counter()
    taken_ms = int(time.time() * 1000)
    topics, partitions, layouts = _readable(broker, app)
    record_fields = {
        k: v for k, v in broker.moving.hash_fields(keys.app_key(app)).items() if k not in _NOT_KEPT
    }
    record(broker, app, SavepointEntry(name=name, path=directory.url, taken_ms=taken_ms, state="taking"))
    directory.make()
    parts = []
    for partition in range(partitions):
        parts.append(_cut(broker, app, topics, partition, directory, record_fields))
        crash_at(f"partition {partition}")
    manifest = Manifest(
        app=app,
        name=name,
        taken_ms=taken_ms,
        stopped=stopped,
        partitions=partitions,
        topics=topics,
        layouts=layouts,
        record=record_fields,
        parts=parts,
        seconds=round(time.perf_counter() - started, 3),
    )
    crash_at("manifest")
    directory.write_manifest(manifest)
    done = SavepointEntry(
        name=name,
        path=directory.url,
        taken_ms=taken_ms,
        state="complete",
        partitions=partitions,
        keys=manifest.keys,
        stopped=stopped,
    )
    record(broker, app, done)
    return manifest


def _readable(broker: Broker, app: str) -> tuple[list[str], int, dict[str, TopicLayout]]:
    """The app's topics, partition count and layouts; refused when its state is not in its backups."""
    topics = broker.apps.app_topic_list(app)
    if not topics:
        raise NotFound(f"app {app!r} has never run against this server: there is nothing to save")
    partitions = broker.apps.app_partitions(app)
    sink = broker.apps.app_sink(app)
    if sink is not None:
        raise StateOutOfReach(
            f"app {app!r} is a sink into {sink}: its positions are kept there, where a savepoint "
            "cannot read them"
        )
    layouts = {}
    for topic in topics:
        count, layout, moving = broker.topics.topic_layout(topic)
        if moving:
            raise UnderWay(f"topic {topic!r} is being repartitioned: take the savepoint once that is done")
        if count != partitions:
            raise ConfigError(
                f"topic {topic!r} has {count} partitions but app {app!r} was run with {partitions}: "
                "run the app once to bring its record up to date"
            )
        layouts[topic] = TopicLayout(partitions=count, layout=layout)
    return topics, partitions, layouts


def _cut(
    broker: Broker,
    app: str,
    topics: list[str],
    partition: int,
    directory: Location,
    record_fields: dict[str, str],
) -> PartitionCut:
    """One partition's state at its last committed batch, written to its file."""
    copy = snapshot_fields(broker.acks, keys.backup_keys(topics[0], partition, app))
    if copy is None:
        raise StateOutOfReach(
            f"app {app!r} has no state backup of partition {partition}: a savepoint is read from the "
            "state backups (run the app with the state backup on)"
        )
    checkpoints, values = copy
    state_keys = sum(1 for name in values if name.startswith(_STATE))
    pages = sum(1 for name in values if name.startswith(_OUTBOX))
    file = f"partition-{partition}.state"
    sha256, size = directory.write_pairs(file, values.items())
    waiting = _waiting(values)
    cuts = {}
    for topic in topics:
        stream = keys.stream_key(topic, partition)
        at = checkpoints.get(topic)
        start = record_fields.get(f"start:{topic}:{partition}")
        group = broker.topics.stream_info(stream).groups.get(app)
        _, added, _, last = broker.topics.stream_tally(stream)
        after = max(
            (p for p in (at, StreamId.parse(start) if start else None) if p is not None), default=None
        )
        following = broker.requests.dlq_range(stream, "-" if after is None else f"({after}", "+", 1)
        cuts[topic] = TopicCut(
            checkpoint=None if at is None else str(at),
            start=start,
            delivered=None if group is None else group.last_delivered_id.decode(),
            next_entry=following[0][0].decode() if following else None,
            last=None if last is None else last.decode(),
            added=added,
            waiting=sorted(waiting.get(topic, []), key=StreamId.parse),
        )
    return PartitionCut(
        partition=partition,
        file=file,
        topics=cuts,
        values=len(values),
        keys=state_keys,
        outbox_pages=pages,
        sha256=sha256,
        size=size,
    )


def _waiting(values: dict[bytes, bytes]) -> dict[str, list[str]]:
    """The entries the cut's bookkeeping says still need a handler, by topic (their ids)."""
    found: dict[str, list[str]] = {}
    for name in values:
        if name.startswith(_WAITING):
            topic, _, entry_id = name.partition(b"\x00")[2].decode().rpartition("/")
            found.setdefault(topic, []).append(entry_id)
    return found
