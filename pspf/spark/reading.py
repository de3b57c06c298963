"""What every read of ``format("pspf")`` shares: the row schemas, the options, reading entries.

The schemas of the rows a read gives (``TOPIC_SCHEMA``, ``STATE_SCHEMA``, ``TABLE_SCHEMA``), the
parsing of the options the readers share, and the tasks' side of a topic read: ``read_entries``
pages through a range with XRANGE and ``entry_batch`` makes each page an Arrow record batch.
Tasks build Arrow record batches of up to ``PAGE`` entries, one XRANGE each. Options are checked
on the driver; the reader objects carry only plain values to the tasks, never a connection.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import ConfigError
from pspf.keys import ZERO_ID, StreamId
from pspf.service.base import parse_time_ms
from pspf.service.records import TopicEntry
from pspf.settings import RedisSettings, mask_url

try:
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import IntegerType, LongType, MapType, StringType, StructField, StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc


#: Entries per XRANGE round trip, and per Arrow record batch a task yields.
PAGE = 2_000
DEFAULT_MAX_ENTRIES_PER_SPLIT = 100_000

TOPIC_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("id", StringType(), False),
        StructField("key", StringType(), True),
        StructField("value", StringType(), True),
        StructField("encoding", StringType(), False),
        StructField("headers", MapType(StringType(), StringType(), False), True),
        StructField("timestamp", LongType(), False),
    ]
)
STATE_SCHEMA = StructType(
    [
        StructField("key", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("state", StringType(), True),
        StructField("error", StringType(), True),
    ]
)
TABLE_SCHEMA = StructType(
    [
        StructField("key", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("value", StringType(), True),
        StructField("error", StringType(), True),
    ]
)
_ARROW_TOPIC, ARROW_STATE, ARROW_TABLE = map(to_arrow_schema, (TOPIC_SCHEMA, STATE_SCHEMA, TABLE_SCHEMA))


def positive_option(options: dict[str, str], name: str, default: int | None) -> int | None:
    text = options.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ConfigError(f"{name} must be a positive whole number, not {text!r}")
    return int(text)


def flag_option(options: dict[str, str], name: str, default: bool) -> bool:
    text = options.get(name)
    if text is None:
        return default
    if text.lower() not in ("true", "false"):
        raise ConfigError(f"{name} must be true or false, not {text!r}")
    return text.lower() == "true"


def _time_ms(options: dict[str, str], name: str) -> int:
    try:
        return parse_time_ms(options[name], name)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def id_bounds(options: dict[str, str]) -> tuple[StreamId, StreamId | None]:
    """The ids a batch read covers: (first, last), both included; None: to each partition's end.

    ``start_id``/``start_time`` and ``end_id`` are inclusive, ``end_time`` exclusive (a read of
    [10:00, 11:00) and one of [11:00, 12:00) share no entry).
    """
    for first, second in (("start_id", "start_time"), ("end_id", "end_time")):
        if first in options and second in options:
            raise ConfigError(f"give {first} or {second}, not both")
    start = ZERO_ID
    if "start_id" in options:
        start = StreamId.parse(options["start_id"])
    elif "start_time" in options:
        start = StreamId(max(0, _time_ms(options, "start_time")), 0)
    end: StreamId | None = None
    if "end_id" in options:
        end = StreamId.parse(options["end_id"])
    elif "end_time" in options:
        end_ms = _time_ms(options, "end_time")
        end = StreamId(end_ms, 0).previous() if end_ms > 0 else ZERO_ID
        if end_ms <= 0:  # nothing is before the epoch
            start = StreamId(1, 0)
    return start, end


# -- reading entries (the tasks of batch and streaming reads) ---------------------------------------


class DataLoss(RuntimeError):
    """Entries a streaming query had yet to read were trimmed (``fail_on_data_loss``)."""


@contextmanager
def read_connection(url: str, what: str) -> Iterator[Broker]:
    """A broker for one task; a failure names the broker (masked) and what was read."""
    try:
        broker = Broker(RedisSettings(url=url))
        try:
            yield broker
        finally:
            broker.close()
    except DataLoss:
        raise
    except Exception as exc:
        # Say where, never how to log in: the URL is masked.
        raise RuntimeError(f"pspf source reading {what} at {mask_url(url)} failed: {exc}") from None


def read_entries(
    broker: Broker, topic: str, partition: int, first: StreamId, last: StreamId
) -> Iterator[pa.RecordBatch]:
    """The entries of one partition with ids from ``first`` to ``last`` (included), a page per batch."""
    stream = keys.stream_key(topic, partition)
    start = first
    while True:
        with broker.conn.translate_errors(stream):
            page = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                broker.conn.client.xrange(stream, str(start), str(last), PAGE),
            )
        if page:
            yield entry_batch(topic, partition, page)
        if len(page) < PAGE:
            return
        start = StreamId.parse(page[-1][0]).next()


def entry_batch(topic: str, partition: int, page: list[tuple[bytes, dict[bytes, bytes]]]) -> pa.RecordBatch:
    """Rows of ``TOPIC_SCHEMA`` for entries as XRANGE gives them, decoded as ``pspf topic read`` does.

    ``value`` is JSON text: a JSON value as written, a msgpack or flat value encoded as JSON; a
    value that is not JSON is its text (``encoding`` says ``text``, or ``bytes`` for the repr of
    bytes that are not UTF-8 either). Headers that are not a JSON object of strings are null.
    """
    ids, keys_, values, encodings, headers, stamps = [], [], [], [], [], []
    for entry_id, fields in page:
        entry = TopicEntry.of(partition, entry_id, fields)
        ids.append(entry.id)
        keys_.append(entry.key)
        encodings.append(entry.encoding)
        if entry.encoding == "json":
            values.append(fields[codec.VALUE].decode())
        elif entry.encoding in ("msgpack", "flat"):
            values.append(codec.json_encoder.encode(entry.value).decode())
        else:
            values.append(entry.value)
        headers.append(list(entry.headers.items()) if isinstance(entry.headers, dict) else None)
        stamps.append(int(entry.id.partition("-")[0]))
    count = len(ids)
    return arrow_batch(
        [[topic] * count, [partition] * count, ids, keys_, values, encodings, headers, stamps], _ARROW_TOPIC
    )


def arrow_batch(columns: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema
    )


class StreamState:
    """What XINFO STREAM says of a stream: its length, first and last entries and ids ever added."""

    __slots__ = ("added", "first", "last", "last_generated", "length")

    def __init__(self, info: dict[str, Any] | None) -> None:
        info = info or {}
        self.length = int(info.get("length", 0))
        self.first = _entry_id(info.get("first-entry"))
        self.last = _entry_id(info.get("last-entry"))
        self.last_generated = _parsed(info.get("last-generated-id"))
        #: Redis 7.0+ and Valkey: how many entries were ever added (None on Redis 6.2)
        added = info.get("entries-added")
        self.added = None if added is None else int(added)


def _entry_id(entry: Any) -> StreamId | None:
    return None if not entry else StreamId.parse(entry[0])


def _parsed(raw: bytes | str | None) -> StreamId | None:
    return None if raw is None else StreamId.parse(raw)


def stream_state(broker: Broker, stream: str) -> StreamState:
    """The stream's state; all empty when the stream does not exist."""
    with broker.conn.translate_errors(stream):
        if not broker.conn.client.exists(stream):
            return StreamState(None)
        return StreamState(cast(dict[str, Any], broker.conn.client.xinfo_stream(stream)))
