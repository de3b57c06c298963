"""Tumbling windows: ``[start, start + size)`` one after another, aligned to the epoch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pspf.windows.kinds.base import NO_REMOVES, Change, WindowSpec, ms
from pspf.windows.kinds.hopping import Hopping


class Tumbling(Hopping):
    """Hopping windows whose step is their size: each entry falls in exactly one."""

    name = "tumbling"

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 2 * unit_ms, 2 * unit_ms, grace_ms)

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """``Hopping.change`` for its one window, without the loop (the common window, per entry)."""
        spec = self.spec
        start = ts - ts % spec.size_ms
        end = start + spec.size_ms
        if end + spec.grace_ms > now:
            acc = self.folding.fold(self.accs.get((key, start, end)), value)
            return Change(self.window, key, ts, entry_id, [(start, end, acc)], NO_REMOVES, None, False)
        return Change(self.window, key, ts, entry_id, [], NO_REMOVES, None, True)


def tumbling(size: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Fixed windows of ``size``, one after another (``[start, start + size)``)."""
    size_ms = ms("size", size)
    return WindowSpec("tumbling", size_ms, size_ms, ms("grace", grace, 0))
