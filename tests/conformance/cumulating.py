"""A window kind written outside PSPF, to show that a kind is one file plus its registration.

Cumulating windows (Flink's CUMULATE): within each period of ``size`` aligned to the epoch, the
windows ``[start, start + step)``, ``[start, start + 2 x step)``, ... ``[start, start + size)``: an
early result every ``step`` and the period's total at its end. ``register(Cumulating)`` makes it
known; ``cumulating(...)`` makes its specs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pspf.errors import ConfigError
from pspf.windows.kinds import NO_REMOVES, Change, WindowKind, WindowSpec, ms


class Cumulating(WindowKind):
    """An entry at ``ts`` falls in every window of its period that ends after ``ts``."""

    name = "cumulating"

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 4 * unit_ms, unit_ms, grace_ms)

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        size, step, grace = self.spec.size_ms, self.spec.step_ms, self.spec.grace_ms
        start = ts - ts % size
        end = start + (ts - start) // step * step + step  # the first window's end after ts
        sets = []
        while end <= start + size:
            if end + grace > now:  # close_at of [start, end)
                sets.append((start, end, self.folding.fold(self.accs.get((key, start, end)), value)))
            end += step
        return Change(self.window, key, ts, entry_id, sets, NO_REMOVES, None, not sets)


def cumulating(size: timedelta, step: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Windows growing by ``step`` from the start of each period of ``size`` (a multiple of step)."""
    size_ms, step_ms = ms("size", size), ms("step", step)
    if size_ms % step_ms:
        raise ConfigError(f"cumulating: size {size} is not a multiple of step {step}")
    return WindowSpec(Cumulating.name, size_ms, step_ms, ms("grace", grace, 0))
