"""What every window kind is: ``WindowSpec``, the ``WindowKind`` protocol and the registry.

A kind is one subclass of ``WindowKind`` in a module of its own, registered by name
(``register``, in ``pspf.windows.kinds``). The class answers what varies by kind:

- ``last_ms``: until which event time a window can change (its close is that plus grace);
- ``check``: what a declaration of the kind needs (a session needs ``merge=``);
- ``example``: a spec of the kind, for the conformance suite (``tests/conformance``);
- an instance is one aggregation's open windows in one partition: ``change`` says which windows
  an entry falls in (or that it is late), and the hooks (``opened``, ``dropped``, ``closed``,
  ``keep``, ``restored``, ``forgotten``) keep the kind's own indexes and markers beside them.

What every kind shares is here: the accumulators by window, the heap of windows by close time,
the heap of what to forget when, the store writes of the next commit (``keys.window_key``: "w"
an accumulator, the kind's own letters for the rest), and applying, closing and restoring.
"""

from __future__ import annotations

import bisect
import heapq
from datetime import timedelta
from typing import Any, ClassVar, Literal, Protocol

import msgspec

from pspf.errors import ConfigError
from pspf.keys import WindowKey

#: A kind's registered name (``WindowSpec.kind``).
Kind = str
LatePolicy = Literal["drop", "dlq"]
#: A window of one key: (key, start ms, end ms).
WindowId = tuple[str, int, int]


class WindowSpec(msgspec.Struct, frozen=True):
    """A window kind and its sizes in milliseconds (``size_ms`` is a session's gap)."""

    kind: Kind
    size_ms: int
    step_ms: int
    grace_ms: int

    def last_ms(self, start: int, end: int) -> int:
        """The last event time that can still change the window ``[start, end]``."""
        return kind_of(self.kind).last_ms(self, start, end)

    def close_at(self, start: int, end: int) -> int:
        """The stream time at which the window is closed."""
        return self.last_ms(start, end) + self.grace_ms + 1


class Folding(Protocol):
    """How entries become an accumulator (``pspf.windows.aggregation.Aggregation``)."""

    def fold(self, acc: bytes | None, value: Any) -> bytes: ...

    def merged(self, accs: list[bytes]) -> bytes: ...

    def value(self, raw: bytes) -> Any: ...


class Change(msgspec.Struct, frozen=True, gc=False):
    """What one entry does to a window's state, applied only if its whole attempt returns.

    A Struct, not a NamedTuple: one is made per entry and window, and a Struct is made and read
    several times faster (it holds no cycles, so the garbage collector need not track it).
    """

    #: the window's name
    window: str
    key: str
    ts: int
    entry_id: bytes
    #: accumulators to set (new or updated windows), as (start, end, encoded)
    sets: list[tuple[int, int, bytes]]
    #: windows that go (sessions merged into another one)
    removes: list[tuple[int, int]]
    #: what the kind keeps beside its windows (a sliding aggregation: the entry, encoded)
    kept: bytes | None
    late: bool


#: shared by changes that remove no window: never written to
NO_REMOVES: list[tuple[int, int]] = []

#: What a store write is keyed by: (letter, key, a, b), "w" an accumulator (start, end).
WriteKey = tuple[str, str, int, int | str]


