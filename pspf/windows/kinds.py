"""The window kinds: what ``windows.tumbling(...)`` and its siblings return, a ``WindowSpec``.

A kind is a name in ``Kind`` and a function that checks its sizes and makes its ``WindowSpec``;
``WindowSpec.last_ms`` says until which event time a window of the kind can change. How the
open windows of each kind change with an entry is in ``pspf.windows.aggregation``
(``PartitionWindows.change``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import msgspec

from pspf.errors import ConfigError

Kind = Literal["tumbling", "hopping", "sliding", "session"]
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
        if self.kind in ("tumbling", "hopping"):
            return end - 1
        if self.kind == "session":
            return end + self.size_ms
        return end

    def close_at(self, start: int, end: int) -> int:
        """The stream time at which the window is closed."""
        return self.last_ms(start, end) + self.grace_ms + 1


def _ms(name: str, value: timedelta, minimum: int = 1) -> int:
    if not isinstance(value, timedelta):
        raise ConfigError(f"windows: {name} must be a datetime.timedelta, not {type(value).__name__}")
    ms = int(value / timedelta(milliseconds=1))
    if ms < minimum:
        raise ConfigError(f"windows: {name} must be at least {minimum} ms, got {value}")
    return ms


def tumbling(size: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Fixed windows of ``size``, one after another (``[start, start + size)``)."""
    size_ms = _ms("size", size)
    return WindowSpec("tumbling", size_ms, size_ms, _ms("grace", grace, 0))


def hopping(size: timedelta, step: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Windows of ``size`` starting every ``step`` (overlapping when ``step < size``)."""
    size_ms, step_ms = _ms("size", size), _ms("step", step)
    if step_ms > size_ms:
        raise ConfigError(
            f"windows.hopping: step {step} is larger than size {size}: entries would fall in no window"
        )
    return WindowSpec("hopping", size_ms, step_ms, _ms("grace", grace, 0))


def sliding(size: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """Windows of ``size`` that slide with the entries (Kafka Streams' sliding windows)."""
    return WindowSpec("sliding", _ms("size", size), 0, _ms("grace", grace, 0))


def session(gap: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """A key's bursts of activity: entries at most ``gap`` apart share a session."""
    return WindowSpec("session", _ms("gap", gap), 0, _ms("grace", grace, 0))
