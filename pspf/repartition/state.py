"""Splitting or merging an app's backed-up state by key into a new partition count.

Each field of an old partition's state backup (``namespace NUL key``) goes to the new partition
of the key it belongs to (see the table in the repartitioning design): the entry key itself, the
key inside a table row's, window's or schedule's name, or, for bookkeeping named after an entry
(``topic/id``), the key of that entry, looked up in the old stream. A partition's stream time goes
to every new partition it feeds, the largest winning; a timer's last period and the outbox's
counters (the largest) to every new partition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import msgspec

from pspf import keys
from pspf.state_stores.base import field, split_field

#: The outbox's counters (next row id / next sequence), as ``pspf.outbox.rows.NEXT_KEY`` names them.
OUTBOX_COUNTERS = "next"
#: Namespaces whose key is the entry key.
_BY_KEY = frozenset({keys.STATE_NAMESPACE, keys.EXPIRY_NAMESPACE})
#: Namespaces named after an entry (``topic/id``): they follow that entry's key.
_BY_ENTRY = frozenset(
    {keys.FAILURES_NAMESPACE, keys.DEAD_NAMESPACE, keys.FOREIGN_NAMESPACE, keys.SUPERSEDED_NAMESPACE}
)
#: Namespaces that do not move: the new partitions start them anew.
_DROPPED = frozenset(
    {
        keys.CONSUMERS_NAMESPACE,
        keys.BACKUP_NAMESPACE,
        keys.OUTBOX_NAMESPACE,
        keys.OUTBOX_STATE_NAMESPACE,
        keys.OUTBOX_META_NAMESPACE,
    }
)


class Gone:
    """The entry a bookkeeping field names is no longer in its stream."""


GONE = Gone()

#: An entry's key from its topic and old id: None for a keyless entry (spread by its id), GONE
#: when it is no longer in its stream (trimmed).
EntryKey = Callable[[str, str], bytes | Gone | None]


def key_of(namespace: str, key: str) -> str | None:
    """The entry key a field of ``namespace`` belongs to; None when it belongs to no one key."""
    if namespace in _BY_KEY:
        return key
    if namespace in (keys.TABLES_NAMESPACE, keys.TABLE_HISTORY_NAMESPACE, keys.TABLE_VERSIONS_NAMESPACE):
        return key.partition("/")[2]
    if namespace == keys.SCHEDULES_NAMESPACE:
        return key.partition("/")[2]
    if namespace == keys.WINDOWS_NAMESPACE:
        return keys.split_window_key(key).key
    return None


def spread(entry_id: str, count: int) -> int:
    """The new partition of a keyless entry: from its id, so a resumed run spreads it the same way."""
    return keys.partition_for(entry_id.encode(), count)


def new_partitions(namespace: str, key: str, count: int, entry_key: EntryKey) -> tuple[int, ...]:
    """The new partitions one field goes to (none: dropped)."""
    if namespace in _DROPPED:
        return ()
    if namespace == keys.TIME_NAMESPACE:
        return tuple(range(count)) if key.startswith(keys.TIMER_PREFIX) else ()
    if namespace in _BY_ENTRY:
        topic, _, entry_id = key.rpartition("/")
        found = entry_key(topic, entry_id)
        if isinstance(found, Gone):
            return ()  # trimmed away: nothing to retry or to mark any more
        if found is None:
            return (spread(entry_id, count),)
        return (keys.partition_for(found, count),)
    owner = key_of(namespace, key)
    if owner is None:
        raise ValueError(f"no rule moves state of namespace {namespace!r} (key {key!r})")
    return (keys.partition_for(owner.encode(), count),)


def split(
    sources: Iterable[Iterable[tuple[bytes, bytes]]], count: int, entry_key: EntryKey
) -> list[dict[bytes, bytes]]:
    """The new partitions' backup values from the old partitions' (``field`` -> value pages).

    A stream time (the partition's, or a window's own) goes to the new partitions that get any
    of its partition's state, and the largest of those reaching one partition wins.
    """
    routed: list[dict[bytes, bytes]] = [{} for _ in range(count)]
    times: list[dict[bytes, bytes]] = [{} for _ in range(count)]
    counters: tuple[int, int] | None = None
    for pages in sources:
        reached: set[int] = set()
        stream_times: dict[bytes, bytes] = {}
        for name, value in pages:
            namespace, key = split_field(name)
            if namespace == keys.TIME_NAMESPACE and (
                key == keys.STREAM_TIME or key.startswith(keys.WINDOW_TIME_PREFIX)
            ):
                stream_times[name] = value
                continue
            if namespace == keys.OUTBOX_META_NAMESPACE and key == OUTBOX_COUNTERS:
                row_id, _, seq = value.decode().partition("/")
                previous = counters or (0, 0)
                counters = (max(previous[0], int(row_id)), max(previous[1], int(seq)))
                continue
            for q in new_partitions(namespace, key, count, entry_key):
                routed[q][name] = value
                reached.add(q)
        for name, stream_time in stream_times.items():
            for q in reached or range(count):
                times[q][name] = _later(times[q].get(name), stream_time)
    for q, found in enumerate(times):
        routed[q].update(found)
        if counters is not None:
            # Targets drop an emitted row whose sequence is not above the last they recorded for
            # its (app, source partition): every new partition goes on above every old one's.
            routed[q][field(keys.OUTBOX_META_NAMESPACE, OUTBOX_COUNTERS)] = (
                f"{counters[0]}/{counters[1]}".encode()
            )
    return routed


def _later(a: bytes | None, b: bytes) -> bytes:
    """The later of two stream times."""
    if a is None:
        return b
    return a if _time_ms(a) >= _time_ms(b) else b


def _time_ms(raw: bytes) -> int:
    """A stream time's event ms (msgpack ``(ms, topic, entry id)``, as ``pspf.windows`` writes it)."""
    return int(msgspec.msgpack.decode(raw, type=tuple[int, str, bytes])[0])


def checkpoints_of(meta: Mapping[str, str]) -> dict[str, keys.StreamId]:
    """A backup meta's checkpoints (``cp:TOPIC``)."""
    return {name[3:]: keys.StreamId.parse(value) for name, value in meta.items() if name.startswith("cp:")}
