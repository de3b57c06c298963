"""A Context is its Attempt: what the handler did, as the runner reads it, and ``drop``.

The runner (``execution``), time keeping and windows read these slots instead of private
attributes; a handler past its deadline is dropped whole, whatever it still does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pspf.codec import StateDecoder, state_encoder
from pspf.context import Context
from pspf.cycle.execution import UNCHANGED, state_result
from pspf.outbox.emit import Emitter
from pspf.outbox.views import ViewWrite, bind
from pspf.windows.timers import PartitionTimers


class Source:
    """A state source with one stored key and an emitter for one-partition topics."""

    def __init__(self, stored: dict[str, dict[str, Any]]) -> None:
        self.stored = {key: state_encoder.encode(value) for key, value in stored.items()}
        self.emitter = Emitter(self, "app")
        self.windows: Any = None
        self.timers: PartitionTimers | None = None
        self.state_decoder = StateDecoder()
        self.viewed: list[ViewWrite] = []
        self.views = bind({}, self.viewed)

    def topic_layout(self, topic: str) -> tuple[int, str, bool]:
        return 1, "0", False

    def base(self, key: str) -> bytes | None:
        return self.stored.get(key)


def context(source: Source, key: str = "k") -> Context:
    return Context("orders", 0, b"5-1", key, 1, None, source)


def test_an_attempt_records_the_state_it_loaded_and_what_it_emitted() -> None:
    source = Source({"k": {"n": 1}})
    ctx = context(source)
    assert ctx.loaded is None and ctx.emitted is None
    assert state_result(ctx) is UNCHANGED, "state never read: unchanged"
    ctx.state["n"] += 1
    ctx.emit("out", {"n": 2}, key="k")
    assert ctx.base == source.stored["k"]
    assert ctx.loaded == {"n": 2}
    assert ctx.entry_id == b"5-1" and ctx.id == "5-1"
    (row,) = ctx.emitted or []
    assert row[0] == "out" and msgspec.json.decode(row[3]) == {"n": 2}
    assert state_result(ctx) == state_encoder.encode({"n": 2})


def test_reading_without_changing_leaves_the_state_unchanged() -> None:
    ctx = context(Source({"k": {"n": 1}}))
    assert ctx.state == {"n": 1}
    assert state_result(ctx) is UNCHANGED


def test_a_dropped_attempt_keeps_nothing_of_what_it_did() -> None:
    ctx = context(Source({}))
    ctx.state["n"] = 1
    ctx.emit("out", 1)
    ctx.drop()
    assert (ctx.loaded, ctx.emitted, ctx.windowed, ctx.schedules) == (None, None, None, None)
    assert state_result(ctx) is UNCHANGED
