"""The reading side of ``format("pspf")``: topics, an app's state and its tables, batch and streaming.

- ``.option("topic", name)``: one row per entry (``TOPIC_SCHEMA``), its value as JSON text. A batch
  read fixes each partition's end on the driver (its last entry when the read is planned, or the
  ``end_id``/``end_time`` bound), so every task reads the same range whenever it runs; a
  partition with more than ``max_entries_per_split`` entries in range is split into ranges of
  milliseconds that cover the range exactly (``split_range``).
- ``.option("state", app)``: one row per key of the app's state (``STATE_SCHEMA``), and
  ``.option("table", name).option("app", app)`` one row per row of a table (``TABLE_SCHEMA``),
  each partition read from its state backup as one consistent snapshot (``pspf.partition.backup.snapshot``,
  what ``pspf state export`` reads).
- ``spark.readStream``: the offset of a micro-batch is, per partition, the last id it covers
  (``{"0": "1700000000000-3", ...}``), and Spark keeps the offsets in its checkpoint. A task reads
  the range (previous offset, offset], so a replayed micro-batch reads the same entries and a
  restarted query neither skips nor repeats one. No consumer group is used: reading changes
  nothing in Redis, and retention does not wait for the query (a task that finds entries after
  its offset trimmed fails, unless ``fail_on_data_loss`` is false).

Tasks build Arrow record batches of up to ``PAGE`` entries, one XRANGE each. Options are checked
on the driver; the reader objects carry only plain values to the tasks, never a connection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import ConfigError, NotFound, StateValueError
from pspf.keys import ZERO_ID, StreamId
from pspf.ownership.membership import live_members
from pspf.partition.backup import snapshot
from pspf.service.base import parse_time_ms
from pspf.service.records import TopicEntry
from pspf.service.state import shown_state
from pspf.settings import RedisSettings, mask_url
from pspf.spark import CONNECTION_OPTIONS, SPARK_OPTIONS, broker_url, connected

try:
    import pyarrow as pa
    from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import IntegerType, LongType, MapType, StringType, StructField, StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc
try:  # pyspark 4.2+: read limits and Trigger.AvailableNow for Python streaming sources
    from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - pyspark 4.1 calls latestOffset() without a limit
    ReadLimit = ReadMaxRows = object  # type: ignore[misc,assignment]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Not in pyspark 4.1, which runs Trigger.AvailableNow over any source by itself."""


log = logging.getLogger(__name__)

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
_ARROW_TOPIC, _ARROW_STATE, _ARROW_TABLE = map(to_arrow_schema, (TOPIC_SCHEMA, STATE_SCHEMA, TABLE_SCHEMA))

_BATCH_TOPIC_OPTIONS = {"topic", "start_id", "end_id", "start_time", "end_time", "max_entries_per_split"}
_STREAM_TOPIC_OPTIONS = {"topic", "starting", "max_entries_per_trigger", "fail_on_data_loss"}
_STATE_OPTIONS = {"state"}
_TABLE_OPTIONS = {"table", "app"}


def _what(options: dict[str, str]) -> str:
    """Which read the options ask for: ``topic``, ``state`` or ``table`` (exactly one is given)."""
    given = [name for name in ("topic", "state", "table") if options.get(name)]
    if len(given) != 1:
        raise ConfigError(
            'the pspf source reads one thing: give exactly one of .option("topic", ...), '
            f'.option("state", app) or .option("table", ...); given: {given or "none"}'
        )
    return given[0]


def source_schema(options: dict[str, str]) -> StructType:
    """The schema of what the options read (the rows of a topic, of an app's state or of a table)."""
    return {"topic": TOPIC_SCHEMA, "state": STATE_SCHEMA, "table": TABLE_SCHEMA}[_what(options)]


def _check_options(options: dict[str, str], schema: StructType, known: set[str]) -> None:
    """ConfigError for an option this read does not take, or a schema that is not the source's."""
    allowed = known | CONNECTION_OPTIONS | SPARK_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown pspf source option(s) {unknown} for this read; known: {sorted(allowed)}")
    expected = source_schema(options)
    if [(f.name, f.dataType) for f in schema.fields] != [(f.name, f.dataType) for f in expected.fields]:
        raise ConfigError(
            f"the pspf source gives the schema {expected.simpleString()}, not {schema.simpleString()}"
        )


