"""One ``@app.window`` (an ``Aggregation``) and one partition's open windows of every one of them.

``PartitionWindows`` holds, for each aggregation, an instance of its kind (``pspf.windows.kinds``:
which windows an entry falls in, what the kind keeps beside them) and the partition's stream
time; ``close`` emits the results of the windows stream time closed, in the batch's commit.
Nothing here depends on the kind.

Store layout (namespace ``__windows``; ``keys.window_key``, by topic and window name): a window's
accumulator ("w"), and what its kind keeps (a closed session's marker "c", a sliding aggregation's
entries "e", kept while a window could still need them); the stream time and the entry that
set it in ``__time``. Stores written before windows had names key a topic's window by the topic
alone: ``PartitionWindows.load``
adopts such state as the window of that topic when the topic has exactly one, and moves it to
its new keys in the next commit.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import keys
from pspf.errors import ConfigError, LateEntry
from pspf.windows.functions import TimestampFunc, declared_types, encode_acc, timestamp_reader
from pspf.windows.kinds.base import Change, LatePolicy, WindowKind, WindowSpec, kind_of

if TYPE_CHECKING:
    from pspf.context import Context
    from pspf.outbox.emit import Emitted, Emitter
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.windows")

_acc_encode = msgspec.msgpack.Encoder().encode


class Aggregation:
    """One ``@app.window``: how an entry's event time is found and folded into its windows."""

    def __init__(
        self,
        name: str,
        topic: str,
        spec: WindowSpec,
        func: Callable[[Any, Any], Any],
        emit_to: str,
        timestamp: str | TimestampFunc | None,
        late: LatePolicy,
        merge: Callable[[Any, Any], Any] | None,
        kind: type[WindowKind] | None = None,
    ) -> None:
        where = f"window {name!r} of topic {topic!r}"
        if not isinstance(spec, WindowSpec):
            raise ConfigError(f"{where}: the spec must come from pspf.windows, got {spec!r}")
        if late not in ("drop", "dlq"):
            raise ConfigError(f"{where}: late must be 'drop' or 'dlq', got {late!r}")
        #: the kind its windows are: by default the spec's registered kind
        self.kind: type[WindowKind] = kind or kind_of(spec.kind)
        self.kind.check(spec, where, merge)
        if inspect.iscoroutinefunction(func):
            raise ConfigError(f"window function {func.__qualname__} must be a plain def, not async")
        self.name = name
        self.topic = topic
        self.spec = spec
        self.func = func
        self.emit_to = emit_to
        self.late = late
        self.merge = merge
        acc_type, value_type = declared_types(func)
        self.value_type = value_type
        self._acc_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(acc_type)
        self._acc_decode = self._acc_decoder.decode
        self._value_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(value_type)
        self._timestamp = timestamp_reader(where, timestamp)
        #: the field holding the event time (None: the entry id's time, or a function)
        self._field = timestamp if isinstance(timestamp, str) else None
        #: a dataflow's window (``pspf.dataflow``): its values come from its chain, not from the
        #: topic's entries, and it keeps a stream time of its own (they may come through a
        #: re-keying topic, after the partition's other entries); else the partition's
        self.chained = False
        #: the name its own stream time is kept under (a chain's window: its name; a join's two
        #: sides share the join's)
        self.clock = name

    def fold(self, acc: bytes | None, value: Any) -> bytes:
        """The accumulator after ``value`` (``acc`` encoded, None for a new window), encoded."""
        new = self.func(None if acc is None else self._acc_decode(acc), value)
        try:  # encode_acc, inline: this runs for every entry
            return _acc_encode(new)
        except (TypeError, msgspec.EncodeError, OverflowError):
            return encode_acc(new)  # raises the error that says what is wrong

    def merged(self, accs: list[bytes]) -> bytes:
        assert self.merge is not None
        result = self._acc_decoder.decode(accs[0])
        for acc in accs[1:]:
            result = self.merge(result, self._acc_decoder.decode(acc))
        return encode_acc(result)

    def result(self, acc: bytes) -> Any:
        return self._acc_decoder.decode(acc)

    def value(self, raw: bytes) -> Any:
        return self._value_decoder.decode(raw)

    def closed(
        self,
        emitter: Emitter,
        window: tuple[str, int, int],
        acc: bytes,
        source: tuple[str, bytes],
        partition: int,
    ) -> list[Emitted]:
        """What a closed window emits: ``{"key", "start", "end", "value"}`` to ``emit_to``."""
        key, start, end = window
        value = {"key": key, "start": start, "end": end, "value": self.result(acc)}
        return [emitter.result(self.emit_to, key, value, source, partition)]

    def handler(self, value: Any, ctx: Context) -> None:
        """What the entry's attempt runs for this window: it computes the entry's window changes.

        They join the partition's windows only if the whole attempt returns (as ``ctx.state``
        writes do): with those of the topic's other windows and its handler, or not at all.
        """
        windows: PartitionWindows = ctx.source.windows
        # what the timestamp reader, windows.change and attempted do, inline: this runs for every entry
        field = self._field
        ts = value.get(field) if field is not None and type(value) is dict else None
        if type(ts) is not int:
            ts = self._timestamp(value, ctx)
        stream_ms = windows.time_of(self.clock) if self.chained else windows.stream_ms
        now = ts if stream_ms is None or ts > stream_ms else stream_ms
        change = windows.open[self.name].change(ctx.key, ts, value, ctx.entry_id, now)
        if change.late:
            self.attempted(windows, change, ctx)
            return
        windowed = ctx.windowed
        if windowed is None:
            ctx.windowed = [change]
        else:
            windowed.append(change)

    def attempted(self, windows: PartitionWindows, change: Change, ctx: Context) -> None:
        """Join an entry's change to its attempt; a late one fails the entry when ``late="dlq"``."""
        if change.late and self.late == "dlq":
            now = windows.time_of(self.clock) if self.chained else windows.stream_ms
            raise LateEntry(
                f"late: event time {change.ts} is behind every open window of key {ctx.key!r} in "
                f"window {self.name!r} (stream time {now}, grace {self.spec.grace_ms} ms)"
            )
        windowed = ctx.windowed
        if windowed is None:
            ctx.windowed = [change]
        else:
            windowed.append(change)


# -- one partition's open windows -----------------------------------------------------------------


class PartitionWindows:
    """The open windows of every aggregation of one owned partition, and its stream time.

    Each aggregation's open windows are an instance of its kind (``pspf.windows.kinds``): this
    class keeps what they share, stream time, and turns closed windows into results. Changes
    are applied in memory as entries succeed and written to the store by the batch's commit
    (``writes``); a commit that fails stops the worker, which then drops all of this.
    """

    def __init__(self, aggregations: dict[str, Aggregation]) -> None:
        self.aggregations = aggregations
        #: by window name
        self.open: dict[str, WindowKind] = {name: a.kind(name, a.spec, a) for name, a in aggregations.items()}
        self.stream_ms: int | None = None
        #: the entry that last moved stream time: results name it as their source
        self.source: tuple[str, bytes] = ("", b"0-0")
        #: the stream times of the windows that keep their own (``Aggregation.chained``), by
        #: clock (``Aggregation.clock``): (ms, source); and the clocks moved since the last commit
        self.own: dict[str, tuple[int, tuple[str, bytes]]] = {}
        self._clock_of = {name: a.clock for name, a in aggregations.items() if a.chained}
        self._own_moved: set[str] = set()
        #: store writes that move adopted state from a topic's key to its window's (``load``)
        self._moved: dict[tuple[str, str], bytes | None] = {}
        self._time_moved = False
        #: late entries not applied since ``take_late``, by window name
        self.late: dict[str, int] = {}
        #: when the partition last had a batch of entries, monotonic (``TimeKeeping`` sets it)
        self.last_entry_at = 0.0

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def load(cls, store: StateStore, aggregations: dict[str, Aggregation]) -> PartitionWindows:
        """The partition's windows as its store holds them.

        State of a window the app no longer declares is left alone. State keyed by a topic
        alone (written before windows had names) is the window of that topic when it has
        exactly one, and moves to that window's keys in the next commit; with several, which
        one it was is unknown: it is left alone, and the log says so.
        """
        windows = cls(aggregations)
        raw = store.get(keys.TIME_NAMESPACE, keys.STREAM_TIME)
        if raw is not None:
            stream_ms, topic, entry_id = msgspec.msgpack.decode(raw, type=tuple[int, str, bytes])
            windows.stream_ms, windows.source = stream_ms, (topic, entry_id)
        for clock in set(windows._clock_of.values()):
            raw = store.get(keys.TIME_NAMESPACE, keys.window_time_key(clock))
            if raw is not None:
                ms, topic, entry_id = msgspec.msgpack.decode(raw, type=tuple[int, str, bytes])
                windows.own[clock] = (ms, (topic, entry_id))
        by_topic: dict[str, list[str]] = {}
        for name, aggregation in aggregations.items():
            by_topic.setdefault(aggregation.topic, []).append(name)
        unplaced: dict[str, int] = {}
        for stored, value in store.items(keys.WINDOWS_NAMESPACE):
            found = keys.split_window_key(stored)
            if found.name:
                named = aggregations.get(found.name)
                if named is not None and named.topic == found.topic:
                    windows.open[found.name].restore(found, value)
            elif len(by_topic.get(found.topic, ())) == 1:
                adopter = by_topic[found.topic][0]
                windows.open[adopter].restore(found, value)
                windows._adopt(aggregations[adopter], stored, found, value)
            elif found.topic in by_topic:
                unplaced[found.topic] = unplaced.get(found.topic, 0) + 1
        for topic, count in unplaced.items():
            log.warning(
                "%s values of window state keyed by topic %r alone (written before windows had names) "
                "are left alone: the topic has several windows (%s), and which one they belong to is "
                "unknown; declare one window on the topic to adopt them",
                count,
                topic,
                ", ".join(by_topic[topic]),
            )
        for state in windows.open.values():
            state.heapify()
        return windows

    def _adopt(self, aggregation: Aggregation, stored: str, found: keys.WindowKey, value: bytes) -> None:
        """Move the state at ``stored``, keyed by its topic alone, to its window's key."""
        self._moved[(keys.WINDOWS_NAMESPACE, stored)] = None
        new = keys.window_key(aggregation.topic, aggregation.name, found.kind, found.key, found.a, found.b)
        self._moved[(keys.WINDOWS_NAMESPACE, new)] = value

    # -- one entry ----------------------------------------------------------------------------

    def change(self, aggregation: Aggregation, key: str, ts: int, value: Any, entry_id: bytes) -> Change:
        """The windows ``value`` at ``ts`` changes (nothing applied yet: see ``apply``)."""
        stream_ms = self.stream_ms if not aggregation.chained else self.time_of(aggregation.clock)
        now = ts if stream_ms is None or ts > stream_ms else stream_ms
        return self.open[aggregation.name].change(key, ts, value, entry_id, now)

    def time_of(self, clock: str) -> int | None:
        """The stream time a window that keeps its own keeps under ``clock``."""
        own = self.own.get(clock)
        return None if own is None else own[0]

    def apply(self, changes: list[Change]) -> None:
        """Make an entry's changes the partition's (its attempt returned), in order."""
        for change in changes:
            name = change.window
            if change.late:
                self.late[name] = self.late.get(name, 0) + 1
                continue
            ts = change.ts
            clock = self._clock_of.get(name) if self._clock_of else None
            if clock is not None:
                own = self.own.get(clock)
                if own is None or ts > own[0]:
                    self.own[clock] = (ts, (self.aggregations[name].topic, change.entry_id))
                    self._own_moved.add(clock)
            elif self.stream_ms is None or ts > self.stream_ms:  # what _set_stream_time does, inline
                self.stream_ms, self._time_moved = ts, True
                self.source = (self.aggregations[name].topic, change.entry_id)
            self.open[name].apply(change)

    def _set_stream_time(self, ms: int, source: tuple[str, bytes]) -> None:
        self.stream_ms, self.source = ms, source
        self._time_moved = True

    def writes(self) -> dict[tuple[str, str], bytes | None]:
        """The store writes since the last commit: (namespace, key) -> value, None to delete."""
        found = dict(self._moved)
        for name, state in self.open.items():
            topic = self.aggregations[name].topic
            accs = state.accs
            prefix = keys.window_prefix(topic, name, "w")
            for window in state.changed:  # keys.window_key, inline
                key, start, end = window
                found[(keys.WINDOWS_NAMESPACE, f"{prefix}{start}/{end}/{key}")] = accs.get(window)
            for (kind, key, a, b), value in state.dirty.items():
                found[(keys.WINDOWS_NAMESPACE, keys.window_key(topic, name, kind, key, a, b))] = value
        if self._time_moved:
            found[(keys.TIME_NAMESPACE, keys.STREAM_TIME)] = msgspec.msgpack.encode(
                (self.stream_ms, *self.source)
            )
        for name in self._own_moved:
            ms, source = self.own[name]
            found[(keys.TIME_NAMESPACE, keys.window_time_key(name))] = msgspec.msgpack.encode((ms, *source))
        return found

    def committed(self) -> None:
        for state in self.open.values():
            state.changed = set()
            state.dirty = {}
        self._moved = {}
        self._time_moved = False
        self._own_moved = set()

    def advance(self, ms: int, source: tuple[str, bytes]) -> None:
        """Entries of a plain handler, up to ``source`` at ``ms``, were applied."""
        if self.stream_ms is None or ms > self.stream_ms:
            self._set_stream_time(ms, source)

    # -- closing ------------------------------------------------------------------------------

    def close(self, emitter: Emitter, partition: int) -> list[Emitted]:
        """Close the windows stream time has passed: their results, in close order, to emit.

        Their state goes in the same commit (``writes``), with what no open window needs any more.
        """
        results: list[Emitted] = []
        for name, state in self.open.items():
            aggregation = self.aggregations[name]
            now, source = (
                self.own.get(aggregation.clock, (None, self.source))
                if aggregation.chained
                else (self.stream_ms, self.source)
            )
            if now is None:
                continue
            for key, start, end, acc in state.close(now):
                results += aggregation.closed(emitter, (key, start, end), acc, source, partition)
        return results

    def idle_close_due(self, idle_s: float, now: float) -> bool:
        """True when windows are open and no entry came for ``idle_s`` seconds before ``now`` (monotonic)."""
        return now - self.last_entry_at >= idle_s and any(s.accs for s in self.open.values())

    def advance_to_close_all(self) -> None:
        """Move stream time to where every open window is closed (an idle partition)."""
        ends = []
        for name, state in self.open.items():
            if not state.closing:
                continue
            last = max(c for c, *_ in state.closing)
            if not self.aggregations[name].chained:
                ends.append(last)
                continue
            clock = self.aggregations[name].clock
            ms, source = self.own.get(clock, (None, ("", b"0-0")))
            if ms is None or last > ms:
                self.own[clock] = (last, source)
                self._own_moved.add(clock)
        if not ends:
            return
        target = max(ends)
        if self.stream_ms is None or target > self.stream_ms:
            self._set_stream_time(target, self.source)

    def take_late(self) -> dict[str, int]:
        """The late entries not applied since the last call, by window name."""
        late, self.late = self.late, {}
        return late
