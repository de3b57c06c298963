"""The built-in aggregations of ``Stream.window(...).agg(name=agg.Sum("amount"), ...)``.

Each is a small object that says how its accumulator starts (``initial``), takes a value
(``add``), combines with another (``merge``: two session windows bridged by an entry) and reads
out (``result``). Accumulators are plain msgpack values (numbers, lists, dicts), so they live in
the partition's store and its backup like any window's.

``field`` picks what an aggregation reads from each value: a dict's key or a Struct's attribute;
None (where allowed) the value itself. A value without the field fails its entry at once
(``AggregationError``: retrying cannot help), like a value that does not decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pspf.errors import ConfigError, NonRetryableError

__all__ = [
    "Aggregate",
    "AggregationError",
    "Collect",
    "Count",
    "Latest",
    "Max",
    "Mean",
    "Min",
    "Reduce",
    "Sum",
]

_MISSING = object()


class AggregationError(NonRetryableError):
    """A value an aggregation cannot take (no such field, not a number): its entry is dead-lettered."""


class Aggregate:
    """One named aggregation of a window: how its accumulator starts, grows, merges and reads out."""

    #: what ``describe`` and errors call it
    label = "aggregate"

    def __init__(self, field: str | None = None) -> None:
        if field is not None and (not isinstance(field, str) or not field):
            raise ConfigError(f"agg.{type(self).__name__}: field must be a field name, got {field!r}")
        self.field = field

    def initial(self) -> Any:
        return None

    def add(self, acc: Any, value: Any) -> Any:
        raise NotImplementedError

    def merge(self, a: Any, b: Any) -> Any:
        """Two windows' accumulators as one (``a`` the earlier); None: the kind cannot merge them."""
        raise NotImplementedError

    def result(self, acc: Any) -> Any:
        return acc

    def read(self, value: Any) -> Any:
        """The part of ``value`` this aggregation reads: its ``field``, or the value itself."""
        name = self.field
        if name is None:
            return value
        found = value.get(name, _MISSING) if type(value) is dict else getattr(value, name, _MISSING)
        if found is _MISSING:
            raise AggregationError(f"{self!r}: the value has no field {name!r}: {_short(value)}")
        return found

    def __repr__(self) -> str:
        return f"agg.{type(self).__name__}({'' if self.field is None else repr(self.field)})"


class Sum(Aggregate):
    """The sum of a numeric field."""

    def __init__(self, field: str) -> None:
        super().__init__(field)

    def initial(self) -> Any:
        return 0

    def add(self, acc: Any, value: Any) -> Any:
        return acc + _number(self, self.read(value))

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


class Count(Aggregate):
    """How many values (with ``field``: how many have it not None)."""

    def initial(self) -> Any:
        return 0

    def add(self, acc: Any, value: Any) -> Any:
        if self.field is None:
            return acc + 1
        return acc + (self.read(value) is not None)

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


class Mean(Aggregate):
    """The mean of a numeric field (kept as [sum, count]; None for an empty window)."""

    def __init__(self, field: str) -> None:
        super().__init__(field)

    def initial(self) -> Any:
        return [0, 0]

    def add(self, acc: Any, value: Any) -> Any:
        return [acc[0] + _number(self, self.read(value)), acc[1] + 1]

    def merge(self, a: Any, b: Any) -> Any:
        return [a[0] + b[0], a[1] + b[1]]

    def result(self, acc: Any) -> Any:
        return acc[0] / acc[1] if acc[1] else None


class Min(Aggregate):
    """The smallest value of a field (None for a window of no values)."""

    def __init__(self, field: str) -> None:
        super().__init__(field)

    def add(self, acc: Any, value: Any) -> Any:
        found = self.read(value)
        return found if acc is None or _less(self, found, acc) else acc

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None or (b is not None and _less(self, b, a)) else a


class Max(Aggregate):
    """The largest value of a field (None for a window of no values)."""

    def __init__(self, field: str) -> None:
        super().__init__(field)

    def add(self, acc: Any, value: Any) -> Any:
        found = self.read(value)
        return found if acc is None or _less(self, acc, found) else acc

    def merge(self, a: Any, b: Any) -> Any:
        return b if a is None or (b is not None and _less(self, a, b)) else a


class Collect(Aggregate):
    """Every value (or its field), in the order applied."""

    def initial(self) -> Any:
        return []

    def add(self, acc: Any, value: Any) -> Any:
        acc.append(self.read(value))
        return acc

    def merge(self, a: Any, b: Any) -> Any:
        return a + b


class Latest(Aggregate):
    """The last value applied (or its field); of two merged sessions, the later one's."""

    def add(self, acc: Any, value: Any) -> Any:
        return self.read(value)

    def merge(self, a: Any, b: Any) -> Any:
        return b


class Reduce(Aggregate):
    """``fn(acc, value)`` from ``initial``; ``merge(a, b)`` is needed for session windows only."""

    def __init__(
        self,
        initial: Any,
        fn: Callable[[Any, Any], Any],
        merge: Callable[[Any, Any], Any] | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(field)
        if not callable(fn):
            raise ConfigError(f"agg.Reduce: fn must be a function (acc, value) -> acc, got {fn!r}")
        self.start = initial
        self.fn = fn
        self.merger = merge

    def initial(self) -> Any:
        return self.start

    def add(self, acc: Any, value: Any) -> Any:
        return self.fn(acc, self.read(value))

    def merge(self, a: Any, b: Any) -> Any:
        if self.merger is None:
            raise NotImplementedError
        return self.merger(a, b)

    def __repr__(self) -> str:
        return f"agg.Reduce({self.start!r}, {getattr(self.fn, '__qualname__', self.fn)!r})"


def _number(agg: Aggregate, found: Any) -> Any:
    if type(found) is int or type(found) is float:  # the common case, first
        return found
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        raise AggregationError(f"{agg!r}: {found!r} is not a number")
    return found


def _less(agg: Aggregate, a: Any, b: Any) -> bool:
    try:
        return bool(a < b)
    except TypeError:
        raise AggregationError(f"{agg!r}: {a!r} and {b!r} cannot be compared") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
