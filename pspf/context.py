"""The ``Context`` a handler receives with each entry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pspf import codec

if TYPE_CHECKING:
    from pspf.codec import StateDecoder
    from pspf.outbox import Emitter
    from pspf.windows import Change, PartitionWindows

#: An emitted entry, as ``pspf.outbox`` stores it: (topic, partition, key or None, value, source
#: topic, source entry id, headers or None: only when the handler gave some).
Emitted = tuple[str, int, bytes | None, bytes, str, bytes, bytes | None]


class StateSource(Protocol):
    """Where a context loads its key's state from: the batch in hand, on top of the store."""

    @property
    def emitter(self) -> Emitter: ...

    @property
    def windows(self) -> PartitionWindows: ...

    def base(self, key: str) -> bytes | None: ...

    @property
    def state_decoder(self) -> StateDecoder: ...


class Context:
    """What a handler knows about its entry, and ``state``: the entry's key's state in the app.

    ``ctx.state`` is a dict of values msgspec can encode. Changes join the batch's commit only if
    the handler returns; if it raises, they are dropped. Entries without a key share the state of
    the empty key ``""`` within their partition. ``emit`` sends entries to other topics the same
    way: with the batch, once, or not at all.
    """

    __slots__ = (
        "_base",
        "_emits",
        "_headers",
        "_id",
        "_source",
        "_state",
        "_windowed",
        "delivery_count",
        "key",
        "partition",
        "topic",
    )

    def __init__(
        self,
        topic: str,
        partition: int,
        entry_id: bytes,
        key: str,
        delivery_count: int,
        headers: bytes | None,
        source: StateSource,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.key = key
        self.delivery_count = delivery_count
        self._id = entry_id
        self._headers = headers
        self._source = source
        self._state: dict[str, Any] | None = None
        self._base: bytes | None = None
        self._emits: list[Emitted] | None = None
        #: what a window aggregation's entry changes in its windows (``pspf.windows.Change``)
        self._windowed: Change | None = None

    @property
    def id(self) -> str:
        """The entry's stream id, ``ms-seq``."""
        return self._id.decode()

    @property
    def headers(self) -> dict[str, str]:
        """The entry's headers (empty when it has none)."""
        return codec.decode_headers(self._headers)

    @property
    def state(self) -> dict[str, Any]:
        """The state of this entry's key, loaded on first use."""
        if self._state is None:
            self._base = base = self._source.base(self.key)
            self._state = {} if base is None else self._source.state_decoder.decode(self.key, base)
        return self._state

    def emit(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Emit an entry to ``topic``: published exactly once after this entry's batch commits.

        The value is encoded as by ``Producer.send`` (JSON; bytes as they are); ``key`` picks the
        partition (without one, the entry goes to this entry's partition number, modulo the
        topic's count). Entries carry ``pspf-source-*`` headers naming this entry. If the handler
        raises, its emits are dropped with its state writes.

        Raises:
            EmitError: no such topic, or a value, key or header that cannot be encoded; the
                entry fails like on any handler error (retries, then the DLQ).
        """
        entry = self._source.emitter.entry(self, topic, value, key, headers)
        if self._emits is None:
            self._emits = [entry]
        else:
            self._emits.append(entry)

    def __repr__(self) -> str:
        return f"Context(topic={self.topic!r}, partition={self.partition}, id={self.id!r}, key={self.key!r})"
