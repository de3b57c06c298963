"""Retention: trimming a topic's streams without removing an entry anyone still needs.

A topic's retention is stored with the topic (``Topics.topic_retention``): a maximum age and/or a
maximum length of each partition's stream, and a replay window. Trimming a partition removes the
entries older than the trim point (``XTRIM MINID``), which is the earlier of

- what the retention would remove: entries older than the maximum age, and the oldest ones beyond
  the maximum length (either is enough to go);
- what nobody needs any more: for every consumer group of the stream (every app, also one that is
  far behind), its oldest pending entry, or else the entry after the last one delivered to it;
  no entry at all while an app registered for the topic has no group on the stream (it would
  start, or start again, from entries already gone);
- the replay window: entries younger than it stay, so an app can be replayed that far back.

DLQ entries are copies of the entries they came from, so a redrive needs nothing of the topic's
streams; the DLQ itself is never trimmed here (``pspf dlq purge`` is how it shrinks). Groups only
move forward, so a plan read a moment before it is applied is never less safe than it was.
Running workers apply their topics' retention to the partitions they own, periodically.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pspf import keys
from pspf.broker import Broker
from pspf.keys import StreamId

#: The most entries one pass removes per partition for the maximum length (the next pass goes on).
LENGTH_PASS = 100_000


class Retention(msgspec.Struct, frozen=True, kw_only=True):
    """A topic's retention; all None means the topic is never trimmed."""

    max_age_ms: int | None = None
    max_len: int | None = None
    #: entries younger than this are kept whatever the rest says (0: none)
    replay_window_ms: int = 0

    @property
    def active(self) -> bool:
        return self.max_age_ms is not None or self.max_len is not None


class PartitionTrim(msgspec.Struct, frozen=True, kw_only=True):
    """What trimming one partition does (or would do): its entries before the trim point go."""

    partition: int
    stream: str
    length: int
    memory_bytes: int | None
    #: entries before this id go ("" when nothing goes)
    trim_before: str
    #: entries that go: counted (up to ``broker.LAG_COUNT_LIMIT``) in a plan, removed in a trim;
    #: -1 when not counted
    removable: int
    #: why no more goes: "retention", "group APP", "app APP has no group", "replay window"
    held_by: str


def plan_partition(
    broker: Broker,
    topic: str,
    partition: int,
    retention: Retention,
    apps: Iterable[str],
    now_ms: int,
    count: bool = True,
) -> PartitionTrim:
    """The trim of one partition now; ``count`` counts the entries that would go (a dry run)."""
    stream = keys.stream_key(topic, partition)
    info = broker.topics.stream_info(stream)
    memory = broker.topics.stream_memory(stream) if count else None
    none = PartitionTrim(
        partition=partition,
        stream=stream,
        length=info.length,
        memory_bytes=memory,
        trim_before="",
        removable=0,
        held_by="retention",
    )
    if not retention.active or info.length == 0:
        return none
    bounds: list[tuple[StreamId, str]] = []
    wanted: StreamId | None = None
    if retention.max_age_ms is not None:
        wanted = StreamId(max(0, now_ms - retention.max_age_ms), 0)
    if retention.max_len is not None and info.length > retention.max_len:
        beyond = min(info.length - retention.max_len, LENGTH_PASS)
        last_gone = broker.topics.nth_id(stream, beyond)
        if last_gone is not None:
            by_length = StreamId.parse(last_gone).next()
            wanted = by_length if wanted is None else max(wanted, by_length)
    if wanted is None:
        return none
    bounds.append((wanted, "retention"))
    if retention.replay_window_ms:
        bounds.append((StreamId(max(0, now_ms - retention.replay_window_ms), 0), "replay window"))
    for app in apps:
        if app not in info.groups:
            return msgspec.structs.replace(none, held_by=f"app {app} has no group")
    for name, group in info.groups.items():
        oldest = broker.reading.oldest_pending(stream, name) if group.pending else None
        delivered = StreamId.parse(group.last_delivered_id)
        needed = StreamId.parse(oldest) if oldest is not None else delivered.next()
        bounds.append((needed, f"group {name}"))
    cut, held_by = min(bounds, key=lambda bound: bound[0])
    removable = broker.topics.count_before(stream, cut) if count else -1
    if count and removable == 0:
        return msgspec.structs.replace(none, held_by=held_by)
    return msgspec.structs.replace(none, trim_before=str(cut), removable=removable, held_by=held_by)


def stored(broker: Broker, topic: str) -> Retention:
    """The retention stored with a topic."""
    fields = broker.topics.topic_retention(topic)
    return msgspec.convert(
        {name: int(value) for name, value in fields.items() if name in Retention.__struct_fields__},
        Retention,
    )


def store(broker: Broker, topic: str, retention: Retention) -> None:
    """Store a topic's retention (None fields are removed)."""
    broker.topics.set_topic_retention(
        topic,
        {
            name: None if getattr(retention, name) in (None, 0) else str(getattr(retention, name))
            for name in Retention.__struct_fields__
        },
    )


def plan(
    broker: Broker, topic: str, partitions: Iterable[int], retention: Retention, count: bool = True
) -> list[PartitionTrim]:
    """The trims of these partitions of a topic, now (the server's clock)."""
    apps = apps_reading(broker, topic)
    now = broker.topics.server_time_ms()
    return [plan_partition(broker, topic, p, retention, apps, now, count) for p in partitions]


def apps_reading(broker: Broker, topic: str) -> list[str]:
    """The apps registered as readers of ``topic`` (each must keep what its group still needs)."""
    return [app for app in broker.apps.list_apps() if topic in broker.apps.app_topics(app)]


def trim(broker: Broker, plans: Iterable[PartitionTrim]) -> list[PartitionTrim]:
    """Apply plans; each with ``removable`` the number of entries it removed."""
    return [
        msgspec.structs.replace(
            p, removable=broker.topics.trim_before(p.stream, p.trim_before) if p.trim_before else 0
        )
        for p in plans
    ]
