"""Topics and producing: create, list, describe, retention and trimming; writing JSON entries.

Also ``health``, whether Redis answers. A topic named by a user is checked here (a malformed name
is their mistake, a ``ConfigError``); a produced line must be JSON, with its key field when one
is asked for, and a bad line stops a run with its line number after the lines before it are sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

from pspf import keys
from pspf.errors import ConfigError, ParameterError
from pspf.producer import Producer
from pspf.service.base import Family, json_any
from pspf.service.records import Health, PartitionInfo, TopicDescription, TopicInfo, TopicTrim
from pspf.service.wording import counted
from pspf.worker import retention
from pspf.worker.retention import Retention


class Topics(Family):
    """Topic and produce operations."""

    def create_topic(self, name: str, partitions: int) -> tuple[TopicInfo, bool]:
        """Create a topic; also returns False when it already existed with that partition count."""
        keys.check_name("topic", name)
        if not 1 <= partitions <= keys.MAX_PARTITIONS:
            raise ParameterError(
                "invalid {partitions} {count}: give 1 to {most}", count=partitions, most=keys.MAX_PARTITIONS
            )
        created = self.broker.topics.create_topic(name, partitions)
        return TopicInfo(name=name, partitions=partitions), created

    def list_topics(self) -> list[TopicInfo]:
        return [
            TopicInfo(name=name, partitions=self.broker.topics.topic_partitions(name))
            for name in self.broker.topics.list_topics()
        ]

    def describe_topic(self, name: str) -> TopicDescription:
        count = self.base.topic_partitions(name)
        partitions = []
        for partition in range(count):
            stream = keys.stream_key(name, partition)
            partitions.append(PartitionInfo.of(partition, stream, self.broker.topics.stream_info(stream)))
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
        self.base.topic_partitions(name)
        retention.store(self.broker, name, wanted)
        return retention.stored(self.broker, name)

    def trim_topic(self, name: str, dry_run: bool = False, override: Retention | None = None) -> TopicTrim:
        """Trim a topic's partitions by its retention (or ``override``), never past what is needed."""
        count = self.base.topic_partitions(name)
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

    def produce_lines(self, topic: str, lines: Iterable[bytes], key_field: str | None = None) -> int:
        """Write NDJSON lines as entries (the line is the value); the number written.

        Each line must be JSON; with ``key_field`` it must be an object whose field is the key.
        A bad line stops the run with its line number; the lines before it are written.
        """
        with Producer(self.broker, batch_size=2000) as producer:
            producer.broker.topics.topic_partitions(topic)
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

    def produce(
        self, topic: str, value: bytes, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Write one JSON value."""
        _line_key(value, None)
        with Producer(self.broker) as producer:
            producer.send_raw(topic, value, key, headers)

    def health(self) -> Health:
        """Whether Redis answers, and how fast."""
        started = time.perf_counter()
        info = self.broker.conn.check_server()
        elapsed_ms = (time.perf_counter() - started) * 1000
        return Health(status="ok", redis_version=info.version, latency_ms=elapsed_ms, server=info.name)


def _line_key(line: bytes, key_field: str | None) -> str | None:
    """Check that ``line`` is JSON and pick its key field, if asked."""
    try:
        record = json_any.decode(line)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"invalid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"invalid JSON: not valid UTF-8 ({exc.reason})") from None
    if key_field is None:
        return None
    if not isinstance(record, dict):
        raise ConfigError(f"expected a JSON object with field {key_field!r}")
    if key_field not in record:
        raise ConfigError(f"no field {key_field!r}")
    key = record[key_field]
    if key is None:
        raise ConfigError(f"field {key_field!r} is null: a key must be a string or an integer")
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise ConfigError(f"field {key_field!r} must be a string or an integer")
