"""Stream-stream joins: ``left.join_interval(right, within=...)`` on the windows' machinery.

Each side keeps its values per key in the partition's store (``JoinBuffer``, a window kind that
has no windows, only kept entries: event time, entry id, the value), committed with the entry
that brought them, backed up and moved by key like any window state. A value meets the other
side's values of its key kept so far whose event times are at most ``within`` from its own: each
pair is emitted once, by the value that comes second. The app applies its entries in id order
across its topics (``pspf.cycle.ordering.id_order_runs``), so "second" is the same in every run,
retry and replay.

Both sides share one stream time (the join's clock: the largest event time either side applied).
A value is late when its own interval has closed (its time plus ``within`` plus the grace is
behind stream time): it is counted, never joined. A kept value is forgotten once no value on
time can meet it (stream time past its time plus twice ``within`` plus the grace).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from pspf.dataflow.windowing import Step, nothing
from pspf.errors import ConfigError
from pspf.keys import StreamId
from pspf.windows.aggregation import Aggregation
from pspf.windows.kinds import NO_REMOVES, Change, WindowSpec
from pspf.windows.kinds.base import KeepsEntries, Kept

if TYPE_CHECKING:
    from pspf.context import Context
    from pspf.windows.aggregation import PartitionWindows


class JoinBuffer(KeepsEntries):
    """One side of a join in one partition: its values by key, kept while a value could meet them."""

    name = "join"

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, unit_ms, 0, grace_ms)

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """Keep the value (the caller met it with the other side's first), or late: nothing."""
        within, grace = self.spec.size_ms, self.spec.grace_ms
        if ts + within + grace < now:
            return Change(self.window, key, ts, entry_id, [], NO_REMOVES, None, True)
        return Change(self.window, key, ts, entry_id, [], NO_REMOVES, msgspec.msgpack.encode(value), False)

    def near(self, key: str, ts: int) -> list[Kept]:
        """The kept values of ``key`` at most ``within`` from ``ts``, in (time, id) order."""
        entries = self.entries.get(key)
        if not entries:
            return []
        within = self.spec.size_ms
        lo = bisect.bisect_left(entries, (ts - within,))
        hi = bisect.bisect_left(entries, (ts + within + 1,))
        return sorted(entries[lo:hi], key=lambda kept: (kept[0], StreamId.parse(kept[1])))

    def forget_at(self, ts: int) -> int:
        return ts + 2 * self.spec.size_ms + self.spec.grace_ms + 1


class JoinSide(Aggregation):
    """One side of a join as the windows' machinery keeps it: a ``JoinBuffer`` per partition."""

    def __init__(
        self, name: str, topic: str, spec: WindowSpec, timestamp: Any, value_type: Any, clock: str
    ) -> None:
        def keep(acc: Any, value: Any) -> Any:
            return None

        super().__init__(name, topic, spec, keep, "", timestamp, "drop", None, kind=JoinBuffer)
        self.chained = True
        self.clock = clock
        self._value_decoder = msgspec.msgpack.Decoder(value_type)

    def timestamp(self, value: Any, ctx: Context) -> int:
        return self._timestamp(value, ctx)


class IntervalJoin:
    """``left.join_interval(right, within)``: its two sides and what follows it."""

    def __init__(
        self,
        name: str,
        sides: tuple[JoinSide, JoinSide],
        merge: Callable[[Any, Any], Any] | None,
    ) -> None:
        self.name = name
        self.sides = sides
        self.merge = merge
        #: the steps after the join (``pspf.dataflow.run`` sets them)
        self.after: Step = nothing

    def step(self, index: int) -> Step:
        """What a value of side ``index`` (0 left, 1 right) runs in its entry's attempt."""
        me, other = self.sides[index], self.sides[1 - index]

        def joined(value: Any, ctx: Context) -> None:
            windows: PartitionWindows = ctx.source.windows
            key = ctx.key
            earlier = ctx.windowed
            if earlier and any(c.window == me.name and c.key == key for c in earlier):
                raise ConfigError(
                    f"join {self.name!r}: one entry gave its {('left', 'right')[index]} side two values of "
                    f"key {key!r}; a join takes one value per entry and side"
                )
            ts = me.timestamp(value, ctx)
            change = windows.change(me, key, ts, value, ctx.entry_id)
            me.attempted(windows, change, ctx)  # late: counted (a join side drops late values)
            if change.late:
                return
            buffer = windows.open[other.name]
            assert isinstance(buffer, JoinBuffer)
            for _, _, raw in buffer.near(key, ts):
                partner = other.value(raw)
                pair = (value, partner) if index == 0 else (partner, value)
                merged = {"left": pair[0], "right": pair[1]} if self.merge is None else self.merge(*pair)
                self.after(merged, ctx)

        return joined
