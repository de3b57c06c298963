"""Writing entries to topics from Python, in the wire format, pipelined."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from pspf import codec, keys
from pspf.broker import Broker, Fields, partition_count
from pspf.contracts.registry import TopicChecks, topic_checks
from pspf.settings import Settings


class Producer:
    """Writes entries to topics in the wire format, buffered and pipelined.

    Entries are queued and written with pipelined ``XADD`` calls, ``batch_size`` entries per
    round trip: when the buffer is full, on ``flush()`` and on ``close()``. Leaving a ``with``
    block normally closes the producer, which flushes; leaving it with an exception closes the
    connection without writing what is still queued.

    A keyed entry goes to partition ``CRC32(UTF-8 key) % partitions``, the partition every PSPF
    producer (the CLI, the Spark sink, ``ctx.emit``) picks for that key; entries without a key
    are spread round-robin over the topic's partitions. The topic must exist (``pspf topic
    create``): its partition count is read once per producer and topic.

    Near the server's ``maxmemory`` the writes slow down (above ``PSPF_MEMORY_SLOW_AT``) and
    then stop with a ``BrokerError`` (above ``PSPF_MEMORY_FAIL_AT``); see the settings.

    Example:
        ```python
        from pspf import Producer, Settings

        settings = Settings.load({"PSPF_BROKER": "redis://127.0.0.1:6379/0"})
        with Producer(settings=settings) as producer:
            producer.send("orders", {"user": "u1", "amount": 3}, key="u1")
            producer.send("orders", {"user": "u2", "amount": 5}, key="u2", headers={"source": "web"})
        print(producer.sent)  # 2
        ```

    Attributes:
        sent: how many entries this producer has written so far (queued entries not counted).
        batch_size: entries per pipelined round trip.
    """

    def __init__(
        self,
        broker: Broker | None = None,
        batch_size: int = 1000,
        settings: Settings | None = None,
        ordered: bool = False,
    ) -> None:
        """Connect to the broker of ``settings``, or use ``broker``.

        Args:
            broker: an open ``pspf.broker.Broker`` to share; the producer then leaves it open
                when it closes. Without one it opens its own from ``settings``.
            batch_size: entries per pipelined round trip.
            settings: where the broker is (``settings.redis``); without them,
                ``Settings.load()``, i.e. the ``PSPF_*`` environment variables and the defaults.
            ordered: give the entries ids from one sequence across the topics and partitions
                this producer writes, in the order they were sent, so that apps reading several
                of them (tables, joins: id order across topics) apply them in that order. Entries
                of one topic partition in a row still go in one call; each change of topic or
                partition costs a round trip.

        Raises:
            ConfigError: the settings are invalid (a malformed broker URL, a missing TLS file).
        """
        self._own_broker = broker is None
        self.broker = broker or Broker((settings or Settings.load()).redis)
        self.batch_size = batch_size
        #: queued entries by topic, routed to partitions when flushed
        self._buffer: dict[str, list[Fields]] = {}
        self._queued = 0
        #: topic -> (partition count, layout generation), as last read
        self._layouts: dict[str, tuple[int, str]] = {}
        self._round_robin: dict[str, Iterator[int]] = {}
        #: topic -> its schema versions, compiled (``pspf.contracts``), as read when first written
        self._schemas: dict[str, TopicChecks] = {}
        #: how long a flush waits for a repartition of a topic to finish (PSPF_REPARTITION_WAIT_S)
        self.repartition_wait_s = self.broker.conn.repartition_wait_s
        self.sent = 0
        self.ordered = ordered
        #: an ordered producer's queue, in send order, and the last id it wrote
        self._in_order: list[tuple[str, Fields]] = []
        self._last_id = ""

    def send(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Queue one entry for ``topic``; it is written at the next flush.

        Args:
            topic: the topic; it must exist.
            value: anything msgspec encodes as JSON (dicts, lists, numbers, msgspec Structs,
                dataclasses, datetimes, ...). Bytes are written as they are and must be JSON
                already (use ``send_raw`` to say so explicitly).
            key: the entry's key: it picks the partition and is the key of the state the
                entry updates in every app that reads the topic. None spreads entries
                round-robin (and they share the state of the key ``""`` in their partition).
            headers: string names to string values, carried in the entry's ``headers`` field.

        Raises:
            ConfigError: the value cannot be encoded as JSON, or as in ``send_raw``.
            NotFound: the topic does not exist.
            BrokerError: Redis is unreachable, refused a write, or is near its ``maxmemory``
                (when this call fills the buffer and flushes it).
        """
        self.send_raw(topic, codec.encode_value(value), key, headers)

    def send_raw(
        self, topic: str, value: bytes, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Queue one entry whose value is already encoded as JSON bytes.

        The bytes go into the entry's ``value`` field unchanged, and are decoded as JSON by the
        apps that read the topic. Arguments are as for ``send``.

        A topic with a schema (``pspf topic schema set``) refuses a value that does not match its
        current version, as read when this producer first wrote the topic.

        Raises:
            ConfigError: the topic name is invalid, or the key or a header is not UTF-8 text
                (checked before Redis is asked anything).
            SchemaError: the value does not match the topic's schema (the field and the rule);
                nothing of it is queued.
            NotFound: the topic does not exist.
            BrokerError: as for ``send``.
        """
        fields = codec.entry_fields(value, key, headers)
        if topic not in self._layouts:
            keys.check_name("topic", topic)
            self._learn(topic)
        checker = self._schemas[topic].current
        if checker is not None:
            checker.check(value)
            fields[codec.SCHEMA] = b"%d" % checker.version
        if self.ordered:
            self._in_order.append((topic, fields))
        else:
            self._buffer.setdefault(topic, []).append(fields)
        self._queued += 1
        if self._queued >= self.batch_size:
            self.flush()

    def _learn(self, topic: str, stale: str | None = None) -> None:
        """Read the topic's count and layout; wait while a repartition of it runs (bounded)."""
        partitions, layout = partition_count(
            self.broker.topics,
            topic,
            wait_s=self.repartition_wait_s,
            hint="nothing queued was lost: flush again later",
            stale=stale,
        )
        self._layouts[topic] = (partitions, layout)
        self._round_robin[topic] = itertools.cycle(range(partitions))
        if topic not in self._schemas:  # read once: a schema set later is checked from the next producer on
            self._schemas[topic] = topic_checks(self.broker, topic)

    def _routed(self, topic: str, entries: list[Fields]) -> dict[int, list[Fields]]:
        partitions, _ = self._layouts[topic]
        routed: dict[int, list[Fields]] = {}
        for fields in entries:
            key = fields.get(codec.KEY)
            partition = next(self._round_robin[topic]) if key is None else keys.partition_for(key, partitions)
            routed.setdefault(partition, []).append(fields)
        return routed

    def flush(self) -> None:
        """Write everything queued, in one pipelined round trip per topic.

        A partition whose layout moved on (a repartition) wrote nothing: its entries are routed
        again with the topic's new count, after waiting for the repartition to finish.

        Raises:
            BrokerError: Redis is unreachable, refused a write, or is near its ``maxmemory``;
                the queued entries are then kept, and some of them may have been written.
        """
        if self._in_order:
            self._flush_in_order()
        for topic in list(self._buffer):
            pending = self._buffer[topic]
            while pending:
                routed = self._routed(topic, pending)
                written = self.broker.publishing.add_in_layout(topic, self._layouts[topic][1], routed)
                pending = [f for partition, ids in written.items() if ids is None for f in routed[partition]]
                done = sum(len(routed[p]) for p, ids in written.items() if ids is not None)
                self.sent += done
                self._queued -= done
                self._buffer[topic] = pending
                if pending:  # refused: its layout moved on
                    self._learn(topic, stale=self._layouts[topic][1])
            del self._buffer[topic]

    def _flush_in_order(self) -> None:
        """An ordered producer's queue, one call per run of entries to one topic partition.

        Each call's ids follow the last id written (``lua/add.lua``), so they grow in send order
        across every stream written.
        """
        queue = self._in_order
        while queue:
            topic = queue[0][0]
            partitions, layout = self._layouts[topic]
            first = self._routed(topic, [queue[0][1]])
            partition = next(iter(first))
            run = [first[partition][0]]
            for other, fields in queue[1:]:
                key = fields.get(codec.KEY)
                if other != topic or key is None or keys.partition_for(key, partitions) != partition:
                    break
                run.append(fields)
            written = self.broker.publishing.add_in_layout(topic, layout, {partition: run}, self._last_id)
            ids = written[partition]
            if ids is None:  # its layout moved on: route the queue again with the new count
                self._learn(topic, stale=layout)
                continue
            self._last_id = ids[-1].decode()
            del queue[: len(run)]
            self.sent += len(run)
            self._queued -= len(run)

    def close(self) -> None:
        """Flush, then close the connection if the producer opened it."""
        self.flush()
        if self._own_broker:
            self.broker.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        elif self._own_broker:
            self.broker.close()
