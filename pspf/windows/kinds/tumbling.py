"""Tumbling windows: ``[start, start + size)`` one after another, aligned to the epoch."""

from __future__ import annotations

from datetime import timedelta

from pspf.windows.kinds.base import WindowSpec, ms
from pspf.windows.kinds.hopping import Hopping


class Tumbling(Hopping):
    """Hopping windows whose step is their size: each entry falls in exactly one."""

    name = "tumbling"

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, 2 * unit_ms, 2 * unit_ms, grace_ms)


def tumbling(size: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Fixed windows of ``size``, one after another (``[start, start + size)``)."""
    size_ms = ms("size", size)
    return WindowSpec("tumbling", size_ms, size_ms, ms("grace", grace, 0))
