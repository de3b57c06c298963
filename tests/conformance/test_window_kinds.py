"""One suite over every registered window kind: what each must do, whatever its windows are.

The kinds come from the registry (``pspf.windows.kinds.KINDS``), with a kind written in tests/
(``cumulating.py``) registered by the one line below: it passes the same suite as PSPF's own.
Each kind's spec is its ``example``; the window function collects the indexes of the entries it
folds (sorted, so merging sessions and folding in another order give equal results).
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import pytest

from pspf import App
from pspf.errors import ConfigError
from pspf.state_stores.memory import MemoryStore
from pspf.testing import TestApp
from pspf.windows.aggregation import Aggregation, PartitionWindows
from pspf.windows.kinds import KINDS, Tumbling, WindowKind, WindowSpec, kind_of, register
from tests.conformance.cumulating import Cumulating, cumulating

register(Cumulating)  # the one line that makes a kind known

UNIT = 100  # ms; a kind's example windows are a few units
#: the kinds closed by stream time (count windows close by a key's count: tests/unit/test_dataflow.py)
TIME_KINDS = sorted(name for name, kind in KINDS.items() if not kind.by_count)
START = 1_704_067_200_000
Result = tuple[str, int, int, tuple[int, ...]]  # (key, start, end, indexes of the entries folded)


def spec_of(kind: str, grace_ms: int = 2 * UNIT) -> WindowSpec:
    return KINDS[kind].example(UNIT, grace_ms)


def app_of(spec: WindowSpec) -> App:
    app = App("kinds")

    @app.window("clicks", spec, timestamp="ts", emit_to="out", merge=lambda a, b: sorted(a + b))
    def collect(acc: list[int] | None, value: dict[str, int]) -> list[int]:
        return sorted([*(acc or []), value["i"]])

    return app


def events(seed: int, count: int = 120, disorder_ms: int = 3 * UNIT) -> list[tuple[str, int]]:
    """(key, event time) in arrival order: mostly forward, some behind (a few of them late)."""
    rng = random.Random(seed)
    made = [(f"k{rng.randrange(3)}", START + rng.randrange(40 * UNIT)) for _ in range(count)]
    return sorted(made, key=lambda e: e[1] + rng.uniform(-disorder_ms, disorder_ms))


def result(value: dict[str, Any]) -> Result:
    return (value["key"], value["start"], value["end"], tuple(value["value"]))


def test_the_registry_holds_the_four_kinds_and_the_one_registered_here() -> None:
    assert {"tumbling", "hopping", "sliding", "session", "count", "cumulating"} <= set(KINDS)
    assert all(issubclass(kind, WindowKind) and KINDS[kind.name] is kind for kind in KINDS.values())
    assert kind_of("cumulating") is Cumulating
    assert app_of(cumulating(timedelta(seconds=4), timedelta(seconds=1))).windows["collect"]

    class Other(Tumbling):
        name = "tumbling"

    with pytest.raises(ConfigError, match="registered already"):
        register(Other)
    with pytest.raises(ConfigError, match="unknown window kind 'weekly'"):
        app_of(WindowSpec("weekly", 1, 1, 0))
    with pytest.raises(ConfigError, match="multiple"):
        cumulating(timedelta(seconds=3), timedelta(seconds=2))


@pytest.mark.parametrize("kind", TIME_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_each_entry_on_time_is_in_a_window_emitted_once_when_stream_time_passes_its_close(
    kind: str, seed: int
) -> None:
    """Through TestApp: a window's result comes in the commit of the entry that moves stream time
    past its close (or at the idle close), once; every entry on time is in one at least, within
    its bounds; a late entry is counted and in none."""
    spec = spec_of(kind)
    made = events(seed)
    emitted: list[Result] = []
    late: set[int] = set()
    with TestApp(app_of(spec)) as t:
        stream_ms = None
        for i, (key, ts) in enumerate(made):
            before, late_before = stream_ms, t.counts.late
            t.send("clicks", {"ts": ts, "i": i}, key=key)
            if t.counts.late > late_before:
                late.add(i)
            else:
                stream_ms = ts if stream_ms is None else max(stream_ms, ts)
            assert stream_ms is not None
            new = [result(v) for v in t.emitted("out")[len(emitted) :]]
            for _, start, end, _ in new:
                assert (before or 0) < spec.close_at(start, end) <= stream_ms, "emitted early or late"
            emitted += new
        t.advance(timedelta(minutes=1))  # the idle close: every window closes
        assert stream_ms is not None
        for value in t.emitted("out")[len(emitted) :]:
            emitted.append(result(value))
            assert spec.close_at(value["start"], value["end"]) > stream_ms
    assert len(late) == t.counts.late
    assert len({r[:3] for r in emitted}) == len(emitted), "a window was emitted twice"
    windowed = {i for r in emitted for i in r[3]}
    assert windowed == set(range(len(made))) - late, "an entry on time is in no window, or a late one in one"
    for key, start, end, indexes in emitted:
        for i in indexes:
            assert made[i][0] == key and start <= made[i][1] <= spec.last_ms(start, end)
    assert late, "the input has late entries, so the suite sees them counted"


@pytest.mark.parametrize("kind", TIME_KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_results_do_not_depend_on_the_order_of_arrival_within_grace(kind: str, seed: int) -> None:
    """Entries no later than half the grace behind stream time are on time, and the windows
    they make are the same in any such order (the window functions here are order-free)."""
    spec = spec_of(kind, grace_ms=4 * UNIT)
    rng = random.Random(seed)
    made = sorted(events(seed, disorder_ms=0), key=lambda e: e[1])
    results = []
    for _ in range(2):
        order = sorted(range(len(made)), key=lambda i: made[i][1] + rng.uniform(0, 2 * UNIT))
        with TestApp(app_of(spec)) as t:
            for i in order:
                t.send("clicks", {"ts": made[i][1], "i": i}, key=made[i][0])
            t.advance(timedelta(minutes=1))
            assert t.counts.late == 0
            results.append(sorted(result(v) for v in t.emitted("out")))
    assert results[0] == results[1] and results[0]


def run(
    spec: WindowSpec, made: list[tuple[str, int]], seed: int | None
) -> tuple[list[Result], int, MemoryStore]:
    """The windows over ``made`` in random batches with random restarts (``seed``), or one entry a
    batch without restarts (None); then every window closed and stream time far beyond."""
    rng = random.Random(seed)
    aggregation: Aggregation = app_of(spec).windows["collect"]
    store = MemoryStore()
    state = PartitionWindows.load(store, {"collect": aggregation})
    found: list[Result] = []

    class Out:
        def result(self, topic: str, key: str, value: Any, source: Any, partition: int) -> None:
            found.append(result(value))

    late, i = 0, 0
    while i < len(made):
        batch = made[i : i + (1 if seed is None else rng.randint(1, 15))]
        for j, (key, ts) in enumerate(batch, start=i):
            state.apply([state.change(aggregation, key, ts, {"ts": ts, "i": j}, f"{1000 + j}-0".encode())])
        i += len(batch)
        state.close(Out(), 0)  # type: ignore[arg-type]
        late += sum(state.take_late().values())
        store.write(state.writes(), {})
        state.committed()
        if seed is not None and rng.random() < 0.25:
            state = PartitionWindows.load(store, {"collect": aggregation})
    state.advance_to_close_all()
    state.close(Out(), 0)  # type: ignore[arg-type]
    state.advance((state.stream_ms or 0) + 1000 * UNIT, state.source)
    state.close(Out(), 0)  # type: ignore[arg-type]
    store.write(state.writes(), {})
    return found, late, store


@pytest.mark.parametrize("kind", TIME_KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_results_do_not_depend_on_batch_boundaries_or_restarts_and_nothing_is_kept_forever(
    kind: str, seed: int
) -> None:
    spec = spec_of(kind)
    made = events(seed + 10)
    found, late, store = run(spec, made, seed)
    expected, expected_late, _ = run(spec, made, None)
    assert sorted(found) == sorted(expected) and late == expected_late
    assert late and found
    left = [key for (namespace, key) in store._values if namespace == "__windows"]
    assert not left, f"window state left after stream time passed every close and forget: {left[:3]}"
