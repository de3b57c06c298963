"""A Spark 4 Python data source, ``format("pspf")``, that writes DataFrames into PSPF topics.

Each row becomes one entry in PSPF's wire format (the ``key`` column as the key, the other columns,
or a chosen ``value`` column or ``columns`` list, as the JSON value), in the partition PSPF's
partition function picks, written with pipelined XADDs per chunk of rows. Options are checked on
the driver before any task runs.

Idempotence. In streaming, each task writes its rows in chunks; each chunk of each topic partition
goes in one Lua call together with a marker keyed by (query id, micro-batch id, Spark partition,
chunk number) that counts the chunk's entries already added: when Spark replays a micro-batch or
retries a task, entries already written are skipped and the ones a failed attempt did not reach
(its input can end early) are added, so nothing is written twice and nothing is missed, provided a
replayed Spark partition yields its rows in the same order (true for replayable sources read
without a nondeterministic shuffle). In batch mode a
retried task writes its rows again unless the ``idempotency_key`` option names the write; with it,
the same markers make a retried task, or the whole job run again with the same key, write nothing
twice. Markers expire after ``marker_ttl_s`` (7 days by default).

Needs pyspark 4 and pyarrow (``pip install 'pspf[spark]'``) and Java 17+. ``import pspf`` does not
import this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pspf import keys
from pspf.broker import Broker
from pspf.codec import KEY, VALUE
from pspf.errors import ConfigError
from pspf.settings import RedisSettings, check_broker_url, mask_url

try:
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceStreamWriter,
        DataSourceWriter,
        WriterCommitMessage,
    )
    from pyspark.sql.types import BinaryType, StringType, StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark sink needs pyspark 4 and pyarrow: pip install 'pspf[spark]'") from exc

NAME = "pspf"
_CHUNK_ROWS = 2_000
_DEFAULT_MARKER_TTL_S = 7 * 24 * 3600


def register(spark: SparkSession) -> None:
    """Make ``format("pspf")`` available in this Spark session."""
    spark.dataSource.register(PSPFDataSource)


@dataclass(frozen=True)
class SinkOptions:
    """The validated options of one write; sent to every task."""

    url: str
    topic: str
    partitions: int
    key: str | None
    value: str | None
    columns: tuple[str, ...]
    maxlen: str
    minid: str
    idempotency_key: str | None
    marker_ttl_s: int


def _options(options: dict[str, str], schema: StructType) -> SinkOptions:
    """Check the options against the schema and the broker, on the driver."""
    known = {
        "broker",
        "topic",
        "key",
        "value",
        "columns",
        "maxlen",
        "minid",
        "idempotency_key",
        "marker_ttl_s",
    }
    unknown = sorted(set(options) - known - {"path", "checkpointlocation"})
    if unknown:
        raise ConfigError(f"unknown pspf sink option(s) {unknown}; known: {sorted(known)}")
    topic = options.get("topic")
    if not topic:
        raise ConfigError('the pspf sink needs .option("topic", ...)')
    keys.check_name("topic", topic)
    url = options.get("broker", RedisSettings().url)
    check_broker_url(url)
    names = set(schema.fieldNames())
    key = options.get("key")
    value = options.get("value")
    columns = tuple(c.strip() for c in options.get("columns", "").split(",") if c.strip())
    for option, column in [("key", key), ("value", value), *(("columns", c) for c in columns)]:
        if column is not None and column not in names:
            raise ConfigError(f"{option} column {column!r} is not in the DataFrame: {sorted(names)}")
    if value and columns:
        raise ConfigError("give the value as one column (value) or as a column list (columns), not both")
    maxlen, minid = options.get("maxlen", ""), options.get("minid", "")
    if maxlen and not maxlen.isdigit():
        raise ConfigError(f"maxlen must be a whole number, not {maxlen!r}")
    if maxlen and minid:
        raise ConfigError("give maxlen or minid, not both")
    if minid:
        keys.StreamId.parse(minid)
    ttl = options.get("marker_ttl_s", str(_DEFAULT_MARKER_TTL_S))
    if not ttl.isdigit() or int(ttl) <= 0:
        raise ConfigError(f"marker_ttl_s must be a positive number of seconds, not {ttl!r}")
    broker = Broker(RedisSettings(url=url))
    try:
        partitions = broker.topic_partitions(topic)
    finally:
        broker.close()
    return SinkOptions(
        url=url,
        topic=topic,
        partitions=partitions,
        key=key,
        value=value,
        columns=columns,
        maxlen=maxlen,
        minid=minid,
        idempotency_key=options.get("idempotency_key"),
        marker_ttl_s=int(ttl),
    )


class PSPFDataSource(DataSource):
    """``format("pspf")``: writes rows into a PSPF topic (batch and streaming)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return PSPFBatchWriter(_options(dict(self.options), schema), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return PSPFStreamWriter(_options(dict(self.options), schema), schema)


@dataclass
class SinkCommitMessage(WriterCommitMessage):
    written: int
    skipped_chunks: int


class _Encoder:
    """Turns rows into (partition, entry fields) with the options' key and value choice."""

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.json = msgspec.json.Encoder()
        value_field = schema[options.value] if options.value else None
        self.raw_value = value_field is not None and isinstance(value_field.dataType, StringType | BinaryType)
        self.round_robin = itertools.count()
        if options.columns:
            self.columns: tuple[str, ...] | None = options.columns
        elif options.value:
            self.columns = None
        else:
            self.columns = tuple(n for n in schema.fieldNames() if n != options.key)

    def encode(self, row: Any) -> tuple[int, dict[bytes, bytes]]:
        record = row.asDict(recursive=True)
        fields: dict[bytes, bytes] = {}
        partition = next(self.round_robin) % self.options.partitions
        if self.options.key is not None and record.get(self.options.key) is not None:
            raw_key = record[self.options.key]
            key = bytes(raw_key) if isinstance(raw_key, bytes | bytearray) else str(raw_key).encode()
            fields[KEY] = key
            partition = keys.partition_for(key, self.options.partitions)
        if self.columns is not None:
            fields[VALUE] = self.json.encode({c: record[c] for c in self.columns})
        else:
            value = record[self.options.value or ""]
            if self.raw_value and isinstance(value, str):
                fields[VALUE] = value.encode()
            elif self.raw_value and isinstance(value, bytes | bytearray):
                fields[VALUE] = bytes(value)
            else:
                fields[VALUE] = self.json.encode(value)
        return partition, fields


def _write_task(
    options: SinkOptions, schema: StructType, rows: Iterator[Any], token: str | None
) -> SinkCommitMessage:
    """Write one task's rows chunk by chunk; with a ``token``, each chunk at most once."""
    from pyspark import TaskContext

    context = TaskContext.get()
    spark_partition = context.partitionId() if context is not None else 0
    encoder = _Encoder(options, schema)
    broker = Broker(RedisSettings(url=options.url))
    written = skipped = 0
    try:
        for chunk_number in itertools.count():
            chunk = list(itertools.islice(rows, _CHUNK_ROWS))
            if not chunk:
                break
            by_partition: dict[int, list[dict[bytes, bytes]]] = {}
            for row in chunk:
                partition, fields = encoder.encode(row)
                by_partition.setdefault(partition, []).append(fields)
            for partition, entries in by_partition.items():
                stream = keys.stream_key(options.topic, partition)
                if token is None:
                    broker.add_entries(
                        [(stream, fields) for fields in entries], options.maxlen, options.minid
                    )
                    written += len(entries)
                    continue
                marker = keys.sink_marker_key(
                    options.topic, partition, f"{token}:{spark_partition}:{chunk_number}"
                )
                added = broker.add_entries_once(
                    stream, marker, entries, options.marker_ttl_s, options.maxlen, options.minid
                )
                written += added
                skipped += int(added == 0 and bool(entries))
    except Exception as exc:
        # Say where, never how to log in: the URL is masked.
        raise RuntimeError(
            f"pspf sink writing to {mask_url(options.url)} topic {options.topic!r} failed: {exc}"
        ) from None
    finally:
        broker.close()
    return SinkCommitMessage(written=written, skipped_chunks=skipped)


class PSPFBatchWriter(DataSourceWriter):
    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def write(self, iterator: Iterator[Any]) -> SinkCommitMessage:
        token = None if self.options.idempotency_key is None else f"batch:{self.options.idempotency_key}"
        return _write_task(self.options, self.schema, iterator, token)


class PSPFStreamWriter(DataSourceStreamWriter):
    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def write(self, iterator: Iterator[Any]) -> SinkCommitMessage:
        from pyspark import TaskContext

        context = TaskContext.get()
        query = context.getLocalProperty("sql.streaming.queryId") if context else None
        batch = context.getLocalProperty("streaming.sql.batchId") if context else None
        if query is None or batch is None:
            raise RuntimeError("the pspf stream writer runs outside a streaming query")
        return _write_task(self.options, self.schema, iterator, f"stream:{query}:{batch}")

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: each chunk was committed with its marker."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: the replay skips the chunks already written."""
