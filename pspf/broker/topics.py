"""Topics and their streams: records, retention, positions, trimming.

Topics are recorded in hashes (``keys.topic_key``) so their partitions, layout generation and
retention can be found by name; a topic's partition count is fixed when it is created (only a
repartition changes it, ``moving``). Stream and group positions (``stream_info``,
``group_position``) are what lag and the metrics report; ``partition_count`` (``counts``) reads
a topic's count through this family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import LAG_COUNT_LIMIT, GroupInfo, GroupPosition, StreamInfo, _text
from pspf.errors import AuthenticationFailed, BrokerError, BrokerUnavailable, ConfigError, NotFound


class Topics:
    """Topics' records and retention, their streams' lengths, positions and trimming."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def create_topic(self, topic: str, partitions: int) -> bool:
        """Record a topic; False when it exists already with the same partition count.

        Raises:
            ConfigError: it exists with another partition count (the request is at fault, not
                the broker).
        """
        with self.conn.translate_errors():
            created = self.conn.client.hsetnx(keys.topic_key(topic), "partitions", partitions)
            self.conn.client.sadd(keys.TOPICS_KEY, topic)
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
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.topic_key(topic), "partitions")
        if raw is None:
            raise NotFound(
                f"topic {topic!r} does not exist; create it with `pspf topic create {topic} --partitions N`"
            )
        return int(raw)

    def topic_layout(self, topic: str) -> tuple[int, str, bool]:
        """A topic's partition count, layout generation and whether a repartition of it runs."""
        with self.conn.translate_errors():
            raw = self.conn.client.hmget(keys.topic_key(topic), ["partitions", "layout", "moving"])
        if raw[0] is None:
            raise NotFound(
                f"topic {topic!r} does not exist; create it with `pspf topic create {topic} --partitions N`"
            )
        return int(raw[0]), (raw[1] or b"0").decode(), raw[2] is not None

    def reader_counts(self, topic: str) -> dict[str, int]:
        """The partition count each app that reads ``topic`` was built for, by its record (one round trip)."""
        with self.conn.translate_errors():
            apps = sorted(_text(a) for a in self.conn.client.smembers(keys.APPS_KEY))
            pipe = self.conn.client.pipeline(transaction=False)
            for app in apps:
                pipe.hmget(keys.app_key(app), ["topics", "partitions"])
            records = pipe.execute()
        return {
            app: int(built)
            for app, (read, built) in zip(apps, records, strict=True)
            if read is not None and built is not None and topic in _text(read).split(",")
        }

    def schemas(self, topic: str) -> dict[int, bytes]:
        """A topic's schema versions (``keys.schemas_key``): version -> its record's JSON."""
        with self.conn.translate_errors():
            found = self.conn.client.hgetall(keys.schemas_key(topic))
        return {int(_text(name)[1:]): raw for name, raw in found.items() if _text(name).startswith("v")}

    def add_schema(self, topic: str, version: int, record: bytes) -> bool:
        """Add version ``version``; False when another writer added it first (HSETNX: one wins)."""
        with self.conn.translate_errors():
            return bool(self.conn.client.hsetnx(keys.schemas_key(topic), f"v{version}", record))

    def list_topics(self) -> list[str]:
        with self.conn.translate_errors():
            return sorted(_text(t) for t in self.conn.client.smembers(keys.TOPICS_KEY))

    def topic_retention(self, topic: str) -> dict[str, str]:
        """A topic's stored retention fields (``retention.Retention``); empty when none is set."""
        with self.conn.translate_errors():
            raw = self.conn.client.hgetall(keys.topic_key(topic))
        return {
            _text(k)[len("retention:") :]: _text(v) for k, v in raw.items() if k.startswith(b"retention:")
        }

    def set_topic_retention(self, topic: str, fields: Mapping[str, str | None]) -> None:
        """Store retention fields of a topic (None removes one)."""
        key = keys.topic_key(topic)
        with self.conn.translate_errors(), self.conn.on(key).pipeline(transaction=True) as pipe:
            for name, value in fields.items():
                if value is None:
                    pipe.hdel(key, f"retention:{name}")
                else:
                    pipe.hset(key, f"retention:{name}", value)
            pipe.execute()

    def delete_topic(self, topic: str, names: Sequence[str]) -> None:
        """Delete ``names`` (a topic's keys) and the topic's entry in the topic registry."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.srem(keys.TOPICS_KEY, topic)
            pipe.execute()

    def stream_info(self, stream: str) -> StreamInfo:
        """Length, last entry id and consumer groups of a stream (zero and none if absent)."""
        with self.conn.translate_errors(stream), self.conn.client.pipeline(transaction=False) as pipe:
            pipe.exists(stream).xinfo_stream(stream).xinfo_groups(stream)  # one round trip
            exists, info, groups = pipe.execute(raise_on_error=False)
            if not exists:
                return StreamInfo(0, None, {})
            for reply in (info, groups):
                if isinstance(reply, Exception):
                    raise reply
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

    def stream_tally(self, stream: str) -> tuple[int, int | None, bytes | None, bytes | None]:
        """Length, entries ever added (Redis 7+, Valkey; None before), first and last id of a stream.

        Topic streams lose entries only to trimming, from their head: what was added and is not
        there any more was trimmed.
        """
        with self.conn.translate_errors(stream):
            try:
                info = self.conn.client.xinfo_stream(stream)
            except redis.ResponseError:
                return 0, 0, None, None  # no such stream: nothing was ever added
        added = info.get("entries-added")
        first = info.get("first-entry")
        return (
            int(info["length"]),
            None if added is None else int(added),
            None if not first else first[0],
            info.get("last-generated-id"),
        )

    def last_id_up_to(self, stream: str, at: keys.StreamId) -> bytes | None:
        """The id of the stream's last entry at or before ``at``; None when it holds none."""
        with self.conn.translate_errors(stream):
            found = self.conn.client.xrevrange(stream, str(at), "-", count=1)
        return found[0][0] if found else None

    def group_position(self, stream: str, group: str) -> GroupPosition:
        """Length, last id, lag and pending of ``group`` in ``stream``, in one or two round trips."""
        with self.conn.translate_errors(stream):
            pipe = self.conn.client.pipeline(transaction=False)
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
                summary = self.conn.client.xpending(stream, group)
                oldest = summary.get("min")
            delivered = mine["last-delivered-id"]
            undelivered = mine.get("lag")  # Redis 7+ and Valkey; nil after some deletions
            if undelivered is None:
                undelivered = self.count_after(stream, delivered)
        return GroupPosition(
            length, last_id, delivered, int(undelivered), pending, oldest, int(mine["consumers"])
        )

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

    def count_after(self, stream: str, after: bytes | str) -> int:
        """Entries after ``after``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return self._count(stream, str(keys.StreamId.parse(after).next()), "+")

    def count_before(self, stream: str, before: keys.StreamId) -> int:
        """Entries with an id below ``before``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return 0 if before == keys.ZERO_ID else self._count(stream, "-", str(before.previous()))

    def _count(self, stream: str, start: str, end: str) -> int:
        counted = 0
        while counted < LAG_COUNT_LIMIT:
            with self.conn.translate_errors(stream):
                page = cast(list[tuple[bytes, Any]], self.conn.client.xrange(stream, start, end, 1000))
            counted += len(page)
            if len(page) < 1000:
                break
            start = str(keys.StreamId.parse(page[-1][0]).next())
        return min(counted, LAG_COUNT_LIMIT)

    def existing_keys(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` that exist (one EXISTS each, pipelined: keys of any slots)."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            found = pipe.execute()
        return [name for name, exists in zip(names, found, strict=True) if exists]

    def server_time_ms(self) -> int:
        with self.conn.translate_errors():
            seconds, micros = self.conn.servers()[0].time()
        return int(seconds) * 1000 + int(micros) // 1000

    def stream_memory(self, stream: str) -> int | None:
        """The bytes a stream takes on its server (MEMORY USAGE); None where that is not allowed."""
        try:
            with self.conn.translate_errors(stream):
                used = self.conn.client.memory_usage(stream)
        except (BrokerUnavailable, AuthenticationFailed):
            raise
        except BrokerError:  # an ACL user without MEMORY USAGE
            return None
        return None if used is None else int(used)

    def nth_id(self, stream: str, n: int) -> bytes | None:
        """The id of the stream's n-th entry from its start (None when it has fewer)."""
        with self.conn.translate_errors(stream):
            entries = cast(list[tuple[bytes, Any]], self.conn.client.xrange(stream, "-", "+", n))
        return bytes(entries[-1][0]) if len(entries) == n else None

    def trim_before(self, stream: str, before: str) -> int:
        """Remove the stream's entries with ids below ``before`` (XTRIM MINID); how many went."""
        with self.conn.translate_errors(stream):
            return int(self.conn.client.xtrim(stream, minid=before, approximate=False))

    def move_last_id(self, stream: str, last_id: str) -> None:
        """Raise an existing stream's last generated id to ``last_id`` (XSETID)."""
        with self.conn.translate_errors(stream):
            self.conn.client.execute_command("XSETID", stream, last_id)
