"""What operators and the worker's setup ask of the broker: topics, apps, groups, positions.

Topics and apps are recorded in hashes (``keys.topic_key``, ``keys.app_key``) so their partitions,
retention and group starts can be found by name; a topic's partition count is fixed when it is
created. Stream and group positions (``stream_info``, ``group_position``) are what lag and the
metrics report. The DLQ and outbox-replay requests are in ``requests``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import LAG_COUNT_LIMIT, GroupInfo, GroupPosition, StreamInfo, _text
from pspf.errors import AuthenticationFailed, BrokerError, BrokerUnavailable, ConfigError, NotFound


class Admin(Connection):
    """Topics, apps, groups and stream positions."""

    # -- topics ---------------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int) -> bool:
        """Record a topic; False when it exists already with the same partition count.

        Raises:
            ConfigError: it exists with another partition count (the request is at fault, not
                the broker).
        """
        with self.translate_errors():
            created = self.client.hsetnx(keys.topic_key(topic), "partitions", partitions)
            self.client.sadd(keys.TOPICS_KEY, topic)
        if not created:
            existing = self.topic_partitions(topic)
            if existing != partitions:
                raise ConfigError(
                    f"topic {topic!r} exists with {existing} partitions, not {partitions}: "
                    "a topic's partition count is fixed when it is created"
                )
        return bool(created)

    def topic_partitions(self, topic: str) -> int:
        """The partition count of a topic; NotFound when it was never created."""
        with self.translate_errors():
            raw = self.client.hget(keys.topic_key(topic), "partitions")
        if raw is None:
            raise NotFound(
                f"topic {topic!r} does not exist; create it with `pspf topic create {topic} --partitions N`"
            )
        return int(raw)

    def reader_counts(self, topic: str) -> dict[str, int]:
        """The partition count each app that reads ``topic`` was built for, by its record (one round trip)."""
        with self.translate_errors():
            apps = sorted(_text(a) for a in self.client.smembers(keys.APPS_KEY))
            pipe = self.client.pipeline(transaction=False)
            for app in apps:
                pipe.hmget(keys.app_key(app), ["topics", "partitions"])
            records = pipe.execute()
        return {
            app: int(built)
            for app, (read, built) in zip(apps, records, strict=True)
            if read is not None and built is not None and topic in _text(read).split(",")
        }

    def list_topics(self) -> list[str]:
        with self.translate_errors():
            return sorted(_text(t) for t in self.client.smembers(keys.TOPICS_KEY))

    def topic_retention(self, topic: str) -> dict[str, str]:
        """A topic's stored retention fields (``retention.Retention``); empty when none is set."""
        with self.translate_errors():
            raw = self.client.hgetall(keys.topic_key(topic))
        return {
            _text(k)[len("retention:") :]: _text(v) for k, v in raw.items() if k.startswith(b"retention:")
        }

    def set_topic_retention(self, topic: str, fields: Mapping[str, str | None]) -> None:
        """Store retention fields of a topic (None removes one)."""
        key = keys.topic_key(topic)
        with self.translate_errors(), self._on(key).pipeline(transaction=True) as pipe:
            for name, value in fields.items():
                if value is None:
                    pipe.hdel(key, f"retention:{name}")
                else:
                    pipe.hset(key, f"retention:{name}", value)
            pipe.execute()

    def server_time_ms(self) -> int:
        with self.translate_errors():
            seconds, micros = self._servers()[0].time()
        return int(seconds) * 1000 + int(micros) // 1000

    def stream_memory(self, stream: str) -> int | None:
        """The bytes a stream takes on its server (MEMORY USAGE); None where that is not allowed."""
        try:
            with self.translate_errors(stream):
                used = self.client.memory_usage(stream)
        except (BrokerUnavailable, AuthenticationFailed):
            raise
        except BrokerError:  # an ACL user without MEMORY USAGE
            return None
        return None if used is None else int(used)

    def nth_id(self, stream: str, n: int) -> bytes | None:
        """The id of the stream's n-th entry from its start (None when it has fewer)."""
        with self.translate_errors(stream):
            entries = cast(list[tuple[bytes, Any]], self.client.xrange(stream, "-", "+", n))
        return bytes(entries[-1][0]) if len(entries) == n else None

    def trim_before(self, stream: str, before: str) -> int:
        """Remove the stream's entries with ids below ``before`` (XTRIM MINID); how many went."""
        with self.translate_errors(stream):
            return int(self.client.xtrim(stream, minid=before, approximate=False))

    def register_app(
        self,
        app: str,
        topics: list[str],
        partitions: int,
        tables: list[str] | None = None,
        global_tables: list[str] | None = None,
    ) -> None:
        """Record what an app reads, so operators can find its state by app name alone.

        ``tables``: those of ``topics`` the app reads as tables; ``global_tables``: the topics it
        reads whole into each worker's own store (None leaves the record's as is).
        """
        mapping: dict[str, str | int] = {"topics": ",".join(topics), "partitions": partitions}
        if tables is not None:
            mapping["tables"] = ",".join(tables)
        if global_tables is not None:
            mapping["global_tables"] = ",".join(global_tables)
        with self.translate_errors():
            self.client.hset(keys.app_key(app), mapping=mapping)
            self.client.sadd(keys.APPS_KEY, app)

    def mark_sink(self, app: str, target: str) -> None:
        """Record that ``app`` is a sink delivering into ``target``: its checkpoints live there."""
        with self.translate_errors():
            self.client.hset(keys.app_key(app), "sink", target)

    def app_sink(self, app: str) -> str | None:
        """What the sink ``app`` delivers into (``mark_sink``); None for an app that is no sink."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "sink")
        return _text(raw) if raw else None

    def app_tables(self, app: str) -> list[str]:
        """The topics an app reads as tables (co-partitioned), as its workers last recorded."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "tables")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def app_global_tables(self, app: str) -> list[str] | None:
        """The app's global tables, as its workers last recorded; None when none recorded them."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "global_tables")
        return None if raw is None else [t for t in _text(raw).split(",") if t]

    def app_topics(self, app: str) -> set[str]:
        """The topics an app read when it last ran here (empty if it never ran)."""
        return set(self.app_topic_list(app))

    def app_topic_list(self, app: str) -> list[str]:
        """The topics an app read when it last ran here, in the app's order.

        The first one's partitions carry the app's state backup.
        """
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "topics")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def record_group_start(self, app: str, topic: str, partition: int, stream: str) -> None:
        """Remember where the app's group began in a stream it never read before.

        Entries before it were never meant to be applied. The first worker to record it wins.
        """
        mine = self.stream_info(stream).groups.get(app)
        if mine is not None:
            with self.translate_errors():
                self.client.hsetnx(keys.app_key(app), f"start:{topic}:{partition}", mine.last_delivered_id)

    def group_start(self, app: str, topic: str, partition: int) -> keys.StreamId | None:
        """Where the app's group began in that stream (``record_group_start``), if recorded."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), f"start:{topic}:{partition}")
        return None if raw is None else keys.StreamId.parse(raw)

    def app_partitions(self, app: str) -> int:
        """The partition count an app was last run with; NotFound if it never ran here."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "partitions")
        if raw is None:
            raise NotFound(f"app {app!r} has never run against the broker at {self.url}")
        return int(raw)

    def stream_info(self, stream: str) -> StreamInfo:
        """Length, last entry id and consumer groups of a stream (zero and none if absent)."""
        with self.translate_errors(stream):
            if not self.client.exists(stream):
                return StreamInfo(0, None, {})
            info = self.client.xinfo_stream(stream)
            groups = self.client.xinfo_groups(stream)
        return StreamInfo(
            int(info["length"]),
            info.get("last-generated-id"),
            {
                _text(g["name"]): GroupInfo(int(g["consumers"]), int(g["pending"]), g["last-delivered-id"])
                for g in groups
            },
        )

    def last_id(self, stream: str) -> bytes | None:
        """The stream's last generated id (also of deleted entries); None when it does not exist."""
        return self.stream_info(stream).last_id

    def group_position(self, stream: str, group: str) -> GroupPosition:
        """Length, last id, lag and pending of ``group`` in ``stream``, in one or two round trips."""
        with self.translate_errors(stream):
            pipe = self.client.pipeline(transaction=False)
            pipe.xinfo_stream(stream)
            pipe.xinfo_groups(stream)
            try:
                info, groups = pipe.execute()
            except redis.ResponseError as exc:
                if "no such key" not in str(exc):
                    raise
                return GroupPosition(0, None, None, 0, 0, None, 0)
            mine = next((g for g in groups if _text(g["name"]) == group), None)
            length, last_id = int(info["length"]), info.get("last-generated-id")
            if mine is None:
                return GroupPosition(length, last_id, None, length, 0, None, 0)
            pending = int(mine["pending"])
            oldest = None
            if pending:
                summary = self.client.xpending(stream, group)
                oldest = summary.get("min")
            delivered = mine["last-delivered-id"]
            undelivered = mine.get("lag")  # Redis 7+ and Valkey; nil after some deletions
            if undelivered is None:
                undelivered = self.count_after(stream, delivered)
        return GroupPosition(
            length, last_id, delivered, int(undelivered), pending, oldest, int(mine["consumers"])
        )

    def count_after(self, stream: str, after: bytes | str) -> int:
        """Entries after ``after``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return self._count(stream, str(keys.StreamId.parse(after).next()), "+")

    def count_before(self, stream: str, before: keys.StreamId) -> int:
        """Entries with an id below ``before``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return 0 if before == keys.ZERO_ID else self._count(stream, "-", str(before.previous()))

    def _count(self, stream: str, start: str, end: str) -> int:
        counted = 0
        while counted < LAG_COUNT_LIMIT:
            with self.translate_errors(stream):
                page = cast(list[tuple[bytes, Any]], self.client.xrange(stream, start, end, 1000))
            counted += len(page)
            if len(page) < 1000:
                break
            start = str(keys.StreamId.parse(page[-1][0]).next())
        return min(counted, LAG_COUNT_LIMIT)

    def existing_keys(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` that exist (one EXISTS each, pipelined: keys of any slots)."""
        with self.translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            found = pipe.execute()
        return [name for name, exists in zip(names, found, strict=True) if exists]

    def delete_app(self, app: str, streams: Sequence[str], names: Sequence[str]) -> None:
        """Destroy ``app``'s group on ``streams``, delete ``names`` and its entry in the app registry."""
        with self.translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for stream in streams:
                pipe.xgroup_destroy(stream, app)
            for name in names:
                pipe.delete(name)
            pipe.srem(keys.APPS_KEY, app)
            pipe.execute()

    def delete_topic(self, topic: str, names: Sequence[str]) -> None:
        """Delete ``names`` (a topic's keys) and the topic's entry in the topic registry."""
        with self.translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.srem(keys.TOPICS_KEY, topic)
            pipe.execute()

    def group_consumers(self, stream: str, group: str) -> list[tuple[str, int, int]]:
        """(name, pending, idle ms) of each consumer of ``group`` in ``stream`` (XINFO CONSUMERS)."""
        with self.translate_errors(stream):
            found = self.client.xinfo_consumers(stream, group)
        return [(_text(c["name"]), int(c["pending"]), int(c["idle"])) for c in found]

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        """XGROUP DELCONSUMER; the pending entries it dropped (call it only for one with none)."""
        with self.translate_errors(stream):
            return int(self.client.xgroup_delconsumer(stream, group, consumer))

    def list_apps(self) -> list[str]:
        with self.translate_errors():
            return sorted(_text(a) for a in self.client.smembers(keys.APPS_KEY))

    def reset_group(self, stream: str, group: str, position: str) -> None:
        """Re-create ``group`` at ``position`` with an empty pending list, atomically.

        XGROUP SETID alone would keep the pending entries, which would then be delivered
        before the entries they follow.
        """
        with self.translate_errors(stream):
            pipe = self._on(stream).pipeline(transaction=True)
            pipe.xgroup_destroy(stream, group)
            pipe.xgroup_create(stream, group, id=position, mkstream=True)
            pipe.execute()

    def has_backlog(self, stream: str, group: str) -> bool:
        """Whether ``group`` has pending or not yet delivered entries in ``stream``."""
        info = self.stream_info(stream)
        mine = info.groups.get(group)
        if mine is None:
            return info.length > 0
        if mine.pending:
            return True
        delivered = keys.StreamId.parse(mine.last_delivered_id)
        return info.last_id is not None and keys.StreamId.parse(info.last_id) > delivered

    # -- groups ---------------------------------------------------------------------------------

    def move_last_id(self, stream: str, last_id: str) -> None:
        """Raise an existing stream's last generated id to ``last_id`` (XSETID)."""
        with self.translate_errors(stream):
            self.client.execute_command("XSETID", stream, last_id)

    def ensure_group(self, stream: str, group: str, start_id: str) -> None:
        """Create the consumer group (and the stream) unless it exists."""
        with self.translate_errors(stream):
            try:
                self.client.xgroup_create(stream, group, id=start_id, mkstream=True)
            except redis.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise
