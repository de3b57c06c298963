"""Window kinds against small reference implementations, on seeded random input.

The implementation runs the entries in random batches, committing its store writes after each
and at random points starting again from the store alone (a restart); the results must equal
those of a reference that handles one entry at a time and keeps everything in plain lists.
"""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import timedelta
from typing import Any

import pytest

from pspf import App, keys, windows
from pspf.errors import ConfigError
from pspf.state_stores.memory import MemoryStore
from pspf.windows.aggregation import Aggregation, PartitionWindows
from pspf.windows.kinds import WindowSpec

Event = tuple[str, int]  # (key, event time); the value is the entry's index
Result = tuple[str, int, int, Any]  # (key, start, end, value)


class Results:
    """Stands in for the emitter: keeps each closed window's result."""

    def __init__(self) -> None:
        self.found: list[Result] = []

    def result(self, topic: str, key: str, value: Any, source: Any, partition: int) -> Any:
        self.found.append((key, value["start"], value["end"], value["value"]))
        return None


def aggregation(spec: WindowSpec) -> Aggregation:
    app = App("windows-test")

    def collect(acc: list[int] | None, value: int) -> list[int]:
        return [*(acc or []), value]

    def merge(a: list[int], b: list[int]) -> list[int]:
        return sorted(a + b)

    session = spec.kind == "session"
    app.window("clicks", spec, emit_to="out", merge=merge if session else None)(collect)
    return app.windows["collect"]


def run(spec: WindowSpec, events: list[Event], seed: int) -> tuple[list[Result], int]:
    """The implementation over ``events`` in random batches with random restarts; (results, late)."""
    rng = random.Random(seed)
    agg = aggregation(spec)
    store = MemoryStore()
    state = PartitionWindows.load(store, {agg.name: agg})
    out = Results()
    late = 0
    i = 0
    while i < len(events):
        batch = events[i : i + rng.randint(1, 12)]
        for j, (key, ts) in enumerate(batch, start=i):
            state.apply([state.change(agg, key, ts, j, f"{1000 + j}-0".encode())])
        i += len(batch)
        state.close(out, 0)  # type: ignore[arg-type]
        late += sum(state.take_late().values())
        store.write(state.writes(), {})
        state.committed()
        if rng.random() < 0.2:
            state = PartitionWindows.load(store, {agg.name: agg})
    state.advance_to_close_all()
    state.close(out, 0)  # type: ignore[arg-type]
    store.write(state.writes(), {})
    left = [k for ns, k in store._values if ns == "__windows" and k.split("/")[1] == "w"]
    assert not left, "window state left after every window closed"
    return out.found, late


def events(seed: int, count: int, keys: int, spread_ms: int, disorder_ms: int) -> list[Event]:
    rng = random.Random(seed)
    made = [(f"k{rng.randrange(keys)}", 1_000_000 + rng.randrange(spread_ms)) for _ in range(count)]
    made.sort(key=lambda e: e[1] + rng.uniform(-disorder_ms, disorder_ms))
    return made


# -- references: one entry at a time, everything in lists --------------------------------------


def ref_fixed(spec: WindowSpec, events: list[Event]) -> tuple[list[Result], int]:
    size, step, grace = spec.size_ms, spec.step_ms, spec.grace_ms
    found: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    now, late = None, 0
    for i, (key, ts) in enumerate(events):
        now = ts if now is None else max(now, ts)
        starts = [s for s in range(ts - ts % step, ts - size - step, -step) if s <= ts < s + size]
        open_ = [s for s in starts if s + size + grace > now]
        for s in open_:
            found[(key, s, s + size)].append(i)
        late += not open_
    return [(k, s, e, v) for (k, s, e), v in found.items()], late


def ref_sliding(spec: WindowSpec, events: list[Event]) -> tuple[list[Result], int]:
    size, grace = spec.size_ms, spec.grace_ms
    applied: list[tuple[str, int, int]] = []  # (key, ts, index) of entries not late
    found: dict[tuple[str, int, int], list[int]] = {}
    now, late = None, 0
    for i, (key, ts) in enumerate(events):
        now = ts if now is None else max(now, ts)
        mine = [(t, j) for k, t, j in applied if k == key]
        holding = {(ts - size, ts)}
        holding |= {(t - size, t) for t, _ in mine if ts <= t <= ts + size}
        holding |= {(t + 1, t + 1 + size) for t, _ in mine if ts - size - 1 <= t < ts}
        hit = False
        for s, e in holding:
            if e + grace + 1 > now:
                found.setdefault((key, s, e), [j for t, j in mine if s <= t <= e]).append(i)
                hit = True
        s, e = ts + 1, ts + 1 + size
        inside = [j for t, j in mine if s <= t <= e]
        if hit and (key, s, e) not in found and e + grace + 1 > now and inside:
            found[(key, s, e)] = inside
        if hit:
            applied.append((key, ts, i))
        late += not hit
    return [(k, s, e, v) for (k, s, e), v in found.items()], late