def batch_reader(options: dict[str, str], schema: StructType) -> DataSourceReader:
    """The reader of ``spark.read.format("pspf")``, its options checked here, on the driver."""
    what = _what(options)
    if what == "topic":
        _check_options(options, schema, _BATCH_TOPIC_OPTIONS)
        return TopicReader(_topic_read(options))
    _check_options(options, schema, _STATE_OPTIONS if what == "state" else _TABLE_OPTIONS)
    return StateReader(_state_read(options, what))


def stream_reader(options: dict[str, str], schema: StructType) -> DataSourceStreamReader:
    """The reader of ``spark.readStream.format("pspf")`` (topics only)."""
    if _what(options) != "topic":
        raise ConfigError("the pspf source streams topics only: read state and tables with spark.read")
    _check_options(options, schema, _STREAM_TOPIC_OPTIONS)
    return TopicStreamReader(_stream_options(options))


def _positive(options: dict[str, str], name: str, default: int | None) -> int | None:
    text = options.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ConfigError(f"{name} must be a positive whole number, not {text!r}")
    return int(text)


def _flag(options: dict[str, str], name: str, default: bool) -> bool:
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


def _bounds(options: dict[str, str]) -> tuple[StreamId, StreamId | None]:
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


# -- topics, batch ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicRead:
    """The validated options of a batch read of a topic; sent to every task."""

    url: str = field(repr=False)  # it may hold a password
    topic: str
    partitions: int
    start: StreamId
    end: StreamId | None
    max_entries_per_split: int


@dataclass(frozen=True)
class IdRange(InputPartition):
    """One task's read: the entries of one partition with ids from ``first`` to ``last``, included."""

    partition: int
    first: str
    last: str


def _topic_read(options: dict[str, str]) -> TopicRead:
    topic = keys.check_name("topic", options["topic"])
    url = broker_url(options)
    start, end = _bounds(options)
    split = _positive(options, "max_entries_per_split", DEFAULT_MAX_ENTRIES_PER_SPLIT)
    with connected(url) as broker:
        partitions = broker.topic_partitions(topic)
    return TopicRead(url, topic, partitions, start, end, cast(int, split))


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
    with broker.translate_errors(stream):
        if not broker.client.exists(stream):
            return StreamState(None)
        return StreamState(cast(dict[str, Any], broker.client.xinfo_stream(stream)))


def split_range(first: StreamId, last: StreamId, entries: int, most: int) -> list[tuple[StreamId, StreamId]]:
    """[first, last] as consecutive id ranges of about ``most`` of its ``entries`` entries each.

    The ranges cut at whole milliseconds, spread evenly over the range's milliseconds: each
    starts at ``ms-0`` and the one before it ends just below, so together they cover every id of
    the range once. A range of one millisecond is not cut.
    """
    span = last.ms - first.ms + 1
    pieces = max(1, min(math.ceil(entries / most), span))
    cuts = [StreamId(first.ms + span * i // pieces, 0) for i in range(1, pieces)]
    starts = [first, *cuts]
    ends = [cut.previous() for cut in cuts] + [last]
    return list(zip(starts, ends, strict=True))


def _partition_ranges(read: TopicRead, partition: int, state: StreamState) -> list[IdRange]:
    """One partition's read as id ranges; one empty range when nothing is in range."""
    first = max(read.start, state.first) if state.first else read.start
    last = state.last if read.end is None or (state.last and state.last < read.end) else read.end
    if state.first is None or last is None or state.last is None or first > last:
        return [IdRange(partition, "1-0", "0-0")]  # reads nothing
    # Entries in range, estimated from the share of the stream's milliseconds the range covers.
    share = (last.ms - first.ms + 1) / (state.last.ms - state.first.ms + 1)
    entries = math.ceil(state.length * min(1.0, share))
    return [
        IdRange(partition, str(a), str(b))
        for a, b in split_range(first, last, entries, read.max_entries_per_split)
    ]


class TopicReader(DataSourceReader):
    """A batch read of a topic: every entry in the bounds, each once."""

    def __init__(self, read: TopicRead) -> None:
        self.read_options = read

    def partitions(self) -> Sequence[InputPartition]:
        """Per topic partition one range or more; the ends fixed now, on the driver."""
        read = self.read_options
        with connected(read.url) as broker:
            states = [stream_state(broker, keys.stream_key(read.topic, p)) for p in range(read.partitions)]
        return [r for p, state in enumerate(states) for r in _partition_ranges(read, p, state)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, IdRange)
        read = self.read_options
        first, last = StreamId.parse(partition.first), StreamId.parse(partition.last)
        if first > last:
            return
        with _reading(read.url, f"topic {read.topic!r}") as broker:
            yield from read_entries(broker, read.topic, partition.partition, first, last)


# -- reading entries (the tasks of batch and streaming reads) ---------------------------------------


class DataLoss(RuntimeError):
    """Entries a streaming query had yet to read were trimmed (``fail_on_data_loss``)."""


@contextmanager
def _reading(url: str, what: str) -> Iterator[Broker]:
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
        with broker.translate_errors(stream):
            page = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                broker.client.xrange(stream, str(start), str(last), PAGE),
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
    return _arrow_batch(
        [[topic] * count, [partition] * count, ids, keys_, values, encodings, headers, stamps], _ARROW_TOPIC
    )


def _arrow_batch(columns: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)], schema=schema
    )


