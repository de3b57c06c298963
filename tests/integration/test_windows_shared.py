"""A handler and two windows on one topic, against a real server: one attempt per entry for all.

The app is ``tests.integration.cli_apps.counts_and_sums``: a handler counting each key's clicks in
``ctx.state`` (raising for clicks that say ``"fail": true``), a tumbling count and a hopping sum.
Also: late entries in the run's summary and the log, the windows by name in ``pspf state get
--window``, a clash refused in one line, and stores and backups written before windows had names.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Settings, Worker
from pspf.cli import cli
from pspf.hooks import ProcessorHooks
from pspf.keys import WINDOWS_NAMESPACE, backup_key, dlq_key, stream_key
from pspf.partition.backup import field, split_field
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.integration.cli_apps import counts_and_sums
from tests.integration.test_windows import GRACE_MS, MINUTE_MS, T0, clicks, results, wait_for

pytestmark = pytest.mark.integration

PARTITIONS, TARGET_PARTITIONS = 4, 2
Produced = list[tuple[str, dict[str, Any]]]


class LatePerWindow(ProcessorHooks):
    def __init__(self) -> None:
        self.late: Counter[str] = Counter()

    def on_late(self, window: str, topic: str, partition: int, entries: int) -> None:
        self.late[window] += entries


class Reference:
    """What the app must come to, one entry at a time in each partition's stream order.

    A failing click counts nowhere and moves no stream time; stream time is per partition, the
    largest event time of the clicks applied there.
    """

    def __init__(self, produced: Produced, partitions: int) -> None:
        self.seen: Counter[str] = Counter()
        self.counts: Counter[tuple[str, int]] = Counter()
        self.sums: Counter[tuple[str, int]] = Counter()
        self.late: Counter[str] = Counter()
        self.failing: Counter[int] = Counter()
        stream_ms: dict[int, int] = {}
        for key, value in produced:
            partition = zlib.crc32(key.encode()) % partitions
            if value.get("fail"):
                self.failing[partition] += 1
                continue
            self.seen[key] += 1
            ts = value["ts"]
            now = stream_ms[partition] = max(stream_ms.get(partition, ts), ts)
            start = ts - ts % MINUTE_MS
            if start + MINUTE_MS + GRACE_MS > now:
                self.counts[(key, start)] += 1
            else:
                self.late["count"] += 1
            hopping = [s for s in (start, start - MINUTE_MS) if s + 2 * MINUTE_MS + GRACE_MS > now]
            for s in hopping:
                self.sums[(key, s)] += value["n"]
            if not hopping:
                self.late["total"] += 1


def shared_clicks(entries: int, keys: int, late: int, seed: int, fail_every: int) -> Produced:
    """``test_windows.clicks`` with an ``n`` to sum, and every ``fail_every``-th one failing."""
    return [
        (key, {**value, "n": i % 5 + 1, **({"fail": True} if i % fail_every == fail_every - 1 else {})})
        for i, (key, value) in enumerate(clicks(entries, keys=keys, late=late, seed=seed))
    ]


def by_window(rclient: redis.Redis, topic: str) -> Counter[tuple[str, int]]:
    found = results(rclient, topic, TARGET_PARTITIONS)
    got = Counter({(r["key"], r["start"]): r["value"] for r in found})
    assert len(got) == len(found), "a window was emitted twice"
    return got


def test_a_handler_and_two_windows_on_one_topic_equal_their_references(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    """Each click is one attempt for the three: a failing one ends in the DLQ, and neither window
    counts it; the others count in the handler's state and in every window they are on time for."""
    source, counts_to, sums_to = make_topic(PARTITIONS), make_topic(TARGET_PARTITIONS), make_topic(2)
    produced = shared_clicks(6_000, keys=30, late=100, seed=5, fail_every=400)
    produce(source, produced)
    ref = Reference(produced, PARTITIONS)
    assert sum(ref.failing.values()) == 15 and ref.late["count"] >= 50 and ref.late["total"] >= 50
    app_name, hooks = names.app(), LatePerWindow()
    app = counts_and_sums(app_name, source, counts_to, sums_to)
    app.hooks = hooks
    settings = make_settings(PSPF_BATCH_SIZE=200, PSPF_WINDOW_IDLE_CLOSE_MS=300, PSPF_RETRY_BASE_MS=5)
    running(Worker(app, settings))

    def emitted() -> int:
        return sum(rclient.xlen(stream_key(t, p)) for t in (counts_to, sums_to) for p in range(2))

    assert wait_for(emitted, len(ref.counts) + len(ref.sums)) == len(ref.counts) + len(ref.sums)
    assert by_window(rclient, counts_to) == ref.counts
    assert by_window(rclient, sums_to) == ref.sums
    assert hooks.late == ref.late
    dead = {p: rclient.xlen(dlq_key(source, p)) for p in range(PARTITIONS)}
    assert dead == {p: ref.failing[p] for p in range(PARTITIONS)}
    service = Service(settings)
    try:
        assert {key: service.state_get(app_name, key) for key in ref.seen} == {
            key: {"count": n} for key, n in ref.seen.items()
        }
    finally:
        service.close()