def ref_session(spec: WindowSpec, events: list[Event]) -> tuple[list[Result], int]:
    gap, grace = spec.size_ms, spec.grace_ms
    sessions: dict[str, list[list[Any]]] = defaultdict(list)  # [start, end, values, closed]
    now, late = None, 0
    for i, (key, ts) in enumerate(events):
        now = ts if now is None else max(now, ts)
        for s in sessions[key]:
            s[3] = s[3] or s[1] + gap + grace + 1 <= now
        near = [s for s in sessions[key] if s[0] - gap <= ts <= s[1] + gap]
        # a closed session counts until stream time passes its end + 2 x gap + grace
        if any(s[3] and s[1] + 2 * gap + grace + 1 > now for s in near):
            late += 1
            continue
        joined = [s for s in near if not s[3]]
        start, end = min([ts] + [s[0] for s in joined]), max([ts] + [s[1] for s in joined])
        if end + gap + grace + 1 <= now:
            late += 1
            continue
        for s in joined:
            sessions[key].remove(s)
        sessions[key].append([start, end, [*sorted(v for s in joined for v in s[2]), i], False])
    return [(k, s[0], s[1], s[2]) for k, ss in sessions.items() for s in ss], late


REFERENCES = {"tumbling": ref_fixed, "hopping": ref_fixed, "sliding": ref_sliding, "session": ref_session}
SPECS = [
    windows.tumbling(timedelta(milliseconds=100), grace=timedelta(milliseconds=20)),
    windows.hopping(
        timedelta(milliseconds=100), timedelta(milliseconds=30), grace=timedelta(milliseconds=20)
    ),
    windows.hopping(timedelta(milliseconds=90), timedelta(milliseconds=30)),
    windows.sliding(timedelta(milliseconds=50), grace=timedelta(milliseconds=30)),
    windows.sliding(timedelta(milliseconds=20)),
    windows.session(timedelta(milliseconds=40), grace=timedelta(milliseconds=25)),
    windows.session(timedelta(milliseconds=15)),
]


def _normal(results: list[Result]) -> list[Result]:
    return sorted(results, key=lambda r: (r[0], r[1], r[2]))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.size_ms}-{s.step_ms}-{s.grace_ms}")
@pytest.mark.parametrize("seed", range(12))
def test_windows_equal_the_reference_whatever_the_batches_and_restarts(spec: WindowSpec, seed: int) -> None:
    made = events(seed, count=300, keys=4, spread_ms=2_000, disorder_ms=60)
    found, late = run(spec, made, seed)
    expected, expected_late = REFERENCES[spec.kind](spec, made)
    assert len({(k, s, e) for k, s, e, _ in found}) == len(found), "a window was emitted twice"
    assert _normal(found) == _normal(expected)
    assert late == expected_late
    if spec.kind == "session":  # each entry on time is in exactly one session
        on_time = [v for r in found for v in r[3]]
        assert len(on_time) == len(set(on_time)) == len(made) - late


@pytest.mark.parametrize("seed", range(5))
def test_in_order_entries_give_the_windows_of_the_definitions(seed: int) -> None:
    """With entries in time order nothing is late, and each kind is its textbook definition."""
    made = sorted(events(seed, count=200, keys=3, spread_ms=3_000, disorder_ms=0), key=lambda e: e[1])
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, (key, ts) in enumerate(made):
        by_key[key].append((ts, i))

    size = 100
    tumbling, _ = run(windows.tumbling(timedelta(milliseconds=size)), made, seed)
    assert _normal(tumbling) == _normal(
        [
            (k, s, s + size, [i for t, i in tis if s <= t < s + size])
            for k, tis in by_key.items()
            for s in sorted({t - t % size for t, _ in tis})
        ]
    )

    sliding, late = run(windows.sliding(timedelta(milliseconds=size)), made, seed)
    expected = set()
    for k, tis in by_key.items():
        bounds = {(t - size, t) for t, _ in tis}
        bounds |= {(t + 1, t + 1 + size) for t, _ in tis if any(t < u <= t + 1 + size for u, _ in tis)}
        expected |= {(k, s, e, tuple(i for t, i in tis if s <= t <= e)) for s, e in bounds}
    assert late == 0
    assert {(k, s, e, tuple(v)) for k, s, e, v in sliding} == expected

    gap = 40
    sessions, late = run(windows.session(timedelta(milliseconds=gap)), made, seed)
    expected_sessions = []
    for k, tis in by_key.items():
        current = [tis[0]]
        for t, i in tis[1:]:
            if t - current[-1][0] <= gap:
                current.append((t, i))
            else:
                expected_sessions.append((k, current[0][0], current[-1][0], [j for _, j in current]))
                current = [(t, i)]
        expected_sessions.append((k, current[0][0], current[-1][0], [j for _, j in current]))
    assert late == 0
    assert _normal(sessions) == _normal(expected_sessions)


def test_an_entry_bridging_two_sessions_merges_them_with_merge() -> None:
    spec = windows.session(timedelta(milliseconds=10), grace=timedelta(milliseconds=100))
    found, late = run(spec, [("k", 100), ("k", 120), ("k", 110)], seed=1)
    assert (found, late) == ([("k", 100, 120, [0, 1, 2])], 0)


