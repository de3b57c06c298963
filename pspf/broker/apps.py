"""Apps' records and their consumer groups: what an app reads, where its groups began.

Apps are recorded in hashes (``keys.app_key``) so operators find an app's topics, partition count,
tables and state by its name alone. A group's start in a stream it never read before is recorded
once (``record_group_start``): entries before it were never meant to be applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import _text
from pspf.broker.topics import Topics
from pspf.errors import NotFound


class Apps:
    """Apps' records (topics, tables, sinks, group starts) and their groups in the streams."""

    def __init__(self, conn: Connection, topics: Topics) -> None:
        self.conn = conn
        #: the streams' positions (a group's start is recorded from them)
        self.topics = topics

    def register_app(
        self,
        app: str,
        topics: list[str],
        partitions: int,
        tables: list[str] | None = None,
        global_tables: list[str] | None = None,
        managed: list[str] | None = None,
        views: list[str] | None = None,
    ) -> None:
        """Record what an app reads, so operators can find its state by app name alone.

        ``tables``: those of ``topics`` the app reads as tables; ``global_tables``: the topics it
        reads whole into each worker's own store (None leaves the record's as is); ``managed``:
        the topics its streams re-key through, which it created and ``pspf app delete`` deletes;
        ``views``: the Redis keys of its views (``App.view``), which ``pspf app delete`` deletes too.
        """
        mapping: dict[str, str | int] = {"topics": ",".join(topics), "partitions": partitions}
        if managed is not None:
            mapping["managed"] = ",".join(managed)
        if views is not None:
            mapping["views"] = "\n".join(views)  # a view's name may hold any character but a newline
        if tables is not None:
            mapping["tables"] = ",".join(tables)
        if global_tables is not None:
            mapping["global_tables"] = ",".join(global_tables)
        with self.conn.translate_errors():
            self.conn.client.hset(keys.app_key(app), mapping=mapping)
            self.conn.client.sadd(keys.APPS_KEY, app)

    def mark_sink(self, app: str, target: str) -> None:
        """Record that ``app`` is a sink delivering into ``target``: its checkpoints live there."""
        with self.conn.translate_errors():
            self.conn.client.hset(keys.app_key(app), "sink", target)

    def app_sink(self, app: str) -> str | None:
        """What the sink ``app`` delivers into (``mark_sink``); None for an app that is no sink."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "sink")
        return _text(raw) if raw else None

    def app_managed(self, app: str) -> list[str]:
        """The re-keying topics an app's streams write and read (created by it), as last recorded."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "managed")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def state_schemas(self, app: str) -> bytes | None:
        """The JSON list of the state schemas an app's stores may still hold (``pspf.contracts``)."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "state_schemas")
        return None if raw is None else bytes(raw)

    def record_state_schemas(self, app: str, raw: bytes) -> None:
        with self.conn.translate_errors():
            self.conn.client.hset(keys.app_key(app), "state_schemas", raw)

    def record_asyncapi(self, app: str, raw: bytes) -> None:
        """Keep the app's AsyncAPI document (``pspf.contracts.asyncapi``), as its last worker made it."""
        with self.conn.translate_errors():
            self.conn.client.hset(keys.app_key(app), "asyncapi", raw)

    def app_asyncapi(self, app: str) -> bytes | None:
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "asyncapi")
        return None if raw is None else bytes(raw)

    def request_stop(self, app: str, by: str | None) -> None:
        """Ask the app's workers to stop (``by``: who asks), or take the request back (None).

        Each worker looks at its next lease round and stops as on SIGTERM; one started while the
        request stands stops before it takes a partition.
        """
        with self.conn.translate_errors():
            if by is None:
                self.conn.client.hdel(keys.app_key(app), "stop")
            else:
                self.conn.client.hset(keys.app_key(app), "stop", by)

    def stop_requested(self, app: str) -> str | None:
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "stop")
        return None if raw is None else _text(raw)

    def app_views(self, app: str) -> list[str]:
        """The Redis keys of an app's views, as its workers last recorded them."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "views")
        return [v for v in _text(raw).split("\n") if v] if raw else []

    def app_tables(self, app: str) -> list[str]:
        """The topics an app reads as tables (co-partitioned), as its workers last recorded."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "tables")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def app_global_tables(self, app: str) -> list[str] | None:
        """The app's global tables, as its workers last recorded; None when none recorded them."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "global_tables")
        return None if raw is None else [t for t in _text(raw).split(",") if t]

    def app_topics(self, app: str) -> set[str]:
        """The topics an app read when it last ran here (empty if it never ran)."""
        return set(self.app_topic_list(app))

    def app_topic_list(self, app: str) -> list[str]:
        """The topics an app read when it last ran here, in the app's order.

        The first one's partitions carry the app's state backup.
        """
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "topics")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def app_partitions(self, app: str) -> int:
        """The partition count an app was last run with; NotFound if it never ran here."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), "partitions")
        if raw is None:
            raise NotFound(f"app {app!r} has never run against the broker at {self.conn.url}")
        return int(raw)

    def list_apps(self) -> list[str]:
        with self.conn.translate_errors():
            return sorted(_text(a) for a in self.conn.client.smembers(keys.APPS_KEY))

    def delete_app(self, app: str, streams: Sequence[str], names: Sequence[str]) -> None:
        """Destroy ``app``'s group on ``streams``, delete ``names`` and its entry in the app registry."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for stream in streams:
                pipe.xgroup_destroy(stream, app)
            for name in names:
                pipe.delete(name)
            pipe.srem(keys.APPS_KEY, app)
            pipe.execute()

    def record_group_start(self, app: str, topic: str, partition: int, stream: str) -> None:
        """Remember where the app's group began in a stream it never read before.

        Entries before it were never meant to be applied. The first worker to record it wins.
        """
        mine = self.topics.stream_info(stream).groups.get(app)
        if mine is not None:
            with self.conn.translate_errors():
                self.conn.client.hsetnx(
                    keys.app_key(app), f"start:{topic}:{partition}", mine.last_delivered_id
                )

    def group_start(self, app: str, topic: str, partition: int) -> keys.StreamId | None:
        """Where the app's group began in that stream (``record_group_start``), if recorded."""
        with self.conn.translate_errors():
            raw = self.conn.client.hget(keys.app_key(app), f"start:{topic}:{partition}")
        return None if raw is None else keys.StreamId.parse(raw)

    def ensure_group(self, stream: str, group: str, start_id: str) -> None:
        """Create the consumer group (and the stream) unless it exists."""
        with self.conn.translate_errors(stream):
            try:
                self.conn.client.xgroup_create(stream, group, id=start_id, mkstream=True)
            except redis.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

    def reset_group(self, stream: str, group: str, position: str) -> None:
        """Re-create ``group`` at ``position`` with an empty pending list, atomically.

        XGROUP SETID alone would keep the pending entries, which would then be delivered
        before the entries they follow.
        """
        with self.conn.translate_errors(stream):
            pipe = self.conn.on(stream).pipeline(transaction=True)
            pipe.xgroup_destroy(stream, group)
            pipe.xgroup_create(stream, group, id=position, mkstream=True)
            pipe.execute()

    def group_consumers(self, stream: str, group: str) -> list[tuple[str, int, int]]:
        """(name, pending, idle ms) of each consumer of ``group`` in ``stream`` (XINFO CONSUMERS)."""
        with self.conn.translate_errors(stream):
            found = self.conn.client.xinfo_consumers(stream, group)
        return [(_text(c["name"]), int(c["pending"]), int(c["idle"])) for c in found]

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        """XGROUP DELCONSUMER; the pending entries it dropped (call it only for one with none)."""
        with self.conn.translate_errors(stream):
            return int(self.conn.client.xgroup_delconsumer(stream, group, consumer))
