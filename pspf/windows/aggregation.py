"""One ``@app.window`` (an ``Aggregation``) and one partition's open windows of every one of them.

``PartitionWindows.change`` is where each kind (``pspf.windows.kinds``) folds an entry into its
windows; ``close`` emits the results of the windows stream time closed, in the batch's commit.

Store layout (namespace ``__windows``; ``keys.window_key``, by topic and window name): a window's
accumulator, a closed session's marker, and a sliding aggregation's entries (kept while a window
could still need them); the stream time and the entry that set it in ``__time``. Stores written
before windows had names key a topic's window by the topic alone: ``PartitionWindows.load``
adopts such state as the window of that topic when the topic has exactly one, and moves it to
its new keys in the next commit.
"""

from __future__ import annotations

import bisect
import heapq
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import keys
from pspf.errors import ConfigError, LateEntry
from pspf.keys import StreamId
from pspf.windows.functions import TimestampFunc, declared_types, encode_acc, timestamp_reader
from pspf.windows.kinds import LatePolicy, WindowId, WindowSpec

if TYPE_CHECKING:
    from pspf.context import Context
    from pspf.outbox.emit import Emitted, Emitter
    from pspf.state_stores import StateStore

log = logging.getLogger("pspf.windows")


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
    ) -> None:
        where = f"window {name!r} of topic {topic!r}"
        if not isinstance(spec, WindowSpec):
            raise ConfigError(f"{where}: the spec must come from pspf.windows, got {spec!r}")
        if late not in ("drop", "dlq"):
            raise ConfigError(f"{where}: late must be 'drop' or 'dlq', got {late!r}")
        if spec.kind == "session" and merge is None:
            raise ConfigError(
                f"{where}: session windows need merge=(a, b) -> accumulator, "
                "to combine two sessions an entry bridges"
            )
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
        self._value_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(value_type)
        self._timestamp = timestamp_reader(where, timestamp)

    def fold(self, acc: bytes | None, value: Any) -> bytes:
        """The accumulator after ``value`` (``acc`` encoded, None for a new window), encoded."""
        current = None if acc is None else self._acc_decoder.decode(acc)
        return encode_acc(self.func(current, value))

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

    def handler(self, value: Any, ctx: Context) -> None:
        """What the entry's attempt runs for this window: it computes the entry's window changes.

        They join the partition's windows only if the whole attempt returns (as ``ctx.state``
        writes do): with those of the topic's other windows and its handler, or not at all.
        """
        windows: PartitionWindows = ctx.source.windows
        ts = self._timestamp(value, ctx)
        change = windows.change(self, ctx.key, ts, value, ctx.entry_id)
        if change.late and self.late == "dlq":
            raise LateEntry(
                f"late: event time {ts} is behind every open window of key {ctx.key!r} in window "
                f"{self.name!r} (stream time {windows.stream_ms}, grace {self.spec.grace_ms} ms)"
            )
        windowed = ctx.windowed
        if windowed is None:
            ctx.windowed = [change]
        else:
            windowed.append(change)


_NO_REMOVES: list[tuple[int, int]] = []  # shared by every tumbling and hopping change: never written to


# -- one partition's open windows -----------------------------------------------------------------


class Change(NamedTuple):
    """What one entry does to a window's state, applied only if its whole attempt returns."""

    #: the window's name
    window: str
    key: str
    ts: int
    entry_id: bytes
    #: accumulators to set (new or updated windows), as (start, end, encoded)
    sets: list[tuple[int, int, bytes]]
    #: sessions merged into another one
    removes: list[tuple[int, int]]
    #: a sliding aggregation keeps the entry itself (encoded) for windows created later
    kept: bytes | None
    late: bool


class _Open:
    """One aggregation's open windows in one partition, in memory (the store holds the same)."""

    def __init__(self, aggregation: Aggregation) -> None:
        self.aggregation = aggregation
        self.accs: dict[WindowId, bytes] = {}
        #: (close at, key, start, end); stale once a window is gone (closed or merged)
        self.closing: list[tuple[int, str, int, int]] = []
        #: sessions: each key's open sessions and its closed ones that an entry could still bridge
        self.sessions: dict[str, list[tuple[int, int]]] = {}
        self.closed: dict[str, list[tuple[int, int]]] = {}
        #: sliding: each key's kept entries, (event time, entry id, encoded value) in that order
        self.entries: dict[str, list[tuple[int, bytes, bytes]]] = {}
        #: (forget at, kind, key, a, b): closed-session markers ("c") and kept entries ("e")
        self.forget: list[tuple[int, str, str, int, Any]] = []