def test_bad_declarations_are_clear_errors() -> None:
    app = App("bad")

    def count(acc: int | None, value: Any) -> int:
        return (acc or 0) + 1

    with pytest.raises(ConfigError, match="merge"):
        app.window("t", windows.session(timedelta(seconds=1)), emit_to="out")(count)
    with pytest.raises(ConfigError, match="emit_to"):
        app.window("t", windows.tumbling(timedelta(seconds=1)))(count)
    with pytest.raises(ConfigError, match="timedelta"):
        windows.tumbling(60)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step"):
        windows.hopping(timedelta(seconds=1), timedelta(seconds=2))
    with pytest.raises(ConfigError, match=r"pspf\.windows"):
        app.window("t", "1m", emit_to="out")(count)  # type: ignore[arg-type]


# -- stores written before windows had names ---------------------------------------------------


def legacy_copy(store: MemoryStore) -> MemoryStore:
    """``store`` as a version before window names wrote it: window state keyed by its topic alone."""
    old = MemoryStore()
    values = {}
    for (namespace, key), value in store._values.items():
        if namespace == "__windows":
            window, rest = key.split("/", 1)
            key = window.partition(":")[0] + "/" + rest
        values[(namespace, key)] = value
    old.write(values, {})
    return old


def feed(
    state: PartitionWindows, agg: Aggregation, made: list[Event], first: int, store: MemoryStore
) -> list[Result]:
    """Apply ``made`` (indexes from ``first``) and commit, closing what stream time closed."""
    out = Results()
    for j, (key, ts) in enumerate(made, start=first):
        state.apply([state.change(agg, key, ts, j, f"{1000 + j}-0".encode())])
    state.close(out, 0)  # type: ignore[arg-type]
    store.write(state.writes(), {})
    state.committed()
    return out.found


def windows_held(store: MemoryStore) -> dict[str, bytes]:
    return {key: value for (namespace, key), value in store._values.items() if namespace == "__windows"}


@pytest.mark.parametrize("spec", SPECS[::2], ids=lambda s: s.kind)
def test_open_windows_of_a_store_keyed_by_topic_are_adopted_by_the_topics_one_window(
    spec: WindowSpec,
) -> None:
    """A store of the old layout, loaded: its open windows go on as the topic's window's, and the
    first commit moves them to the window's keys; the results equal those of a store never
    written in the old layout."""
    made = events(5, count=300, keys=4, spread_ms=2_000, disorder_ms=60)
    agg = aggregation(spec)
    expected, _ = REFERENCES[spec.kind](spec, made)
    store = MemoryStore()
    found = feed(PartitionWindows.load(store, {agg.name: agg}), agg, made[:150], 0, store)
    old = legacy_copy(store)
    assert windows_held(old) and all(key.startswith("clicks/") for key in windows_held(old))

    adopted = PartitionWindows.load(old, {agg.name: agg})
    later = feed(adopted, agg, made[150:], 150, old)
    kept = PartitionWindows.load(store, {agg.name: agg})
    assert later == feed(kept, agg, made[150:], 150, store)
    assert windows_held(old) == windows_held(store)  # nothing left under the topic alone
    assert all(key.startswith("clicks:collect/") for key in windows_held(old))
    adopted.advance_to_close_all()
    out = Results()
    adopted.close(out, 0)  # type: ignore[arg-type]
    assert _normal(found + later + out.found) == _normal(expected)


def test_state_keyed_by_a_topic_with_several_windows_is_left_alone_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agg = aggregation(windows.tumbling(timedelta(milliseconds=100)))
    store = MemoryStore()
    feed(PartitionWindows.load(store, {agg.name: agg}), agg, [("k", 1_000_050)], 0, store)
    old = legacy_copy(store)
    app = App("two-windows")
    app.window("clicks", windows.tumbling(timedelta(milliseconds=100)), emit_to="out", name="a")(agg.func)
    app.window("clicks", windows.tumbling(timedelta(milliseconds=100)), emit_to="out", name="b")(agg.func)
    with caplog.at_level("WARNING", logger="pspf.windows"):
        loaded = PartitionWindows.load(old, app.windows)
    assert not any(state.accs for state in loaded.open.values())
    assert not [key for key in loaded.writes() if key[0] == "__windows"]
    assert [r.getMessage() for r in caplog.records] == [
        "1 values of window state keyed by topic 'clicks' alone (written before windows had names) are "
        "left alone: the topic has several windows (a, b), and which one they belong to is unknown; "
        "declare one window on the topic to adopt them"
    ]


def test_window_keys_carry_topic_and_name_and_keys_of_the_old_layout_still_split() -> None:
    stored = keys.window_key("clicks", "per-minute", "w", "user/1:x", 60_000, 120_000)
    assert stored == "clicks:per-minute/w/60000/120000/user/1:x"
    assert keys.split_window_key(stored) == ("clicks", "per-minute", "w", "user/1:x", 60_000, "120000")
    assert keys.split_window_key("clicks/e/5/7-0/k") == keys.WindowKey("clicks", "", "e", "k", 5, "7-0")
