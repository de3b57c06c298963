"""The writing side of ``format("pspf")``: DataFrames into PSPF topics, each row one entry.

The reading side is in the rooms beside this one (``pspf.spark``); the connection options
(``broker``) are parsed by ``pspf.spark.connection``, for both.

Each row becomes one entry in PSPF's wire format (the ``key`` column as the key, the other columns,
or a chosen ``value`` column or ``columns`` list, as the JSON value), in the partition PSPF's
partition function picks. Tasks receive Arrow record batches and encode them column by column;
each chunk of rows goes out in one pipelined round trip, one Lua call per topic partition.
Options are checked on the driver before any task runs.

Idempotence. In streaming, each task writes its rows in chunks; each chunk of each topic partition
goes in one Lua call together with a marker keyed by (query id, micro-batch id, Spark partition,
chunk number) that counts the chunk's entries already added: when Spark replays a micro-batch or
retries a task, entries already written are skipped and the ones a failed attempt did not reach
(its input can end early) are added, so nothing is written twice and nothing is missed, provided a
replayed Spark partition yields its rows in the same order (true for replayable sources read
without a nondeterministic shuffle). In batch mode a retried task writes its rows again unless the
``idempotency_key`` option names the write; with it, the same markers make a retried task, or the
whole job run again with the same key, write nothing twice. Markers expire after ``marker_ttl_s``
(7 days by default).

Trimming. ``maxlen`` or ``minid`` trim each stream in the Lua call that adds a chunk, but never an
entry an app reading the topic has yet to acknowledge: the floor is the lowest, over the stream's
consumer groups, of each group's oldest pending id, or its last-delivered-id when nothing is pending.
``minid`` trims below the lower of itself and the floor; ``maxlen`` removes the oldest entries
beyond ``maxlen`` but none at or above the floor, so a stream stays longer than ``maxlen`` while an
app lags (a trim that deleted unread entries would lose them for good). A stream without groups is
trimmed as ``XADD MAXLEN ~``/``MINID ~`` would. Trimming is approximate: whole nodes of entries go.

Repartitioning. Rows are routed with the partition count and layout generation the driver read
(``pspf topic repartition`` changes both), and each chunk's Lua call refuses, before writing
anything, a partition whose layout is not that one. The driver waits while a repartition of the
topic runs, ``repartition_wait_s`` at most (60 s by default), then fails. A task whose chunks are
refused waits likewise, reads the new count and routes the refused entries again; the entries
written before the switch moved with the topic. So within one task attempt nothing is lost and
nothing is written twice. A Spark retry (or a streaming replay) of a task that spans the switch
may write again the chunks its earlier attempt wrote before the switch, and the entries it routed
again, as their markers were under the old layout or absent: stop Spark writes to a topic before
repartitioning it, as with the apps that read it.

Needs pyspark 4.1+ and pyarrow (``pip install 'pspf[spark]'``) and Java 17+. ``import pspf`` does not
import this module.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pspf import keys
from pspf.broker import Broker, partition_count
from pspf.codec import KEY, VALUE
from pspf.contracts.registry import topic_checks
from pspf.contracts.schema import Checker
from pspf.errors import ConfigError, SchemaError
from pspf.settings import RedisSettings, mask_url
from pspf.spark.connection import CONNECTION_OPTIONS, SPARK_OPTIONS, broker_url, connected

try:
    import pyarrow as pa
    from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
    from pyspark.sql.types import ArrayType, BinaryType, DataType, MapType, StringType, StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark sink needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc

_CHUNK_ROWS = 2_000
_DEFAULT_MARKER_TTL_S = 7 * 24 * 3600
#: as the ``Producer``'s ``repartition_wait_s``
_DEFAULT_REPARTITION_WAIT_S = 60.0


@dataclass(frozen=True)
class SinkOptions:
    """The validated options of one write; sent to every task."""

    url: str = field(repr=False)  # it may hold a password
    topic: str
    partitions: int
    key: str | None
    value: str | None
    columns: tuple[str, ...]
    maxlen: str
    minid: str
    idempotency_key: str | None
    marker_ttl_s: int
    #: the layout generation ``partitions`` was read with (``lua/sink_write.lua`` refuses others)
    layout: str = "0"
    #: how long a write waits for a repartition of the topic to finish
    repartition_wait_s: float = _DEFAULT_REPARTITION_WAIT_S


def sink_options(options: dict[str, str], schema: StructType) -> SinkOptions:
    """Check the options against the schema and the broker, on the driver."""
    known = CONNECTION_OPTIONS | {
        "topic",
        "key",
        "value",
        "columns",
        "maxlen",
        "minid",
        "idempotency_key",
        "marker_ttl_s",
        "repartition_wait_s",
    }
    unknown = sorted(set(options) - known - SPARK_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown pspf sink option(s) {unknown}; known: {sorted(known)}")
    topic = options.get("topic")
    if not topic:
        raise ConfigError('the pspf sink needs .option("topic", ...)')
    keys.check_name("topic", topic)
    url = broker_url(options)
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
    wait_s = _positive_seconds(options.get("repartition_wait_s", str(_DEFAULT_REPARTITION_WAIT_S)))
    with connected(url) as broker:
        partitions, layout = partition_count(broker.topics, topic, wait_s=wait_s, hint=_WAIT_HINT)
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
        layout=layout,
        repartition_wait_s=wait_s,
    )


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"repartition_wait_s must be a positive number of seconds, not {text!r}")
    return seconds


@dataclass
class SinkCommitMessage(WriterCommitMessage):
    written: int
    skipped_chunks: int


def _json_ready(data_type: DataType) -> Callable[[Any], Any] | None:
    """How to turn an Arrow ``to_pylist`` value of ``data_type`` into what the JSON value holds.

    Arrow gives structs as dicts and arrays as lists already, but maps as lists of pairs: those
    become objects, also inside structs and arrays. None when the value needs no change.
    """
    if isinstance(data_type, MapType):
        key, value = _json_ready(data_type.keyType), _json_ready(data_type.valueType)
        same = _same
        return lambda v: None if v is None else {(key or same)(k): (value or same)(x) for k, x in v}
    if isinstance(data_type, ArrayType):
        element = _json_ready(data_type.elementType)
        if element is None:
            return None
        return lambda v: None if v is None else [element(x) for x in v]
    if isinstance(data_type, StructType):
        fields = [(f.name, _json_ready(f.dataType)) for f in data_type.fields]
        if all(convert is None for _, convert in fields):
            return None
        return lambda v: None if v is None else {n: (c or _same)(v[n]) for n, c in fields}
    return None


def _same(value: Any) -> Any:
    return value


class _Encoder:
    """Turns Arrow record batches into (key, value) wire fields, column by column.

    Working on Arrow columns instead of Spark ``Row`` objects keeps the per-row Python work to a
    JSON encode of a msgspec Struct and the partition function.
    """

    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        names = schema.fieldNames()
        self.key = options.key
        self.key_as_text = options.key is not None and not isinstance(
            schema[options.key].dataType, BinaryType
        )
        self.value = options.value
        self.raw_value = False
        if options.value:
            self.value_columns: tuple[str, ...] = (options.value,)
            self.raw_value = isinstance(schema[options.value].dataType, StringType | BinaryType)
        else:
            self.value_columns = options.columns or tuple(n for n in names if n != options.key)
        self.convert = {n: c for n in self.value_columns if (c := _json_ready(schema[n].dataType))}
        # A Struct encodes about twice as fast as a dict; ``rename`` allows any column name.
        attributes = [f"c{i}" for i in range(len(self.value_columns))]
        self.record = msgspec.defstruct(
            "Record", attributes, rename=dict(zip(attributes, self.value_columns, strict=True))
        )
        self.encode_json = msgspec.json.Encoder().encode

    def entries(self, batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[bytes | None, bytes]]:
        """(key or None, value) of each row, in the input's order."""
        for batch in batches:
            yield from zip(self._keys(batch), self._values(batch), strict=True)

    def _keys(self, batch: pa.RecordBatch) -> list[bytes | None]:
        if self.key is None:
            return [None] * batch.num_rows
        column: list[Any] = batch.column(self.key).to_pylist()
        if self.key_as_text:
            return [None if k is None else str(k).encode() for k in column]
        return column  # binary: already bytes

    def _values(self, batch: pa.RecordBatch) -> list[bytes]:
        columns = []
        for name in self.value_columns:
            column = batch.column(name).to_pylist()
            convert = self.convert.get(name)
            columns.append(column if convert is None else [convert(v) for v in column])
        if self.value is None:
            return list(map(self.encode_json, itertools.starmap(self.record, zip(*columns, strict=True))))
        if self.raw_value:
            return [b"null" if v is None else v.encode() if isinstance(v, str) else v for v in columns[0]]
        return list(map(self.encode_json, columns[0]))


