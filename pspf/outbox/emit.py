"""What ``ctx.emit`` makes of an entry: checked, encoded, its partition picked, its source named.

``Emitter`` turns each ``ctx.emit`` (and a closed window's result) into an ``Emitted`` tuple, the
form an outbox page stores; it checks the target topic (its partition count is cached per
emitter), encodes the value as ``Producer.send`` does (JSON; bytes as they are), and picks the
target partition: the key's (CRC32 of the key, modulo the topic's count), else the source
entry's partition number modulo the count. A topic, value, key or header that cannot be emitted
raises ``EmitError`` in the handler, which fails like any handler error (retries, then the DLQ); a
value that does not match the target topic's schema (``pspf.contracts``) raises ``SchemaError``.

Every emitted entry carries the ``pspf-source-*`` headers naming the entry it came from
(``SourceHeaders``): merged into the handler's own headers when it gave some (then stored with
the row), else made when the row is published or shown.

This module knows nothing of how rows are stored (``pspf.outbox.rows``) or published
(``pspf.outbox.relay``), nor of the context that calls it (``pspf.context``): it is below all three.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pspf import codec, keys
from pspf.errors import ConfigError, NotFound, PSPFError

if TYPE_CHECKING:
    from pspf.broker import Fields
    from pspf.contracts.schema import Checker

#: Headers every emitted entry carries: where it came from.
SOURCE_APP_HEADER = "pspf-source-app"
SOURCE_TOPIC_HEADER = "pspf-source-topic"
SOURCE_PARTITION_HEADER = "pspf-source-partition"
SOURCE_ID_HEADER = "pspf-source-id"

#: An emitted entry, as an outbox page stores it: (topic, partition, key or None, value, source
#: topic, source entry id, headers or None). Headers are stored only when the handler gave some
#: (merged with the source headers); else they are the source headers, made when the row is
#: published or shown.
Emitted = tuple[str, int, bytes | None, bytes, str, bytes, bytes | None]


class EmitError(PSPFError):
    """``ctx.emit`` was given a topic or value it cannot emit: the entry fails like any error."""


class SourceHeaders:
    """The ``pspf-source-*`` headers of a partition's rows, made without a JSON encoding per row."""

    def __init__(self, app: str, partition: int) -> None:
        self.app = app
        self.partition = partition
        #: per source topic, what ``head`` returns
        self.heads: dict[str, bytes] = {}

    def of(self, row: Emitted) -> bytes:
        """The headers field of a row."""
        given = row[6]
        if given is not None:
            return given
        return self.head(row[4]) + row[5] + b'"}'

    def head(self, source_topic: str) -> bytes:
        """The headers' JSON up to the source entry id's value (ids need no escaping)."""
        head = self.heads.get(source_topic)
        if head is None:
            encoded = codec.json_encoder.encode({**self.source(source_topic, ""), SOURCE_ID_HEADER: ""})
            head = self.heads[source_topic] = encoded[: -len(b'"}')]
        return head

    def source(self, source_topic: str, source_id: str) -> dict[str, str]:
        return {
            SOURCE_APP_HEADER: self.app,
            SOURCE_TOPIC_HEADER: source_topic,
            SOURCE_PARTITION_HEADER: str(self.partition),
            SOURCE_ID_HEADER: source_id,
        }

    def fields(self, row: Emitted) -> Fields:
        """The stream fields of a row, as published."""
        fields: Fields = {} if row[2] is None else {codec.KEY: row[2]}
        fields[codec.VALUE] = row[3]
        fields[codec.HEADERS] = self.of(row)
        return fields


class Topics(Protocol):
    """Where an emitter finds a topic's partition count: the broker (``pspf.testing``: its own).

    ``topic_layout``: (partition count, layout generation, whether a repartition of it runs).
    """

    def topic_layout(self, topic: str) -> tuple[int, str, bool]: ...