@pytest.fixture
def invoke(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """``pspf ARGS`` against the test server, the state dir under tmp_path, from the repository."""
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR", "PSPF_UNTIL_IDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    base_env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state"), "PSPF_BLOCK_MS": "100"}

    def run(*args: str, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), env={**base_env, **(env or {})})

    return run


#: Two keys; the third click moves stream time five minutes on, so the last two are late for both.
LATE_INPUT: Produced = [
    ("u", {"ts": T0 + 1000, "n": 1}),
    ("v", {"ts": T0 + 2000, "n": 1}),
    ("u", {"ts": T0 + 5 * MINUTE_MS, "n": 1}),
    ("u", {"ts": T0 + 3000, "n": 1}),
    ("v", {"ts": T0 + 4000, "n": 1}),
]


def test_late_entries_per_window_are_in_the_run_summary_and_a_log_line(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    caplog: pytest.LogCaptureFixture,
) -> None:
    source, target = make_topic(1), make_topic(1)
    produce(source, LATE_INPUT)
    app = counts_and_sums(names.app(), source, target, target)
    with caplog.at_level(logging.WARNING, logger="pspf.timekeeping"):
        summary = Worker(app, make_settings()).run(until_idle=True)
    assert (summary.handled, summary.late, summary.late_windows) == (5, 4, {"count": 2, "total": 2})
    assert [r.getMessage() for r in caplog.records if r.name == "pspf.timekeeping"] == [
        "late entries dropped (all their windows had closed) since the last such line, by window: "
        "count=2 total=2"
    ]


def test_pspf_run_says_the_late_entries_and_state_get_shows_each_window_by_name(
    invoke: Callable[..., Result], make_topic: Callable[[int], str], produce: Callable[..., int], names: Names
) -> None:
    source, target, app = make_topic(1), make_topic(1), names.app()
    produce(source, LATE_INPUT)
    env = {"PSPF_TEST_TOPIC": source, "PSPF_TEST_APP": app, "PSPF_TEST_TARGET": target}
    ran = invoke("run", "tests.integration.cli_apps:windowed", "--until-idle", env=env)
    assert ran.exit_code == 0, ran.output
    assert (
        "processed 5 entries (0 already done), 0 dead-lettered, 0 failed attempts retried; "
        "4 late entries dropped (count 2, total 2)\n"
    ) in ran.output
    shown = invoke("state", "get", app, "u", "--window")
    assert shown.exit_code == 0, shown.output
    five = T0 + 5 * MINUTE_MS
    assert shown.output == (
        f"total ({source}) [{five - MINUTE_MS}, {five + MINUTE_MS}]: 1\n"
        f"count ({source}) [{five}, {five + MINUTE_MS}]: 1\n"
        f"total ({source}) [{five}, {five + 2 * MINUTE_MS}]: 1\n"
    )
    as_json = invoke("state", "get", app, "u", "--window", "--json")
    assert json.loads(as_json.output)[1] == {
        "window": "count",
        "topic": source,
        "start": five,
        "end": five + MINUTE_MS,
        "value": 1,
    }


