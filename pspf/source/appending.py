"""Appending a producer's numbered rows to a topic, each once, through ``lua/publish.lua``.

A producer (a source's object, an HTTP request's idempotency key) numbers its rows. On each
partition the publishing script appends only rows above the last number it recorded for the
producer, and records the new last number in the same call, behind the partition's layout guard:
a run repeated after a crash, or a retried request, adds nothing twice. Rows of one producer
reach each partition in number order, so a row is in the topic exactly when its number is at or
below its partition's record.

A producer's name carries the layout generation its rows were routed in: after a repartition the
old partitions' records describe the old routing. A partition that refuses the rows' layout wrote
nothing of them; those rows are routed again in the new layout, under the new name. A caller that
must survive a crash across a repartition (a source) remembers the layouts it used before each
is first used (``before_layout``) and hands them in again (``earlier``): a row recorded in any of
them is not sent again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pspf import codec, keys
from pspf.broker import Broker, Fields, PublishCall, TopicCount, partition_count, refused_layout
from pspf.contracts.registry import topic_checks
from pspf.errors import SchemaError

#: Rows per publishing call to one partition.
CALL_ROWS = 1000


class Row(NamedTuple):
    """One row to append: its number (from 1), its key (None: spread by number) and its fields."""

    seq: int
    key: bytes | None
    fields: Fields


class Appender:
    """Appends one producer's rows to ``topic``, each once; counts what it added and found there."""

    def __init__(
        self,
        broker: Broker,
        topic: str,
        producer: Callable[[str], str],
        count: TopicCount | None = None,
        before_layout: Callable[[TopicCount], None] | None = None,
    ) -> None:
        """``producer`` names the producer in a layout generation; ``count`` is the topic's, if known.

        Raises:
            NotFound: the topic does not exist.
        """
        self.broker = broker
        self.topic = topic
        self.producer = producer
        self.before_layout = before_layout
        self.count = count or self._learn(None)
        #: the topic's schema versions (``pspf.contracts``): rows are checked against the current one
        self.schemas = topic_checks(broker, topic)
        #: per layout generation used: its count and the producer's record on each partition
        self._records: dict[str, tuple[TopicCount, list[int]]] = {}
        self._announced: set[str] = set()
        self.added = 0
        self.already = 0

    def _learn(self, stale: str | None) -> TopicCount:
        return partition_count(
            self.broker.topics,
            self.topic,
            wait_s=self.broker.conn.repartition_wait_s,
            hint="run again once the repartition has finished: nothing is added twice",
            stale=stale,
        )

    def earlier(self, counts: Sequence[TopicCount]) -> None:
        """Read the producer's records in the layouts it used before (a restart), in one round trip."""
        for count in counts:
            self._announced.add(count.layout)
            targets = [(self.topic, p) for p in range(count.partitions)]
            found = self.broker.publishing.published_up_to(self.producer(count.layout), targets)
            self._records[count.layout] = (count, found)

    def _seen(self, row: Row) -> bool:
        for count, records in self._records.values():
            if row.seq <= records[route(row, count.partitions)]:
                return True
        return False

    def append(self, rows: Sequence[Row]) -> None:
        """Append ``rows`` (in number order) that are not in the topic yet; one round trip a layout.

        Raises:
            BrokerError: Redis refused a call or is unreachable: some rows may be in, and a run
                again adds the others.
        """
        pending = [row for row in rows if not self._seen(row)]
        self._check(pending)
        self.already += len(rows) - len(pending)
        while pending:
            count = self.count
            if count.layout not in self._announced:
                if self.before_layout is not None:
                    self.before_layout(count)
                self._announced.add(count.layout)
            routed: dict[int, list[Row]] = {}
            for row in pending:
                routed.setdefault(route(row, count.partitions), []).append(row)
            pending = self._send(count, routed)
            if pending:  # refused for their layout: a repartition switched those partitions
                self.count = self._learn(count.layout)

    def _check(self, rows: Sequence[Row]) -> None:
        """Refuse the whole call when a row's value does not match the topic's current schema."""
        checker = self.schemas.current
        if checker is None:
            return
        version = b"%d" % checker.version
        for row in rows:
            try:
                checker.check(row.fields[codec.VALUE])
            except SchemaError as exc:
                raise SchemaError(f"row {row.seq}: {exc}") from None
            row.fields[codec.SCHEMA] = version

    def _send(self, count: TopicCount, routed: dict[int, list[Row]]) -> list[Row]:
        """One write of every partition's calls; the rows of partitions that refused the layout."""
        records = self._records.setdefault(count.layout, (count, [0] * count.partitions))[1]
        calls: list[PublishCall] = []
        runs: list[tuple[int, list[Row]]] = []
        for partition, rows in routed.items():
            prev = 0
            for run in _shaped_runs(rows):
                names = tuple(run[0].fields)
                values = [value for row in run for value in row.fields.values()]
                seqs = ",".join(f"{row.seq}:1" for row in run)
                target = (self.topic, partition)
                calls.append(PublishCall(target, prev, seqs, names, b"", values, count.layout))
                runs.append((partition, run))
                prev = run[-1].seq  # the next call runs only if this one did
        self.broker.publishing.guard_memory()
        replies = self.broker.publishing.send_publish(self.producer(count.layout), calls).replies()
        refused: list[Row] = []
        for (partition, run), reply in zip(runs, replies, strict=True):
            if refused_layout(reply) is not None:
                refused += run
                continue
            if isinstance(reply, BaseException):
                raise reply
            added = int(reply[0])
            self.added += added
            self.already += len(run) - added
            records[partition] = max(records[partition], int(reply[1]))
        return sorted(refused, key=lambda row: row.seq)


def route(row: Row, partitions: int) -> int:
    """A row's partition: its key's, or spread by its number when it has none (the same on a retry)."""
    if row.key is None:
        return (row.seq - 1) % partitions
    return keys.partition_for(row.key, partitions)


def _shaped_runs(rows: list[Row]) -> list[list[Row]]:
    """Rows in runs of the same field names, up to CALL_ROWS each (one publishing call each)."""
    runs: list[list[Row]] = []
    for row in rows:
        last = runs[-1] if runs else None
        if last is not None and len(last) < CALL_ROWS and tuple(last[0].fields) == tuple(row.fields):
            last.append(row)
        else:
            runs.append([row])
    return runs