class Emitter:
    """Turns ``ctx.emit`` calls into rows: checks the topic, encodes, picks the partition.

    It routes with each topic's count as first read, and ``layouts`` names the layout generation
    that count belongs to: the relay publishes in it, and after a repartition (the target refused
    the generation) ``refresh`` reads the new count, so rows emitted from then on are routed in
    the new layout and the relay re-routes the ones before (``PartitionOutbox.reroute``).
    """

    def __init__(
        self, topics: Topics, app: str, schemas: Callable[[str], Checker | None] | None = None
    ) -> None:
        self.topics = topics
        self.app = app
        #: a topic's current schema, read once per topic (``pspf.contracts``); None: no checks
        self.schemas = schemas
        self._checks: dict[str, Checker | None] = {}
        self._partitions: dict[str, int] = {}
        #: topic -> the layout generation its known count belongs to
        self.layouts: dict[str, str] = {}

    def partitions(self, topic: str) -> int:
        known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            keys.check_name("topic", topic)
            count, layout, _ = self.topics.topic_layout(topic)
        except (ConfigError, NotFound) as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {exc}") from None
        self._partitions[topic], self.layouts[topic] = count, layout
        self._checks[topic] = None if self.schemas is None else self.schemas(topic)
        return count

    def refresh(self, topic: str) -> bool:
        """Read a topic's count and layout again; whether it moved to another layout.

        While a repartition of it runs the old count stays (the rows wait for the switch).
        """
        count, layout, moving = self.topics.topic_layout(topic)
        if moving or layout == self.layouts.get(topic):
            return False
        self._partitions[topic], self.layouts[topic] = count, layout
        return True

    def entry(
        self,
        source_topic: str,
        source_partition: int,
        source_id: bytes,
        topic: str,
        value: Any,
        key: str | None,
        headers: dict[str, str] | None,
    ) -> Emitted:
        """One emitted entry, as its page stores it (this runs for every emit: kept lean).

        ``source_*``: the entry (or timer run) that emits it: its topic, partition and stream id.
        """
        partitions = self._partitions.get(topic) or self.partitions(topic)
        try:
            # a dict, the common value, skips the bytes check (isinstance of a tuple costs more)
            if type(value) is not dict and isinstance(value, _BYTES_LIKE):
                encoded = bytes(value)
            else:
                encoded = _json_encode(value)
            checker = self._checks.get(topic)
            if checker is not None:  # a SchemaError fails the entry: to the DLQ at once
                checker.check(encoded)
            given = None
            if headers:
                source = SourceHeaders(self.app, source_partition).source(source_topic, source_id.decode())
                given = codec.entry_fields(b"", None, {**headers, **source})[codec.HEADERS]
            if key is None:
                return (topic, source_partition % partitions, None, encoded, source_topic, source_id, given)
            key_bytes = key.encode()
        except (TypeError, UnicodeEncodeError, msgspec.EncodeError, ConfigError) as exc:
            raise EmitError(f"cannot emit to topic {topic!r}: {_emit_error(exc, value, key)}") from None
        return (topic, _crc32(key_bytes) % partitions, key_bytes, encoded, source_topic, source_id, given)

    def result(self, topic: str, key: str, value: Any, source: tuple[str, bytes], partition: int) -> Emitted:
        """A closed window's result, its source the entry that moved stream time past it."""
        partitions = self._partitions.get(topic) or self.partitions(topic)
        encoded = _json_encode(value)
        checker = self._checks.get(topic)
        if checker is not None:
            checker.check(encoded)
        source_topic, source_id = source
        if not key:
            return (topic, partition % partitions, None, encoded, source_topic, source_id, None)
        key_bytes = key.encode()
        return (topic, zlib.crc32(key_bytes) % partitions, key_bytes, encoded, source_topic, source_id, None)


_json_encode = codec.json_encoder.encode
_crc32 = zlib.crc32
_BYTES_LIKE = (bytes, bytearray, memoryview)


def _emit_error(exc: Exception, value: Any, key: str | None) -> str:
    """What was wrong with an emit, as the producer's checks say it."""
    if isinstance(exc, ConfigError):
        return str(exc)
    try:
        codec.encode_value(value)
        if key is not None:
            codec.encode_text("key", key)
    except ConfigError as error:
        return str(error)
    return str(exc)
