"""Sliding windows, in Kafka Streams' meaning.

``[t - size, t]`` for each entry at ``t``, and ``[t + 1, t + 1 + size]`` when some entry falls
in it; ``end`` inclusive.

An entry joins every open window it falls in; a window that an entry creates starts from the
entries already there, folded in arrival order. So a sliding aggregation keeps its entries
("e" in the store: event time, entry id) while a window could still need them.
"""

from __future__ import annotations

import bisect
from datetime import timedelta
from typing import Any

import msgspec

from pspf.keys import StreamId
from pspf.windows.kinds.base import Change, KeepsEntries, Kept, WindowSpec, ms


class Sliding(KeepsEntries):
    """Windows of ``size`` that slide with the entries."""

    name = "sliding"

    @classmethod
    def last_ms(cls, spec: WindowSpec, start: int, end: int) -> int:
        return end

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 2 * unit_ms, 0, grace_ms)

    def forget_at(self, ts: int) -> int:
        """When a kept entry can go: every window it falls in, or creates, has closed."""
        return ts + self.spec.size_ms + self.spec.grace_ms + 2

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """Every open window ``value`` falls in, and the windows it creates (see the module)."""
        size = self.spec.size_ms
        fold = self.folding.fold
        entries = self.entries.get(key, [])
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
            if self.close_at(start, end) <= now:
                continue
            acc = self.accs.get((key, start, end))
            if acc is None:
                acc = self._fold_kept(near, start, end)
            sets.append((start, end, fold(acc, value)))
        if not sets:  # late: it creates no window either
            return Change(self.window, key, ts, entry_id, [], [], None, True)
        # This entry's right window, created when entries already fall in it.
        start, end = ts + 1, ts + 1 + size
        if (key, start, end) not in self.accs and self.close_at(start, end) > now:
            inside = [kept for kept in near if start <= kept[0] <= end]
            if inside:
                acc = self._fold_kept(inside, start, end)
                assert acc is not None
                sets.append((start, end, acc))
        return Change(self.window, key, ts, entry_id, sets, [], msgspec.msgpack.encode(value), False)

    def _fold_kept(self, near: list[Kept], start: int, end: int) -> bytes | None:
        """The accumulator of the kept entries in ``[start, end]``, folded in arrival order."""
        folding = self.folding
        acc = None
        inside = sorted((StreamId.parse(i), value) for t, i, value in near if start <= t <= end)
        for _, value in inside:
            acc = folding.fold(acc, folding.value(value))
        return acc


def sliding(size: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Windows of ``size`` that slide with the entries (Kafka Streams' sliding windows)."""
    return WindowSpec("sliding", ms("size", size), 0, ms("grace", grace, 0))
