"""Hopping windows: ``[start, start + size)`` every ``step``, aligned to the epoch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pspf.errors import ConfigError
from pspf.windows.kinds.base import NO_REMOVES, Change, WindowKind, WindowSpec, ms


class Hopping(WindowKind):
    """An entry at ``ts`` falls in every ``[start, start + size)`` with ``start`` a multiple of step."""

    name = "hopping"

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 3 * unit_ms, unit_ms, grace_ms)

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        spec = self.spec
        size, step, grace = spec.size_ms, spec.step_ms, spec.grace_ms
        accs, fold = self.accs, self.folding.fold
        sets = []
        start = ts - ts % step
        while start > ts - size:
            end = start + size
            if end + grace > now:  # close_at of [start, end)
                sets.append((start, end, fold(accs.get((key, start, end)), value)))
            start -= step
        return Change(self.window, key, ts, entry_id, sets, NO_REMOVES, None, not sets)


def hopping(size: timedelta, step: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Windows of ``size`` starting every ``step`` (overlapping when ``step < size``)."""
    size_ms, step_ms = ms("size", size), ms("step", step)
    if step_ms > size_ms:
        raise ConfigError(
            f"windows.hopping: step {step} is larger than size {size}: entries would fall in no window"
        )
    return WindowSpec("hopping", size_ms, step_ms, ms("grace", grace, 0))
