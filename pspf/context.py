"""The ``Context`` a handler receives with each entry, and the one a timer receives."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pspf import codec, keys
from pspf.errors import ConfigError
from pspf.windows.timers import ScheduledCall, at_ms

if TYPE_CHECKING:
    from pspf.codec import StateDecoder
    from pspf.outbox.emit import Emitted, Emitter
    from pspf.outbox.views import View, Views, ViewWrite
    from pspf.windows.timers import PartitionTimers


class StateSource(Protocol):
    """Where a context loads its key's state from: the batch in hand, on top of the store."""

    @property
    def emitter(self) -> Emitter: ...

    @property
    def windows(self) -> Any:
        """The partition's open windows, a ``pspf.windows.aggregation.PartitionWindows``.

        Typed by name only: that module's window aggregations take a ``Context``, so this module
        cannot import it; only their handler uses this, and it names the type where it does.
        """

    @property
    def timers(self) -> PartitionTimers | None: ...

    #: the app's views by name (``App.view``), each appending to ``viewed``
    views: Views
    #: the view writes of this source's attempts, in order
    viewed: list[ViewWrite]

    def base(self, key: str) -> bytes | None: ...

    @property
    def state_decoder(self) -> StateDecoder: ...

    def table_row(
        self, name: str, key: str, before: bytes | None, what: str, check: bool, at: int | None = None
    ) -> Any:
        """A table's row as of the entry ``before`` (None: the latest); ``check`` the key's partition.

        ``at``: as of that event time (a versioned table), among the updates before the entry.
        """


class Attempt:
    """What one run of a handler (or scheduled callback) did, read by the code that runs it.

    A ``Context`` is its attempt, so that building one per entry allocates nothing more: the
    runner reads these slots after the handler returns and joins them to the batch, or drops
    them. Handlers use ``Context``'s own API instead.
    """

    __slots__ = (
        "base",
        "due_ms",
        "emitted",
        "entry_id",
        "loaded",
        "schedules",
        "source",
        "windowed",
    )

    #: the entry's stream id as Redis returned it (``Context.id`` decoded)
    entry_id: bytes
    #: where the key's state comes from, and the partition's emitter, windows and timers
    source: StateSource
    #: the key's state once the handler read ``state``; None: never read, so unchanged
    loaded: dict[str, Any] | None
    #: the key's encoded state when it was loaded (None: it had none)
    base: bytes | None
    #: the entries ``emit`` made, in order (None: none)
    emitted: list[Emitted] | None
    #: what the entry changes in its topic's windows: a list of ``pspf.windows.aggregation.Change``, one per
    #: window, None for a topic without windows (typed by name only, as ``StateSource.windows`` is)
    windowed: Any
    schedules: list[ScheduledCall] | None
    #: the time a scheduled callback was due; None: the entry's (the time Redis appended it)
    due_ms: int | None

    def drop(self) -> None:
        """Forget what it did, and whatever it still does: its handler ran past its deadline."""
        self.loaded = None
        self.emitted = None
        self.windowed = None
        self.schedules = None