def test_two_windows_of_one_name_stop_pspf_run_with_one_line_naming_them(
    invoke: Callable[..., Result], names: Names
) -> None:
    app = names.app()
    ran = invoke("run", "tests.integration.cli_apps:clashing_windows", env={"PSPF_TEST_APP": app})
    assert ran.exit_code == 2, ran.output
    assert "Traceback" not in ran.output
    assert [line for line in ran.output.splitlines() if line.startswith("Error:")] == [
        f"Error: app {app!r} already has a window named 'count' (of topic 'clicks'): "
        "the window of topic 'views' needs another name (name=)"
    ]


# -- stores and backups written before windows had names ------------------------------------------


def old_layout(key: str) -> str:
    """A window's store key as a version before window names wrote it: by its topic alone."""
    window, rest = key.split("/", 1)
    return f"{window.partition(':')[0]}/{rest}"


def to_old_layout(rclient: redis.Redis, settings: Settings, app: str, topic: str) -> int:
    """Rewrite the window state of ``app``'s stores and backups as the previous version kept it.

    The batch identities stay: a worker takes each store as it is, or restores it from its backup.
    Returns the window values rewritten in the backups.
    """
    moved = 0
    for p in range(PARTITIONS):
        backup = backup_key(topic, p, app)
        for name, value in rclient.hgetall(backup).items():  # type: ignore[union-attr]
            namespace, key = split_field(name)
            if namespace == WINDOWS_NAMESPACE:
                rclient.hdel(backup, name)
                rclient.hset(backup, field(namespace, old_layout(key)), value)
                moved += 1
        with open_store(settings.state.engine, settings.state.dir, app, p) as store:
            updates: dict[tuple[str, str], bytes | None] = {}
            for key, value in store.items(WINDOWS_NAMESPACE):
                updates[(WINDOWS_NAMESPACE, key)] = None
                updates[(WINDOWS_NAMESPACE, old_layout(key))] = value
            store.write(updates, {})
    return moved


@pytest.mark.parametrize("restored", [False, True], ids=["from-the-store", "from-the-backup"])
def test_open_windows_of_the_previous_layout_are_adopted_by_the_topics_one_window(
    restored: bool,
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
    tmp_path: Path,
) -> None:
    """A store (or, on a machine without it, a backup) whose open windows are keyed by topic: the
    new worker's one window of that topic takes them on, with a handler beside it now, and every
    window's result counts the entries of before and after the upgrade."""
    source, target, app = make_topic(PARTITIONS), make_topic(TARGET_PARTITIONS), names.app()
    produced = shared_clicks(4_000, keys=20, late=40, seed=9, fail_every=10**9)
    half = len(produced) // 2
    produce(source, produced[:half])
    before = make_settings()
    previous = counts_and_sums(app, source, target, target, handler=False, total=False)
    Worker(previous, before).run(until_idle=True)
    assert to_old_layout(rclient, before, app, source) > 0, "no window open at the upgrade"
    produce(source, produced[half:])
    after = make_settings(
        PSPF_WINDOW_IDLE_CLOSE_MS=300,
        **({"PSPF_STATE_DIR": str(tmp_path / "new-machine")} if restored else {}),
    )
    running(Worker(counts_and_sums(app, source, target, target, total=False), after))
    ref = Reference(produced, PARTITIONS)
    assert wait_for(
        lambda: sum(rclient.xlen(stream_key(target, p)) for p in range(2)), len(ref.counts)
    ) == len(ref.counts)
    assert by_window(rclient, target) == ref.counts
    left = [
        name
        for p in range(PARTITIONS)
        for name in rclient.hkeys(backup_key(source, p, app))  # type: ignore[union-attr]
        if name.startswith(WINDOWS_NAMESPACE.encode())
    ]
    assert not left, f"window state left in the backups: {left[:3]}"