def _write_task(
    options: SinkOptions, schema: StructType, batches: Iterator[pa.RecordBatch], token: str | None
) -> SinkCommitMessage:
    """Write one task's rows in chunks of ``_CHUNK_ROWS``; with a ``token``, each chunk at most once.

    A chunk is cut by row count, whatever the sizes of the Arrow batches, so a retried task cuts
    the same chunks as the attempt before it and their markers match. Entries a repartition
    refused are routed again, once, without markers (``_Chunks.write``).
    """
    from pyspark import TaskContext

    context = TaskContext.get()
    spark_partition = context.partitionId() if context is not None else 0
    entries = _Encoder(options, schema).entries(batches)
    broker = Broker(RedisSettings(url=options.url))
    chunks = _Chunks(options, broker, None if token is None else f"{token}:{spark_partition}")
    chunks.schema = topic_checks(broker, options.topic).current
    try:
        for chunk_number in itertools.count():
            if not chunks.write(chunk_number, itertools.islice(entries, _CHUNK_ROWS)):
                break
    except Exception as exc:
        # Say where, never how to log in: the URL is masked.
        raise RuntimeError(
            f"pspf sink writing to {mask_url(options.url)} topic {options.topic!r} failed: {exc}"
        ) from None
    finally:
        broker.close()
    return SinkCommitMessage(written=chunks.written, skipped_chunks=chunks.skipped)