# -- topics, streaming ------------------------------------------------------------------------------

#: Offsets of a streaming read: per partition (its number as text) the last id a micro-batch covers,
#: and how many entries the stream had ever added up to it (None where the server does not say).
Offsets = dict[str, "Position"]


class Position(msgspec.Struct, frozen=True):
    """Where a streaming read is in one stream: after ``id``, with ``added`` entries added up to it."""

    id: str
    added: int | None

    @classmethod
    def of(cls, raw: Any) -> Position:
        return msgspec.convert(raw, cls)


@dataclass(frozen=True)
class StreamOptions:
    """The validated options of a streaming read of a topic."""

    url: str = field(repr=False)  # it may hold a password
    topic: str
    partitions: int
    starting: str
    max_entries_per_trigger: int | None
    fail_on_data_loss: bool


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One task of a micro-batch: the entries of one partition after ``after``, up to ``last``."""

    partition: int
    after: str
    added: int | None
    last: str


def _stream_options(options: dict[str, str]) -> StreamOptions:
    topic = keys.check_name("topic", options["topic"])
    url = broker_url(options)
    starting = options.get("starting", "earliest").lower()
    if starting not in ("earliest", "latest"):
        raise ConfigError(f"starting must be earliest or latest, not {options['starting']!r}")
    most = _positive(options, "max_entries_per_trigger", None)
    with connected(url) as broker:
        partitions = broker.topic_partitions(topic)
    return StreamOptions(url, topic, partitions, starting, most, _flag(options, "fail_on_data_loss", True))


def initial_position(state: StreamState, starting: str) -> Position:
    """Where a new query starts in a stream: just before its first entry, or after its last id.

    An empty stream starts after its last id (whatever it held before is gone). Before the first
    entry, every entry added so far but those left was removed before the query started.
    """
    if starting == "earliest" and state.first is not None:
        added = None if state.added is None else state.added - state.length
        return Position(str(state.first.previous()), added)
    return Position(str(state.last_generated or ZERO_ID), state.added)


def trimmed_after(state: StreamState, at: Position) -> int | None:
    """How many entries after ``at``, not read yet, were trimmed (None: none, or unknown).

    Trimming removes a stream's oldest entries. Once the first entry left is after ``at``, every
    entry left is, so of the ``state.added - at.added`` entries ever added after ``at`` those not
    among the ``state.length`` left are gone. Needs XINFO STREAM's ``entries-added`` (Redis 7.0+,
    Valkey): on Redis 6.2 nothing is detected.
    """
    if at.added is None or state.added is None:
        return None
    if state.first is not None and state.first <= StreamId.parse(at.id):
        return None
    lost = state.added - at.added - state.length
    return lost if lost > 0 else None


class TopicStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A streaming read of a topic: offsets are per-partition positions that Spark checkpoints.

    No consumer group: ``commit`` has nothing to do, and nothing in Redis changes.
    """

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        #: Trigger.AvailableNow: the offsets the query ends at, fixed when it starts
        self.target: dict[str, Any] | None = None

    def _states(self) -> list[StreamState]:
        topic = self.options.topic
        with connected(self.options.url) as broker:
            return [stream_state(broker, keys.stream_key(topic, p)) for p in range(self.options.partitions)]

    def initialOffset(self) -> dict[str, Any]:
        starting = self.options.starting
        return _offsets({str(p): initial_position(s, starting) for p, s in enumerate(self._states())})

    def _latest(self) -> dict[str, Any]:
        """Each partition's last id: no entry can be added at or below it."""
        return _offsets(
            {
                str(p): Position(str(s.last_generated or ZERO_ID), s.added)
                for p, s in enumerate(self._states())
            }
        )

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._latest()

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        most = self.options.max_entries_per_trigger
        return ReadAllAvailable() if most is None else ReadMaxRows(most)

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, Any]:
        """Where the next micro-batch ends: each partition's last id, at most ``max_rows`` entries on."""
        latest = self.target or self._latest()
        if start is None:  # pyspark 4.1: no admission control
            return latest
        begin = {p: Position.of(raw) for p, raw in start.items()}
        ends = dict(begin)
        for p, raw in latest.items():
            at = Position.of(raw)
            if p not in begin or StreamId.parse(at.id) > StreamId.parse(begin[p].id):
                ends[p] = at
        if isinstance(limit, ReadMaxRows):
            self._limit(begin, ends, limit.max_rows)
        return _offsets(ends)

    def _limit(self, begin: Offsets, ends: Offsets, most: int) -> None:
        """Move ``ends`` back so that about ``most`` entries are read, shared among the partitions."""
        behind = [p for p in begin if StreamId.parse(ends[p].id) > StreamId.parse(begin[p].id)]
        share = max(1, most // max(1, len(behind)))
        with connected(self.options.url) as broker:
            for p in behind:
                stream = keys.stream_key(self.options.topic, int(p))
                after = StreamId.parse(begin[p].id)
                with broker.translate_errors(stream):
                    page = broker.client.xrange(stream, str(after.next()), ends[p].id, share)
                if len(page) == share:
                    added = begin[p].added
                    ends[p] = Position(page[-1][0].decode(), None if added is None else added + share)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        ranges = []
        for p, raw in sorted(end.items(), key=lambda item: int(item[0])):
            last = Position.of(raw)
            after = Position.of(start[p]) if p in start else Position(str(ZERO_ID), None)
            if StreamId.parse(last.id) > StreamId.parse(after.id):
                ranges.append(OffsetRange(int(p), after.id, after.added, last.id))
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange)
        topic, number = self.options.topic, partition.partition
        with _reading(self.options.url, f"topic {topic!r}") as broker:
            lost = trimmed_after(
                stream_state(broker, keys.stream_key(topic, number)),
                Position(partition.after, partition.added),
            )
            if lost is not None:
                text = (
                    f"topic {topic!r} partition {number}: {lost} entries after {partition.after}, which the "
                    "query had yet to read, were trimmed; retention does not wait for a Spark query"
                )
                if self.options.fail_on_data_loss:
                    raise DataLoss(
                        f"{text}: start the query anew (a new checkpoint) or set fail_on_data_loss false"
                    )
                log.warning("%s: reading on from the entries left", text)
            yield from read_entries(
                broker, topic, number, StreamId.parse(partition.after).next(), StreamId.parse(partition.last)
            )

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: Spark's checkpoint holds the offsets; no group acknowledges anything."""


