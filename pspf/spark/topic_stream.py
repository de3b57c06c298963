"""A streaming read of a topic: offsets per partition, kept in Spark's checkpoint.

The offset of a micro-batch is, per partition, the last id it covers (``{"0": "1700000000000-3",
...}``). A task reads the range (previous offset, offset], so a replayed micro-batch reads the
same entries and a restarted query neither skips nor repeats one. No consumer group is used:
reading changes nothing in Redis, and retention does not wait for the query (a task that finds
entries after its offset trimmed fails, unless ``fail_on_data_loss`` is false).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pspf import keys
from pspf.errors import ConfigError
from pspf.keys import ZERO_ID, StreamId
from pspf.spark.connection import broker_url, connected
from pspf.spark.reading import (
    DataLoss,
    StreamState,
    flag_option,
    positive_option,
    read_connection,
    read_entries,
    stream_state,
)

try:
    import pyarrow as pa
    from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc
try:  # pyspark 4.2+: read limits and Trigger.AvailableNow for Python streaming sources
    from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - pyspark 4.1 calls latestOffset() without a limit
    ReadLimit = ReadMaxRows = object  # type: ignore[misc,assignment]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Not in pyspark 4.1, which runs Trigger.AvailableNow over any source by itself."""


log = logging.getLogger("pspf.spark_source")


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


def plan_stream_read(options: dict[str, str]) -> StreamOptions:
    topic = keys.check_name("topic", options["topic"])
    url = broker_url(options)
    starting = options.get("starting", "earliest").lower()
    if starting not in ("earliest", "latest"):
        raise ConfigError(f"starting must be earliest or latest, not {options['starting']!r}")
    most = positive_option(options, "max_entries_per_trigger", None)
    with connected(url) as broker:
        partitions = broker.topics.topic_partitions(topic)
    return StreamOptions(
        url, topic, partitions, starting, most, flag_option(options, "fail_on_data_loss", True)
    )


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
                with broker.conn.translate_errors(stream):
                    page = broker.conn.client.xrange(stream, str(after.next()), ends[p].id, share)
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
        with read_connection(self.options.url, f"topic {topic!r}") as broker:
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