class PartitionWindows:
    """The open windows of every aggregation of one owned partition, and its stream time.

    Changes are applied in memory as entries succeed and written to the store by the batch's
    commit (``writes``); a commit that fails stops the worker, which then drops all of this.
    """

    def __init__(self, aggregations: dict[str, Aggregation]) -> None:
        #: by window name
        self.open = {name: _Open(a) for name, a in aggregations.items()}
        self.stream_ms: int | None = None
        #: the entry that last moved stream time: results name it as their source
        self.source: tuple[str, bytes] = ("", b"0-0")
        #: window state to write at the next commit: (name, kind, key, a, b) -> value, None to delete
        self._dirty: dict[tuple[str, str, str, int, int | str], bytes | None] = {}
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
        by_topic: dict[str, list[_Open]] = {}
        for state in windows.open.values():
            by_topic.setdefault(state.aggregation.topic, []).append(state)
        unplaced: dict[str, int] = {}
        for stored, value in store.items(keys.WINDOWS_NAMESPACE):
            found = keys.split_window_key(stored)
            if found.name:
                named = windows.open.get(found.name)
                if named is not None and named.aggregation.topic == found.topic:
                    windows._restore(named, found, value)
            elif len(by_topic.get(found.topic, ())) == 1:
                adopter = by_topic[found.topic][0]
                windows._restore(adopter, found, value)
                windows._adopt(adopter, stored, found, value)
            elif found.topic in by_topic:
                unplaced[found.topic] = unplaced.get(found.topic, 0) + 1
        for topic, count in unplaced.items():
            log.warning(
                "%s values of window state keyed by topic %r alone (written before windows had names) "
                "are left alone: the topic has several windows (%s), and which one they belong to is "
                "unknown; declare one window on the topic to adopt them",
                count,
                topic,
                ", ".join(s.aggregation.name for s in by_topic[topic]),
            )
        for state in windows.open.values():
            heapq.heapify(state.closing)
            heapq.heapify(state.forget)
        return windows

    def _adopt(self, state: _Open, stored: str, found: keys.WindowKey, value: bytes) -> None:
        """Move the state at ``stored``, keyed by its topic alone, to its window's key."""
        aggregation = state.aggregation
        self._moved[(keys.WINDOWS_NAMESPACE, stored)] = None
        new = keys.window_key(aggregation.topic, aggregation.name, found.kind, found.key, found.a, found.b)
        self._moved[(keys.WINDOWS_NAMESPACE, new)] = value

    def _restore(self, state: _Open, found: keys.WindowKey, value: bytes) -> None:
        spec = state.aggregation.spec
        kind, key, a, b = found.kind, found.key, found.a, found.b
        if kind == "w":
            end = int(b)
            state.accs[(key, a, end)] = value
            state.closing.append((spec.close_at(a, end), key, a, end))
            if spec.kind == "session":
                bisect.insort(state.sessions.setdefault(key, []), (a, end))
        elif kind == "c":
            bisect.insort(state.closed.setdefault(key, []), (a, int(b)))
            state.forget.append((_forget_session_at(spec, int(b)), "c", key, a, int(b)))
        else:
            entry_id = b.encode()
            bisect.insort(state.entries.setdefault(key, []), (a, entry_id, value))
            state.forget.append((_forget_entry_at(spec, a), "e", key, a, entry_id))

    # -- one entry ----------------------------------------------------------------------------

    def change(self, aggregation: Aggregation, key: str, ts: int, value: Any, entry_id: bytes) -> Change:
        """The windows ``value`` at ``ts`` changes (nothing applied yet: see ``apply``)."""
        state = self.open[aggregation.name]
        stream_ms = self.stream_ms
        now = ts if stream_ms is None or ts > stream_ms else stream_ms
        spec = aggregation.spec
        kind = spec.kind
        if kind == "session":
            return self._session(state, key, ts, value, entry_id, now)
        if kind == "sliding":
            return self._sliding(state, key, ts, value, entry_id, now)
        size, step, grace = spec.size_ms, spec.step_ms, spec.grace_ms
        accs, fold = state.accs, aggregation.fold
        sets = []
        start = ts - ts % step
        while start > ts - size:
            end = start + size
            if end + grace > now:  # close_at of [start, end)
                sets.append((start, end, fold(accs.get((key, start, end)), value)))
            start -= step
        return Change(aggregation.name, key, ts, entry_id, sets, _NO_REMOVES, None, not sets)

    def _session(self, state: _Open, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """The session ``value`` joins (merging those it bridges), or late.

        Every test is against ``now``, not against what the last batch's close swept: a session
        that stream time closed counts as closed before it is swept, so results never depend on
        where batches begin and end (a replay after a crash batches differently).
        """
        aggregation = state.aggregation
        spec = aggregation.spec
        gap = spec.size_ms
        touched = []
        late = False
        for s, e in state.sessions.get(key, ()):
            if s - gap <= ts <= e + gap:
                if spec.close_at(s, e) > now:
                    touched.append((s, e))
                elif _forget_session_at(spec, e) > now:
                    late = True
        late = late or any(
            s - gap <= ts <= e + gap and _forget_session_at(spec, e) > now
            for s, e in state.closed.get(key, ())
        )
        start = min([ts, *(s for s, _ in touched)])
        end = max([ts, *(e for _, e in touched)])
        if late or spec.close_at(start, end) <= now:
            return Change(aggregation.name, key, ts, entry_id, [], [], None, True)
        accs = [state.accs[(key, s, e)] for s, e in touched]
        base = None if not accs else accs[0] if len(accs) == 1 else aggregation.merged(accs)
        acc = aggregation.fold(base, value)
        return Change(aggregation.name, key, ts, entry_id, [(start, end, acc)], touched, None, False)

    def _sliding(self, state: _Open, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """Every open window ``value`` falls in, and the windows it creates (see the module)."""
        aggregation = state.aggregation
        spec = aggregation.spec
        size = spec.size_ms
        entries = state.entries.get(key, [])
        lo = bisect.bisect_left(entries, (ts - size - 1,))
        hi = bisect.bisect_left(entries, (ts + size + 2,))
        near = entries[lo:hi]
        # Windows holding ts: the left window of each entry at [ts, ts + size], the right window
        # of each entry at [ts - size - 1, ts - 1], and this entry's own left window.
        bounds = {(ts - size, ts)}
        for t, *_ in near:
            if ts <= t <= ts + size:
                bounds.add((t - size, t))
            if ts - size - 1 <= t < ts:
                bounds.add((t + 1, t + 1 + size))
        sets = []
        for start, end in sorted(bounds):
            if spec.close_at(start, end) <= now:
                continue
            acc = state.accs.get((key, start, end))
            if acc is None:
                acc = self._fold_kept(state, near, start, end)
            sets.append((start, end, aggregation.fold(acc, value)))
        if not sets:  # late: it creates no window either
            return Change(aggregation.name, key, ts, entry_id, [], [], None, True)
        # This entry's right window, created when entries already fall in it.
        start, end = ts + 1, ts + 1 + size
        if (key, start, end) not in state.accs and spec.close_at(start, end) > now:
            inside = [kept for kept in near if start <= kept[0] <= end]
            if inside:
                acc = self._fold_kept(state, inside, start, end)
                assert acc is not None
                sets.append((start, end, acc))
        return Change(aggregation.name, key, ts, entry_id, sets, [], msgspec.msgpack.encode(value), False)

    def _fold_kept(
        self, state: _Open, near: list[tuple[int, bytes, bytes]], start: int, end: int
    ) -> bytes | None:
        """The accumulator of the kept entries in ``[start, end]``, folded in arrival order."""
        aggregation = state.aggregation
        acc = None
        inside = sorted((StreamId.parse(i), value) for t, i, value in near if start <= t <= end)
        for _, value in inside:
            acc = aggregation.fold(acc, aggregation.value(value))
        return acc

    def apply(self, changes: list[Change]) -> None:
        """Make an entry's changes the partition's (its attempt returned), in order."""
        for change in changes:
            name = change.window
            if change.late:
                self.late[name] = self.late.get(name, 0) + 1
                continue
            state = self.open[name]
            spec = state.aggregation.spec
            key, ts = change.key, change.ts
            if self.stream_ms is None or ts > self.stream_ms:  # what _set_stream_time does, inline
                self.stream_ms, self._time_moved = ts, True
                self.source = (state.aggregation.topic, change.entry_id)
            for start, end in change.removes:
                self._drop_window(state, key, start, end)
            accs, dirty = state.accs, self._dirty
            for start, end, acc in change.sets:
                window = (key, start, end)
                if window not in accs:
                    heapq.heappush(state.closing, (spec.close_at(start, end), key, start, end))
                    if spec.kind == "session":
                        bisect.insort(state.sessions.setdefault(key, []), (start, end))
                accs[window] = acc
                dirty[(name, "w", key, start, end)] = acc
            if change.kept is not None:
                entry_id = change.entry_id
                bisect.insort(state.entries.setdefault(key, []), (ts, entry_id, change.kept))
                heapq.heappush(state.forget, (_forget_entry_at(spec, ts), "e", key, ts, entry_id))
                self._write(name, "e", key, ts, entry_id.decode(), change.kept)

    def _write(self, name: str, kind: str, key: str, a: int, b: int | str, value: bytes | None) -> None:
        self._dirty[(name, kind, key, a, b)] = value

    def _set_stream_time(self, ms: int, source: tuple[str, bytes]) -> None:
        self.stream_ms, self.source = ms, source
        self._time_moved = True

    def writes(self) -> dict[tuple[str, str], bytes | None]:
        """The store writes since the last commit: (namespace, key) -> value, None to delete."""
        found = dict(self._moved)
        topics = {name: state.aggregation.topic for name, state in self.open.items()}
        for (name, kind, key, a, b), value in self._dirty.items():
            found[(keys.WINDOWS_NAMESPACE, keys.window_key(topics[name], name, kind, key, a, b))] = value
        if self._time_moved:
            found[(keys.TIME_NAMESPACE, keys.STREAM_TIME)] = msgspec.msgpack.encode(
                (self.stream_ms, *self.source)
            )
        return found

    def committed(self) -> None:
        self._dirty = {}
        self._moved = {}
        self._time_moved = False

    def advance(self, ms: int, source: tuple[str, bytes]) -> None:
        """Entries of a plain handler, up to ``source`` at ``ms``, were applied."""
        if self.stream_ms is None or ms > self.stream_ms:
            self._set_stream_time(ms, source)

    def _drop_window(self, state: _Open, key: str, start: int, end: int) -> None:
        del state.accs[(key, start, end)]
        self._write(state.aggregation.name, "w", key, start, end, None)
        if state.aggregation.spec.kind == "session":
            sessions = state.sessions[key]
            sessions.remove((start, end))
            if not sessions:
                del state.sessions[key]

    # -- closing ------------------------------------------------------------------------------

    def close(self, emitter: Emitter, partition: int) -> list[Emitted]:
        """Close the windows stream time has passed: their results, in close order, to emit.

        Their state goes in the same commit (``writes``), with what no open window needs any more.
        """
        now = self.stream_ms
        if now is None:
            return []
        results: list[Emitted] = []
        for name, state in self.open.items():
            aggregation = state.aggregation
            closing = state.closing
            while closing and closing[0][0] <= now:
                _, key, start, end = heapq.heappop(closing)
                acc = state.accs.get((key, start, end))
                if acc is None:  # merged into another session
                    continue
                self._drop_window(state, key, start, end)
                if aggregation.spec.kind == "session":
                    bisect.insort(state.closed.setdefault(key, []), (start, end))
                    forget_at = _forget_session_at(aggregation.spec, end)
                    heapq.heappush(state.forget, (forget_at, "c", key, start, end))
                    self._write(name, "c", key, start, end, b"")
                value = {"key": key, "start": start, "end": end, "value": aggregation.result(acc)}
                results.append(emitter.result(aggregation.emit_to, key, value, self.source, partition))
            self._forget(state, now)
        return results

    def _forget(self, state: _Open, now: int) -> None:
        forget = state.forget
        name = state.aggregation.name
        while forget and forget[0][0] <= now:
            _, kind, key, a, b = heapq.heappop(forget)
            if kind == "c":
                closed = state.closed[key]
                closed.remove((a, b))
                if not closed:
                    del state.closed[key]
                self._write(name, "c", key, a, b, None)
            else:
                entries = state.entries[key]
                del entries[bisect.bisect_left(entries, (a, b))]
                if not entries:
                    del state.entries[key]
                self._write(name, "e", key, a, b.decode(), None)

    def idle_close_due(self, idle_s: float, now: float) -> bool:
        """True when windows are open and no entry came for ``idle_s`` seconds before ``now`` (monotonic)."""
        return now - self.last_entry_at >= idle_s and any(s.accs for s in self.open.values())

    def advance_to_close_all(self) -> None:
        """Move stream time to where every open window is closed (an idle partition)."""
        ends = [c for s in self.open.values() for c, *_ in s.closing]
        if not ends:
            return
        target = max(ends)
        if self.stream_ms is None or target > self.stream_ms:
            self._set_stream_time(target, self.source)

    def take_late(self) -> dict[str, int]:
        """The late entries not applied since the last call, by window name."""
        late, self.late = self.late, {}
        return late


def _forget_session_at(spec: WindowSpec, end: int) -> int:
    """When a closed session's marker can go: no entry that could bridge it is on time then."""
    return end + 2 * spec.size_ms + spec.grace_ms + 1


def _forget_entry_at(spec: WindowSpec, ts: int) -> int:
    """When a sliding entry can go: every window it falls in, or creates, has closed."""
    return ts + spec.size_ms + spec.grace_ms + 2