def _offsets(positions: Offsets) -> dict[str, Any]:
    """Offsets as Spark keeps them: plain JSON values."""
    return {p: msgspec.to_builtins(at) for p, at in positions.items()}


# -- state and tables -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateRead:
    """The validated options of a read of an app's state (``table`` None) or of one of its tables."""

    url: str = field(repr=False)  # it may hold a password
    app: str
    table: str | None
    backups: tuple[tuple[int, keys.BackupKeys], ...]


@dataclass(frozen=True)
class BackupPartition(InputPartition):
    """One task: a snapshot of one partition's state backup."""

    partition: int
    backup: keys.BackupKeys


def _state_read(options: dict[str, str], what: str) -> StateRead:
    url = broker_url(options)
    table = None
    if what == "state":
        app = keys.check_name("app", options["state"])
    else:
        table = keys.check_name("table", options["table"])
        if not options.get("app"):
            raise ConfigError('a table read needs the app that holds it: .option("app", ...)')
        app = keys.check_name("app", options["app"])
    with connected(url) as broker:
        count = broker.app_partitions(app)  # NotFound for an app that never ran here
        topics = broker.app_topic_list(app)
        if table is not None and table not in topics:
            raise _no_table(broker, app, table, topics)
        found = []
        for partition in range(count if topics else 0):
            backup = keys.backup_keys(topics[0], partition, app)
            if broker.backup_meta(backup.meta).get(keys.BACKUP_IDENTITY):
                found.append((partition, backup))
    missing = sorted(set(range(count if topics else 0)) - {p for p, _ in found})
    if not found or missing:
        which = "" if not found else f" of partitions {missing}"
        raise NotFound(
            f"app {app!r} has no state backup{which} in Redis (is the backup off?): the pspf source reads "
            "the backups; read the stores on the workers' machines with `pspf state export --state-dir`"
        )
    return StateRead(url, app, table, tuple(found))