class _Chunks:
    """Writes a task's chunks in the topic's layout, and routes again what a repartition refused."""

    def __init__(self, options: SinkOptions, broker: Broker, name: str | None) -> None:
        self.options = options
        self.broker = broker
        #: the task's chunks are named "<name>:<chunk number>" (no markers without a name)
        self.name = name
        self.partitions = options.partitions
        self.layout = options.layout
        #: keyless entries, in the task's order: a retry spreads them as its earlier attempt did
        self.round_robin = itertools.count()
        self.written = self.skipped = 0
        #: the topic's current schema (``pspf.contracts``): a chunk with a value it refuses writes nothing
        self.schema: Checker | None = None

    def write(self, chunk_number: int, entries: Iterable[tuple[bytes | None, bytes]]) -> bool:
        """Write one chunk; False when ``entries`` is empty.

        Partitions whose layout moved on wrote nothing: their entries are routed again with the
        count of the new layout, once no repartition runs (waiting ``repartition_wait_s`` at
        most). They go without markers: they are only part of the chunk, which a retry of the task
        routes whole, so no marker of theirs could tell the retry what to skip; it writes them
        again. (A marker named as before the switch could even skip entries: one may be in a
        partition both layouts have, left by this chunk's entries written there.)
        """
        if self.schema is not None:
            entries = list(entries)
            for n, (_, value) in enumerate(entries, start=chunk_number * _CHUNK_ROWS + 1):
                try:
                    self.schema.check(value)
                except SchemaError as exc:
                    raise SchemaError(f"row {n} of the task: {exc}") from None
        routed = self._routed(entries, self.round_robin)
        if not routed:
            return False
        refused = self._send(routed, chunk_number)
        wait_s = self.options.repartition_wait_s
        deadline = time.monotonic() + wait_s
        while refused:
            self.partitions, self.layout = partition_count(
                self.broker.topics,
                self.options.topic,
                wait_s=wait_s,
                hint=_WAIT_HINT,
                stale=self.layout,
                deadline=deadline,
            )
            refused = self._send(self._routed(_unflattened(refused), itertools.count()), None)
        return True

    def _routed(
        self, entries: Iterable[tuple[bytes | None, bytes]], round_robin: Iterator[int]
    ) -> dict[int, list[Any]]:
        """Flat arguments of each partition's entries (see ``lua/sink_write.lua``)."""
        partitions = self.partitions
        by_partition: dict[int, list[Any]] = {}
        for key, value in entries:
            if key is None:
                flat = by_partition.setdefault(next(round_robin) % partitions, [])
                flat += (2, VALUE, value)
            else:
                flat = by_partition.setdefault(keys.partition_for(key, partitions), [])
                flat += (4, KEY, key, VALUE, value)
        return by_partition

    def _marker(self, partition: int, chunk_number: int | None) -> str | None:
        """The chunk's marker in ``partition``; its name says the layout (but in layout "0").

        A retry after a repartition then finds no marker of the old layout where a partition of
        the same number holds other entries, and writes its chunks again rather than skip any.
        """
        if self.name is None or chunk_number is None:
            return None
        chunk = f"{self.name}:{chunk_number}" + ("" if self.layout == "0" else f":g{self.layout}")
        return keys.sink_marker_key(self.options.topic, partition, chunk)

    def _send(self, routed: dict[int, list[Any]], chunk_number: int | None) -> list[list[Any]]:
        """Send one chunk per partition; the flat entries of the partitions that refused the layout.

        The markers are named by ``chunk_number``; None sends none.
        """
        options = self.options
        chunks = {
            partition: (self._marker(partition, chunk_number), flat) for partition, flat in routed.items()
        }
        added = self.broker.publishing.add_chunks(
            options.topic, self.layout, chunks, options.marker_ttl_s, options.maxlen, options.minid
        )
        refused = []
        for partition, count in added.items():
            if count is None:
                refused.append(routed[partition])
            else:
                self.written += count
                self.skipped += int(count == 0)
        return refused


def _unflattened(flats: list[list[Any]]) -> Iterator[tuple[bytes | None, bytes]]:
    """(key or None, value) of each entry of flat arguments, in their order."""
    for flat in flats:
        i = 0
        while i < len(flat):
            if flat[i] == 4:
                yield flat[i + 2], flat[i + 4]
            else:
                yield None, flat[i + 2]
            i += 1 + flat[i]


#: what a Spark write that waited for a repartition in vain says to do
_WAIT_HINT = "stop Spark writes to a topic before repartitioning it (or raise repartition_wait_s)"


class PSPFBatchWriter(DataSourceArrowWriter):
    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        token = None if self.options.idempotency_key is None else f"batch:{self.options.idempotency_key}"
        return _write_task(self.options, self.schema, iterator, token)


class PSPFStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: SinkOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
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
