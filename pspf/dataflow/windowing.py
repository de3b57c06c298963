"""A dataflow's window: ``Stream.window(spec).agg(name=agg..., ...)`` on the windows' machinery.

A ``ChainWindow`` is an ``Aggregation`` (``pspf.windows.aggregation``) whose values come from
its chain, not from its topic's entries, whose accumulator is one value per named aggregation,
and whose results, ``{"key", "start", "end", NAME: value, ...}``, go on through the steps after
it instead of to one topic. It keeps a stream time of its own: its values may come through a
re-keying topic, after the partition's other entries.

``emit="final"``: a window's result goes on when stream time closes the window, in the batch's
commit (its emits are the batch's, once). ``emit="update"``: after each value that changes a
window, from that value's entry, in its attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pspf.dataflow.agg import Aggregate, AggregationError
from pspf.windows.aggregation import Aggregation
from pspf.windows.kinds import WindowSpec, kind_of
from pspf.windows.kinds.counted import times_and_acc

if TYPE_CHECKING:
    from pspf.context import Context
    from pspf.outbox.emit import Emitted, Emitter
    from pspf.windows.aggregation import PartitionWindows
    from pspf.windows.kinds import Change, LatePolicy

log = logging.getLogger("pspf.windows")

#: Steps compiled to one function: ``(value, ctx)``, ctx a ``Context`` or a ``Closing``.
Step = Callable[[Any, Any], None]
#: Kinds whose changes are accumulators only: two values of one entry can fold into one window.
_FOLD_ONLY = frozenset({"tumbling", "hopping"})


def nothing(value: Any, ctx: Any) -> None:
    """The steps after a step that has none."""
    return None


class Closing:
    """What the steps after a final result get for ``ctx``: its key, and ``emit``."""

    __slots__ = ("_emitter", "_partition", "_source", "emitted", "key")

    def __init__(self, key: str, emitter: Emitter, source: tuple[str, bytes], partition: int) -> None:
        self.key = key
        self._emitter = emitter
        self._source = source
        self._partition = partition
        self.emitted: list[Emitted] = []

    def emit(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        self.emitted.append(self._emitter.result(topic, key or "", value, self._source, self._partition))


class ChainWindow(Aggregation):
    """One window of a chain: its aggregations, its emit mode and the steps after it."""

    def __init__(
        self,
        name: str,
        topic: str,
        spec: WindowSpec,
        aggregates: dict[str, Aggregate],
        emit: str,
        timestamp: Any,
        late: LatePolicy,
    ) -> None:
        parts = list(aggregates.values())

        def fold(acc: Any, value: Any) -> Any:
            if acc is None:
                acc = [part.initial() for part in parts]
            return [part.add(a, value) for part, a in zip(parts, acc, strict=True)]

        def merge(a: Any, b: Any) -> Any:
            return [part.merge(x, y) for part, x, y in zip(parts, a, b, strict=True)]

        super().__init__(name, topic, spec, fold, "", timestamp, late, merge)
        self.chained = True
        self.names = list(aggregates)
        self.parts = parts
        self.emit = emit
        self.by_count = kind_of(spec.kind).by_count
        #: the steps after it (``pspf.dataflow.run`` sets them): with each update, or at close
        self.after: Step = nothing

    def record(self, key: str, start: int, end: int, acc: bytes) -> dict[str, Any]:
        """A window's result: its key, bounds and each aggregation's value.

        A count window's bounds are the times of its first and last entries.
        """
        if self.by_count:
            start, end, inner = times_and_acc(acc)
            assert inner is not None
            acc = inner
        record: dict[str, Any] = {"key": key, "start": start, "end": end}
        for name, part, value in zip(self.names, self.parts, self.result(acc), strict=True):
            record[name] = part.result(value)
        return record

    def closed(
        self,
        emitter: Emitter,
        window: tuple[str, int, int],
        acc: bytes,
        source: tuple[str, bytes],
        partition: int,
    ) -> list[Emitted]:
        if self.emit != "final":
            return []
        key, start, end = window
        closing = Closing(key, emitter, source, partition)
        try:
            self.after(self.record(key, start, end, acc), closing)
        except Exception as exc:  # no entry to fail: the result is dropped, loudly
            log.error(
                "window %r: the steps after its result for key %r [%s, %s] failed; the result is "
                "dropped: %s: %s", self.name, key, start, end, type(exc).__name__, exc,
            )  # fmt: skip
            return []
        return closing.emitted

    def step(self, value: Any, ctx: Context) -> None:
        """Fold one value of the entry's attempt into its windows (applied if the attempt returns)."""
        windows: PartitionWindows = ctx.source.windows
        ts = self._timestamp(value, ctx)
        earlier = ctx.windowed
        if earlier and any(c.window == self.name and c.key == ctx.key for c in earlier):
            change = self._again(windows, earlier, value, ts, ctx)
        else:
            change = windows.change(self, ctx.key, ts, value, ctx.entry_id)
        self.attempted(windows, change, ctx)
        if self.emit == "update":
            for start, end, acc in change.sets:
                self.after(self.record(ctx.key, start, end, acc), ctx)

    def _again(
        self, windows: PartitionWindows, earlier: list[Change], value: Any, ts: int, ctx: Context
    ) -> Change:
        """A change on top of the entry's earlier changes of this window (a flat_map's values)."""
        if self.spec.kind not in _FOLD_ONLY:
            raise AggregationError(
                f"window {self.name!r}: one entry gave it two values of key {ctx.key!r}; a {self.spec.kind} "
                "window takes one value per entry: put a group_by between the flat_map and the window"
            )
        accs = windows.open[self.name].accs
        saved: dict[tuple[str, int, int], bytes | None] = {}
        for change in earlier:
            if change.window == self.name and change.key == ctx.key:
                for start, end, acc in change.sets:
                    window = (ctx.key, start, end)
                    saved.setdefault(window, accs.get(window))
                    accs[window] = acc
        try:
            return windows.change(self, ctx.key, ts, value, ctx.entry_id)
        finally:
            for window, before in saved.items():
                if before is None:
                    del accs[window]
                else:
                    accs[window] = before
