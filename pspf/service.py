"""Operations the CLI (and later the admin API) offer, written once, returning msgspec records."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import ConfigError, NotFound
from pspf.processor import STATE_NAMESPACE
from pspf.producer import Producer
from pspf.settings import Settings
from state_stores import open_store, stored_partitions

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


class Service:
    """Topic, produce and state operations over one broker and one state directory."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._broker: Broker | None = None

    @property
    def broker(self) -> Broker:
        if self._broker is None:
            self._broker = Broker(self.settings.redis)
        return self._broker

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()

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

    def describe_topic(self, name: str) -> TopicDescription:
        count = self.broker.topic_partitions(name)
        partitions = []
        for partition in range(count):
            stream = keys.stream_key(name, partition)
            length, last_id, groups = self.broker.stream_info(stream)
            partitions.append(
                PartitionInfo(
                    partition=partition,
                    stream=stream,
                    length=length,
                    last_id=last_id.decode() if last_id else None,
                    groups=[
                        GroupInfo(
                            name=g["name"].decode(),
                            consumers=int(g["consumers"]),
                            pending=int(g["pending"]),
                            last_delivered_id=g["last-delivered-id"].decode(),
                        )
                        for g in groups
                    ],
                )
            )
        return TopicDescription(name=name, partitions=partitions, length=sum(p.length for p in partitions))

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
                        f"line {number}: {exc} ({producer.sent} entries written before it)"
                    ) from None
                producer.send_raw(topic, line, key)
        return producer.sent

    def produce(self, topic: str, value: bytes, key: str | None = None) -> None:
        """Write one JSON value."""
        _line_key(value, None)
        with Producer(self.broker) as producer:
            producer.send_raw(topic, value, key)

    # -- state ----------------------------------------------------------------------------------

    def state_get(self, app: str, key: str) -> dict[str, Any]:
        """The state of ``key`` in ``app``, read from its partition's store without locking it."""
        keys.check_name("app", app)
        partition = keys.partition_for(key.encode(), self.broker.app_partitions(app))
        with open_store(
            self.settings.state.engine, self.settings.state.dir, app, partition, readonly=True
        ) as store:
            raw = store.get(STATE_NAMESPACE, key)
        if raw is None:
            raise NotFound(f"app {app!r} has no state for key {key!r}")
        return codec.state_decoder.decode(raw)

    def state_keys(self, app: str, prefix: str = "", limit: int | None = None) -> list[str]:
        """The keys that have state in ``app``, over every partition store found, sorted."""
        keys.check_name("app", app)
        state = self.settings.state
        partitions = stored_partitions(state.engine, state.dir, app)
        if not partitions:
            raise NotFound(f"no state for app {app!r} under {state.dir}")
        found: list[str] = []
        for partition in partitions:
            with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                found.extend(key for key, _ in store.items(STATE_NAMESPACE, prefix))
        found.sort()
        return found if limit is None else found[:limit]


def _line_key(line: bytes, key_field: str | None) -> str | None:
    """Check that ``line`` is JSON and pick its key field, if asked."""
    try:
        record = _json_any.decode(line)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc}") from None
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
