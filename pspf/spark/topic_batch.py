"""A batch read of a topic: each partition's range fixed on the driver, split by milliseconds.

A batch read fixes each partition's end on the driver (its last entry when the read is planned,
or the ``end_id``/``end_time`` bound), so every task reads the same range whenever it runs; a
partition with more than ``max_entries_per_split`` entries in range is split into ranges of
milliseconds that cover the range exactly (``split_range``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from pspf import keys
from pspf.keys import StreamId
from pspf.spark.connection import broker_url, connected
from pspf.spark.reading import (
    DEFAULT_MAX_ENTRIES_PER_SPLIT,
    StreamState,
    id_bounds,
    positive_option,
    read_connection,
    read_entries,
    stream_state,
)

try:
    import pyarrow as pa
    from pyspark.sql.datasource import DataSourceReader, InputPartition
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc


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


def plan_topic_read(options: dict[str, str]) -> TopicRead:
    topic = keys.check_name("topic", options["topic"])
    url = broker_url(options)
    start, end = id_bounds(options)
    split = positive_option(options, "max_entries_per_split", DEFAULT_MAX_ENTRIES_PER_SPLIT)
    with connected(url) as broker:
        partitions = broker.topics.topic_partitions(topic)
    return TopicRead(url, topic, partitions, start, end, cast(int, split))


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
        with read_connection(read.url, f"topic {read.topic!r}") as broker:
            yield from read_entries(broker, read.topic, partition.partition, first, last)
