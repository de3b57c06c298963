"""Reading a topic's entries as they are, without a consumer group: ``pspf topic read``.

What ``ctx.emit`` or a window wrote is otherwise only seen through XRANGE and the key layout. A
read takes the first ``count`` entries from a position (an id or a time), or the last ``count``
(the tail), of one partition or of all of them merged in id order; following then goes on from
where the read stopped, waiting with a blocking XREAD. Nothing here changes Redis.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from pspf import keys
from pspf.broker import RawEntry
from pspf.errors import ConfigError, ParameterError
from pspf.keys import StreamId
from pspf.service.base import Family, parse_time_ms
from pspf.service.records import TopicEntry

#: Partition -> the id after which following goes on (None: from the stream's start).
Positions = dict[int, StreamId | None]


class TopicReading(Family):
    """Reading and following a topic's entries."""

    def read_topic(
        self, topic: str, partition: int | None = None, start: StreamId | None = None, count: int = 10
    ) -> tuple[list[TopicEntry], Positions]:
        """The first ``count`` entries at or after ``start`` (None: the last ``count``), in id order.

        Also returns, per partition read, where following goes on: after the entries shown, so
        none is shown twice and none after them is missed.
        """
        partitions = self._read_partitions(topic, partition)
        if count < 1:
            raise ParameterError.invalid("count", "must be at least 1")
        streams = {keys.stream_key(topic, p): p for p in partitions}
        after = None if start is None or start == keys.ZERO_ID else start.previous()
        if start is None:
            read = self.broker.reading.read_tails(list(streams), count)
        else:
            read = self.broker.reading.read_after(dict.fromkeys(streams, after), count)
        merged = _merged(read, streams)
        shown = merged[-count:] if start is None else merged[:count]
        positions: Positions = dict.fromkeys(partitions, after)
        if start is None:  # what the tail left out is older than what it shows
            positions.update((e.partition, StreamId.parse(e.id)) for e in merged)
        elif shown:
            positions = dict.fromkeys(partitions, StreamId.parse(shown[-1].id))
        return shown, positions

    def follow_topic(self, topic: str, positions: Positions, block_ms: int = 1000) -> Iterator[TopicEntry]:
        """The entries after ``positions`` as they arrive, in id order per read; never ends."""
        streams = {keys.stream_key(topic, p): p for p in positions}
        at = {keys.stream_key(topic, p): after for p, after in positions.items()}
        while True:
            entries = _merged(self.broker.reading.read_after(at, 100), streams)
            for entry in entries:
                at[keys.stream_key(topic, entry.partition)] = StreamId.parse(entry.id)
                yield entry
            if not entries:
                last_ids = {stream: str(after or keys.ZERO_ID).encode() for stream, after in at.items()}
                self.broker.reading.wait_for_new(last_ids, block_ms)

    def _read_partitions(self, topic: str, partition: int | None) -> list[int]:
        count = self.base.topic_partitions(topic)
        if partition is None:
            return list(range(count))
        if not 0 <= partition < count:
            problem = f"topic {topic!r} has partitions 0 to {count - 1}, not {partition}"
            raise ParameterError.invalid("partition", problem)
        return [partition]


def parse_read_start(text: str) -> StreamId:
    """Where a read starts: a stream id (``1700000000000-0``), a time (RFC 3339) or unix ms."""
    if "-" in text:
        try:
            return StreamId.parse(text)
        except ConfigError:
            pass  # a time such as 2026-11-27T10:00:00Z
    ms = max(0, parse_time_ms(text, "from"))
    if ms > keys.MAX_SEQ:  # Redis would refuse the id: the parameter's fault, not the broker's
        raise ParameterError.invalid("from", f"{text!r} is later than any stream id can be")
    return StreamId(ms, 0)


def _merged(read: list[tuple[str, list[RawEntry]]], streams: dict[str, int]) -> list[TopicEntry]:
    """The entries of several streams, each in id order, as one list in id order."""
    runs = [
        [(StreamId.parse(entry_id), streams[stream], entry_id, fields) for entry_id, fields in entries]
        for stream, entries in read
    ]
    return [
        TopicEntry.of(partition, entry_id, fields or {})
        for _, partition, entry_id, fields in heapq.merge(*runs, key=lambda e: (e[0], e[1]))
    ]