def _no_table(broker: Broker, app: str, table: str, topics: list[str]) -> Exception:
    """Why ``table`` cannot be read: a global table is in no backup, or the app has no such table."""
    if any(table in member.global_lag for member in live_members(broker, app)):
        return ConfigError(
            f"global table {table!r} of app {app!r} lives only in each worker's local store, not in "
            f'Redis, so the pspf source cannot read it: read its topic with .option("topic", {table!r})'
        )
    return NotFound(f"app {app!r} has no table {table!r}: its topics are {', '.join(topics) or 'none'}")


class StateReader(DataSourceReader):
    """A read of an app's state or table: one task per partition backup, each one snapshot."""

    def __init__(self, read: StateRead) -> None:
        self.read_options = read

    def partitions(self) -> Sequence[InputPartition]:
        return [BackupPartition(p, backup) for p, backup in self.read_options.backups]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BackupPartition)
        read = self.read_options
        what = f"the state of app {read.app!r}" if read.table is None else f"table {read.table!r}"
        with _reading(read.url, what) as broker:
            copy = snapshot(broker, partition.backup)
        if copy is None:
            raise RuntimeError(
                f"the state backup of app {read.app!r} partition {partition.partition} was removed while "
                "it was read (an app reset or a state import?)"
            )
        values, schema = copy[1], _ARROW_STATE if read.table is None else _ARROW_TABLE
        if read.table is None:
            found = sorted((key, raw) for (ns, key), raw in values.items() if ns == keys.STATE_NAMESPACE)
            rows = [(key, *_state_text(key, raw)) for key, raw in found]
        else:
            prefix = keys.table_key(read.table, "")
            found = sorted(
                (key[len(prefix) :], raw)
                for (ns, key), raw in values.items()
                if ns == keys.TABLES_NAMESPACE and key.startswith(prefix)
            )
            rows = [(key, *_row_text(read.table, key, raw)) for key, raw in found]
        for at in range(0, len(rows), PAGE):
            keys_, texts, errors = zip(*rows[at : at + PAGE], strict=True)
            yield _arrow_batch([keys_, [partition.partition] * len(keys_), texts, errors], schema)


def _state_text(key: str, raw: bytes) -> tuple[str | None, str | None]:
    """A state value as JSON text, as ``pspf state export`` shows it; else (None, why)."""
    try:
        return codec.json_encoder.encode(shown_state(key, raw)).decode(), None
    except StateValueError as exc:
        return None, str(exc)


def _row_text(table: str, key: str, raw: bytes) -> tuple[str | None, str | None]:
    """A table row (msgpack) as JSON text; else (None, why)."""
    try:
        return codec.json_encoder.encode(
            msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True)
        ).decode(), None
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        return None, f"stored row of key {key!r} of table {table!r} is unreadable: {exc}"