class Context(Attempt):
    """What a handler knows about its entry, and ``state``: the entry's key's state in the app.

    ``ctx.state`` is a dict of values msgspec can encode. Changes join the batch's commit only if
    the handler returns; if it raises, they are dropped. Entries without a key share the state of
    the empty key ``""`` within their partition. ``emit`` sends entries to other topics the same
    way: with the batch, once, or not at all.
    """

    __slots__ = ("_headers", "delivery_count", "key", "partition", "topic")

    def __init__(
        self,
        topic: str,
        partition: int,
        entry_id: bytes,
        key: str,
        delivery_count: int,
        headers: dict[str, str] | None,
        source: StateSource,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.key = key
        self.delivery_count = delivery_count
        self.entry_id = entry_id
        self._headers = headers
        self.source = source
        self.loaded = None
        self.base = None
        self.emitted = None
        self.windowed = None
        self.schedules = None
        self.due_ms = None

    @property
    def id(self) -> str:
        """The entry's stream id, ``ms-seq``."""
        return self.entry_id.decode()

    @property
    def headers(self) -> dict[str, str]:
        """The entry's headers (empty when it has none), decoded with its value."""
        return {} if self._headers is None else self._headers

    @property
    def state(self) -> dict[str, Any]:
        """The state of this entry's key, loaded on first use."""
        state = self.loaded
        if state is None:
            self.base = base = self.source.base(self.key)
            state = self.loaded = {} if base is None else self.source.state_decoder.decode(self.key, base)
        return state

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
        entry = self.source.emitter.entry(
            self.topic, self.partition, self.entry_id, topic, value, key, headers
        )
        if self.emitted is None:
            self.emitted = [entry]
        else:
            self.emitted.append(entry)

    def table(self, name: str, key: str | None = None, at: int | None = None) -> Any:
        """The row of ``key`` (this entry's key by default) in table ``name``; None when it has none.

        A table (``App.table``) is looked up by keys of this entry's partition and shows the row
        as of this entry: every update with a smaller id, none after. A global table
        (``App.global_table``) takes any key and shows the row as of this worker's position.
        ``at`` (epoch ms; a versioned table): the row current at that event time, among the
        updates before this entry.

        Raises:
            TableError: the app has no such table, the key is in another partition, or ``at``
                is given for a table that is not versioned.
        """
        before = self.entry_id if self.due_ms is None else None  # a scheduled call: the latest
        if key is None:
            return self.source.table_row(name, self.key, before, "ctx.table", False, at)
        return self.source.table_row(name, key, before, "ctx.table", True, at)

    def view(self, name: str) -> View:
        """The app's view ``name`` (``App.view``): its writes reach Redis after this entry's batch commits.

        A hash view: ``ctx.view(name)[field] = value`` and ``del ctx.view(name)[field]``; a
        sorted set view: ``.add(member, score)`` and ``.remove(member)``. Each write is a final
        value, dropped with the state writes if the handler raises.

        Raises:
            ConfigError: the app has no such view.
        """
        return self.source.views[name]  # a miss: ``Views.__missing__``

    def schedule(self, at: datetime | int | timedelta, name: str, payload: Any = None) -> None:
        """Run ``@app.on_schedule(name)`` for this key once the partition's stream time reaches ``at``.

        ``at``: epoch milliseconds, an aware datetime, or a timedelta after this entry's time.
        One schedule per key and name: a new one replaces it. Written with this entry's batch, so
        dropped if the handler raises; run once, after the batch in which stream time reaches
        it (stream time: the largest entry time the partition has seen).
        """
        timers = self.source.timers
        if timers is None or name not in timers.callbacks:
            raise ConfigError(f"ctx.schedule: the app has no @app.on_schedule({name!r})")
        try:
            encoded = msgspec.msgpack.encode(payload)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise ConfigError(f"ctx.schedule: the payload cannot be encoded: {exc}") from None
        entry_ms = self.due_ms if self.due_ms is not None else int(self.entry_id.split(b"-", 1)[0])
        call = ScheduledCall(at_ms(at, entry_ms), name, self.key, encoded, (self.topic, self.entry_id))
        if self.schedules is None:
            self.schedules = [call]
        else:
            self.schedules.append(call)

    def __repr__(self) -> str:
        return f"Context(topic={self.topic!r}, partition={self.partition}, id={self.id!r}, key={self.key!r})"


class TimerContext:
    """What an ``@app.timer`` function gets: its partition, its period, and that partition's state.

    ``state(key)`` is the state of any key of this partition, changed the way ``ctx.state`` is;
    ``emit`` as in a handler. What it writes and emits commits only if the function returns.
    """

    def __init__(self, name: str, partition: int, time_ms: int, partitions: int, source: StateSource) -> None:
        self.name = name
        self.partition = partition
        #: the start of the period it runs for (epoch milliseconds, wall-clock time)
        self.time_ms = time_ms
        self._partitions = partitions
        self._source = source
        #: the attempt on each key whose state it read: their results join the batch if it returns
        self.attempts: dict[str, Context] = {}
        self._emitting = self._context("")
        #: what it emitted, joining the batch with its state writes
        self.emitted: list[Emitted] = []

    def _context(self, key: str) -> Context:
        entry_id = f"timer:{self.name}:{self.time_ms}".encode()
        return Context("", self.partition, entry_id, key, 1, None, self._source)

    def state(self, key: str) -> dict[str, Any]:
        """The state of ``key``, which must be one of this partition's keys."""
        context = self.attempts.get(key)
        if context is None:
            owner = keys.partition_for(codec.encode_text("key", key), self._partitions)
            if owner != self.partition:
                raise ConfigError(
                    f"timer {self.name}: key {key!r} is in partition {owner}, "
                    f"not in this run's {self.partition}"
                )
            context = self.attempts[key] = self._context(key)
        return context.state

    def table(self, name: str, key: str) -> Any:
        """The latest row of ``key`` in table ``name`` (a key of this partition, or of a global table)."""
        return self._source.table_row(name, key, None, f"timer {self.name}", True)

    def emit(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Emit an entry as ``ctx.emit`` does (its source id is ``timer:NAME:TIME_MS``)."""
        source = self._emitting
        entry = self._source.emitter.entry(
            source.topic, source.partition, source.entry_id, topic, value, key, headers
        )
        self.emitted.append(entry)

    def __repr__(self) -> str:
        return f"TimerContext(name={self.name!r}, partition={self.partition}, time_ms={self.time_ms})"
