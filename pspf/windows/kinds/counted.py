"""Count windows: a key's entries ``n`` at a time, a new window every ``step`` entries.

``tumbling_count(n)`` (step ``n``) and ``hopping_count(n, step)``. A window is numbered by its
entries (the key's ``start``-th up to the ``end``-th, ``end`` exclusive) and closes when full, in
the commit of the entry that fills it; stream time plays no part: no entry is late, and a window
that is not full yet stays open (an idle partition does not close it). Its accumulator carries
the event times of its first and last entries, which its result gives as ``start`` and ``end``.
What the kind keeps beside its windows is each key's count of entries ("n").

A count window is a step of a stream (``Stream.window``): ``@app.window`` takes time windows.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pspf.errors import ConfigError
from pspf.keys import WindowKey
from pspf.windows.kinds.base import NO_REMOVES, Change, Folding, WindowKind, WindowSpec

#: later than any stream time: a count window never closes by time
NEVER = 2**62
_encode = msgspec.msgpack.encode
_count_decoder = msgspec.msgpack.Decoder(int)
_acc_decoder = msgspec.msgpack.Decoder(tuple[int, int, bytes | None])


class Counted(WindowKind):
    """Windows of ``size_ms`` entries of a key, one starting every ``step_ms`` entries (counts, not ms)."""

    name = "count"
    #: closed by the key's count, not by stream time (the time-based conformance suite skips it)
    by_count = True

    def __init__(self, window: str, spec: WindowSpec, folding: Folding) -> None:
        super().__init__(window, spec, folding)
        #: each key's entries so far
        self.counts: dict[str, int] = {}
        #: windows filled since the last close
        self.full: list[tuple[str, int, int]] = []

    @classmethod
    def last_ms(cls, spec: WindowSpec, start: int, end: int) -> int:
        return NEVER

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 3, 2, 0)

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        index = self.counts.get(key, 0)
        size, step = self.spec.size_ms, self.spec.step_ms
        fold, accs = self.folding.fold, self.accs
        sets = []
        start = index - index % step
        while start >= 0 and start > index - size:
            end = start + size
            acc = accs.get((key, start, end))
            first, inner = (ts, None) if acc is None else _acc_decoder.decode(acc)[::2]
            sets.append((start, end, _encode((first, ts, fold(inner, value)))))
            start -= step
        return Change(self.window, key, ts, entry_id, sets, NO_REMOVES, _encode(index + 1), False)

    def apply(self, change: Change) -> None:
        """The windows' accumulators and the key's count; a window it fills closes next."""
        key = change.key
        accs, changed = self.accs, self.changed
        for start, end, acc in change.sets:
            window = (key, start, end)
            accs[window] = acc
            changed.add(window)
        assert change.kept is not None
        count = self.counts[key] = _count_decoder.decode(change.kept)
        self.write("n", key, 0, 0, change.kept)
        start = count - self.spec.size_ms
        if start >= 0 and start % self.spec.step_ms == 0:
            self.full.append((key, start, count))

    def restore(self, found: WindowKey, value: bytes) -> None:
        """Open windows are not full (a full one closed in the commit that filled it)."""
        if found.kind == "w":
            self.accs[(found.key, found.a, int(found.b))] = value
        elif found.kind == "n":
            self.counts[found.key] = _count_decoder.decode(value)
        else:
            self.write(found.kind, found.key, found.a, found.b, None)

    def close(self, now: int) -> list[tuple[str, int, int, bytes]]:
        """The windows filled since the last close, whatever stream time is."""
        found = []
        for key, start, end in self.full:
            acc = self.accs.get((key, start, end))
            if acc is not None:
                self.drop(key, start, end)
                found.append((key, start, end, acc))
        self.full = []
        return found


def times_and_acc(acc: bytes) -> tuple[int, int, bytes | None]:
    """A count window's accumulator: (its first entry's time, its last's, the folded value)."""
    return _acc_decoder.decode(acc)


def tumbling_count(n: int) -> WindowSpec:
    """Windows of ``n`` entries of a key, one after another."""
    return WindowSpec(Counted.name, _count("n", n), _count("n", n), 0)


def hopping_count(n: int, step: int) -> WindowSpec:
    """Windows of ``n`` entries of a key, a new one every ``step`` entries."""
    if _count("step", step) > _count("n", n):
        raise ConfigError(
            f"windows.hopping_count: step {step} is larger than n {n}: entries would fall in no window"
        )
    return WindowSpec(Counted.name, n, step, 0)


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"windows: {name} must be a whole number of entries, at least 1, got {value!r}")
    return value