class WindowKind:
    """One kind of window, and (an instance) one aggregation's open windows of it in a partition.

    Subclasses set ``name``, implement ``change`` and ``example``, and override the class
    methods and hooks their kind needs; the store holds what memory holds here.
    """

    name: ClassVar[str]
    #: closed by a key's count of entries, not by stream time (``kinds.counted``)
    by_count: ClassVar[bool] = False

    def __init__(self, window: str, spec: WindowSpec, folding: Folding) -> None:
        #: the window's name (``@app.window(name=)``)
        self.window = window
        self.spec = spec
        self.folding = folding
        self.accs: dict[WindowId, bytes] = {}
        #: (close at, key, start, end); stale once a window is gone (closed or merged)
        self.closing: list[tuple[int, str, int, int]] = []
        #: (forget at, letter, key, a, b): what the kind keeps after a window, until when
        self.forget: list[tuple[int, str, str, int, Any]] = []
        #: windows whose accumulator changed (or went) since the last commit
        self.changed: set[WindowId] = set()
        #: the kind's other store writes for the next commit: (letter, key, a, b) -> value, None to delete
        self.dirty: dict[WriteKey, bytes | None] = {}

    # -- what the kind says: override ----------------------------------------------------------

    @classmethod
    def last_ms(cls, spec: WindowSpec, start: int, end: int) -> int:
        """The last event time that can change ``[start, end]``: by default ``end`` exclusive."""
        return end - 1

    @classmethod
    def check(cls, spec: WindowSpec, where: str, merge: object) -> None:
        """Raise ``ConfigError`` when a declaration of this kind lacks what it needs."""

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        """A spec of this kind sized in ``unit_ms`` (a few units per window), for tests."""
        raise NotImplementedError

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """The windows ``value`` at ``ts`` changes when stream time is ``now`` (none applied yet)."""
        raise NotImplementedError

    def opened(self, key: str, start: int, end: int) -> None:
        """A window joined the open ones (applied or restored)."""

    def dropped(self, key: str, start: int, end: int) -> None:
        """A window left the open ones (closed, or removed by a change)."""

    def closed(self, key: str, start: int, end: int) -> None:
        """Stream time closed a window (after ``dropped``): what the kind remembers of it."""

    def keep(self, key: str, ts: int, entry_id: bytes, kept: bytes) -> None:
        """A change's ``kept`` was applied."""

    def restored(self, found: WindowKey, value: bytes) -> None:
        """The store holds a value of the kind's own letter (not "w").

        By default none: a value another kind left (the window's kind was changed) goes in the
        next commit.
        """
        self.write(found.kind, found.key, found.a, found.b, None)

    def forgotten(self, letter: str, key: str, a: int, b: Any) -> None:
        """What ``remember`` scheduled is due: drop it from memory and the store."""

    # -- shared by every kind ------------------------------------------------------------------

    def close_at(self, start: int, end: int) -> int:
        return self.last_ms(self.spec, start, end) + self.spec.grace_ms + 1

    def write(self, letter: str, key: str, a: int, b: int | str, value: bytes | None) -> None:
        self.dirty[(letter, key, a, b)] = value

    def remember(self, forget_at: int, letter: str, key: str, a: int, b: Any) -> None:
        """Call ``forgotten(letter, key, a, b)`` once stream time reaches ``forget_at``."""
        heapq.heappush(self.forget, (forget_at, letter, key, a, b))

    def restore(self, found: WindowKey, value: bytes) -> None:
        """One stored value back in memory (``heapify`` once all are in)."""
        if found.kind != "w":
            self.restored(found, value)
            return
        key, start, end = found.key, found.a, int(found.b)
        self.accs[(key, start, end)] = value
        self.closing.append((self.close_at(start, end), key, start, end))
        self.opened(key, start, end)

    def heapify(self) -> None:
        heapq.heapify(self.closing)
        heapq.heapify(self.forget)

    def apply(self, change: Change) -> None:
        """Make a change (not late) the partition's."""
        key = change.key
        if change.removes:
            for start, end in change.removes:
                self.drop(key, start, end)
        accs, changed = self.accs, self.changed
        for start, end, acc in change.sets:
            window = (key, start, end)
            if window not in accs:
                heapq.heappush(self.closing, (self.close_at(start, end), key, start, end))
                self.opened(key, start, end)
            accs[window] = acc
            changed.add(window)
        if change.kept is not None:
            self.keep(key, change.ts, change.entry_id, change.kept)

    def drop(self, key: str, start: int, end: int) -> None:
        window = (key, start, end)
        del self.accs[window]
        self.changed.add(window)
        self.dropped(key, start, end)

    def close(self, now: int) -> list[tuple[str, int, int, bytes]]:
        """The windows stream time ``now`` closed, in close order, as (key, start, end, acc)."""
        found = []
        closing = self.closing
        while closing and closing[0][0] <= now:
            _, key, start, end = heapq.heappop(closing)
            acc = self.accs.get((key, start, end))
            if acc is None:  # removed by a change (merged into another session)
                continue
            self.drop(key, start, end)
            self.closed(key, start, end)
            found.append((key, start, end, acc))
        forget = self.forget
        while forget and forget[0][0] <= now:
            _, letter, key, a, b = heapq.heappop(forget)
            self.forgotten(letter, key, a, b)
        return found


#: A kept entry: (event time, entry id, encoded value).
Kept = tuple[int, bytes, bytes]


class KeepsEntries(WindowKind):
    """A kind that keeps each key's entries beside its windows, each until ``forget_at`` its time.

    Stored under the letter "e" (key, event time, entry id): a sliding window's entries, a
    join's side (``pspf.dataflow.joining``).
    """

    def __init__(self, window: str, spec: WindowSpec, folding: Folding) -> None:
        super().__init__(window, spec, folding)
        #: each key's kept entries, in (event time, entry id) order
        self.entries: dict[str, list[Kept]] = {}

    def forget_at(self, ts: int) -> int:
        """The stream time at which an entry kept at event time ``ts`` can go."""
        raise NotImplementedError

    def keep(self, key: str, ts: int, entry_id: bytes, kept: bytes) -> None:
        bisect.insort(self.entries.setdefault(key, []), (ts, entry_id, kept))
        self.remember(self.forget_at(ts), "e", key, ts, entry_id)
        self.write("e", key, ts, entry_id.decode(), kept)

    def restored(self, found: WindowKey, value: bytes) -> None:
        if found.kind != "e":
            super().restored(found, value)
            return
        entry_id = found.b.encode()
        bisect.insort(self.entries.setdefault(found.key, []), (found.a, entry_id, value))
        self.forget.append((self.forget_at(found.a), "e", found.key, found.a, entry_id))

    def forgotten(self, letter: str, key: str, a: int, b: Any) -> None:
        entries = self.entries[key]
        del entries[bisect.bisect_left(entries, (a, b))]
        if not entries:
            del self.entries[key]
        self.write("e", key, a, b.decode(), None)


#: The registered kinds by name: ``register`` adds, ``kind_of`` reads.
KINDS: dict[str, type[WindowKind]] = {}


def register(kind: type[WindowKind]) -> type[WindowKind]:
    """Make ``kind`` known by its ``name`` (a second kind of one name is an error)."""
    known = KINDS.get(kind.name)
    if known is not None and known is not kind:
        raise ConfigError(f"window kind {kind.name!r} is registered already ({known.__qualname__})")
    KINDS[kind.name] = kind
    return kind


def kind_of(name: str) -> type[WindowKind]:
    kind = KINDS.get(name)
    if kind is None:
        raise ConfigError(f"unknown window kind {name!r}; registered: {', '.join(sorted(KINDS))}")
    return kind


def ms(name: str, value: object, minimum: int = 1) -> int:
    """A duration given to a kind's function, in milliseconds, checked."""
    if not isinstance(value, timedelta):
        raise ConfigError(f"windows: {name} must be a datetime.timedelta, not {type(value).__name__}")
    found = int(value / timedelta(milliseconds=1))
    if found < minimum:
        raise ConfigError(f"windows: {name} must be at least {minimum} ms, got {value}")
    return found
