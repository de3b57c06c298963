"""Writing entries to topics from Python, in the wire format, pipelined."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from pspf import codec, keys
from pspf.broker import Broker, Fields
from pspf.settings import Settings


class Producer:
    """Buffers entries and writes them with pipelined XADDs, ``batch_size`` per round trip.

    Keyed entries go to ``CRC32(key) % partitions``; entries without a key are spread round-robin.
    Use it as a context manager (or call ``flush``) so the last entries are written.
    """

    def __init__(
        self, broker: Broker | None = None, batch_size: int = 1000, settings: Settings | None = None
    ) -> None:
        self._own_broker = broker is None
        self.broker = broker or Broker((settings or Settings.load()).redis)
        self.batch_size = batch_size
        self._buffer: list[tuple[str, Fields]] = []
        self._partitions: dict[str, int] = {}
        self._round_robin: dict[str, Iterator[int]] = {}
        self.sent = 0

    def send(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Queue one entry; ``value`` is encoded as JSON unless it is bytes already.

        Raises:
            ConfigError: the value cannot be encoded as JSON, or as in ``send_raw``.
        """
        self.send_raw(topic, codec.encode_value(value), key, headers)

    def send_raw(
        self, topic: str, value: bytes, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Queue one entry whose value bytes are already encoded.

        Raises:
            ConfigError: the topic name is invalid, or the key or a header is not UTF-8 text
                (checked before Redis is asked anything).
        """
        fields = codec.entry_fields(value, key, headers)
        partitions = self._partitions.get(topic)
        if partitions is None:
            keys.check_name("topic", topic)
            partitions = self._partitions[topic] = self.broker.topic_partitions(topic)
            self._round_robin[topic] = itertools.cycle(range(partitions))
        if key is None:
            partition = next(self._round_robin[topic])
        else:
            partition = keys.partition_for(fields[codec.KEY], partitions)
        self._buffer.append((keys.stream_key(topic, partition), fields))
        if len(self._buffer) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        """Write everything queued."""
        if self._buffer:
            self.broker.add_entries(self._buffer)
            self.sent += len(self._buffer)
            self._buffer = []

    def close(self) -> None:
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
