"""Window aggregations against a real server: results emitted once, equal to a reference."""

from __future__ import annotations

import json
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner
from litestar.testing import TestClient

from pspf import App, Settings, Worker, windows
from pspf.admin_api import create_app
from pspf.cli import cli
from pspf.errors import NotFound
from pspf.hooks import ProcessorHooks
from pspf.keys import stream_key
from pspf.service import OpenWindow, Service
from tests.conftest import Names
from tests.integration.test_emit import outputs
from tests.unit.test_windows import REFERENCES
from tests.unit.test_windows import events as unit_events

pytestmark = pytest.mark.integration

MINUTE_MS = 60_000
GRACE_MS = 10_000
T0 = 1_700_000_040_000 - 1_700_000_040_000 % MINUTE_MS


def results(rclient: redis.Redis, topic: str, partitions: int) -> list[dict[str, Any]]:
    """The window results in a topic's partitions."""
    return [output["value"] for output in outputs(rclient, topic, partitions)]


class LateCount(ProcessorHooks):
    def __init__(self) -> None:
        self.late: Counter[int] = Counter()

    def on_late(self, window: str, topic: str, partition: int, entries: int) -> None:
        self.late[partition] += entries


def counting_app(
    name: str, source: str, target: str, hooks: ProcessorHooks | None = None, **options: Any
) -> App:
    app = App(name, hooks=hooks)

    @app.window(
        source,
        windows.tumbling(timedelta(minutes=1), grace=timedelta(milliseconds=GRACE_MS)),
        timestamp="ts",
        emit_to=target,
        **options,
    )
    def count(total: int | None, click: dict[str, Any]) -> int:
        return (total or 0) + 1

    return app


def clicks(entries: int, keys: int, late: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Event times over 60 minutes in order, each shuffled within 5 s; then ``late`` stragglers."""
    rng = random.Random(seed)
    step = 60 * MINUTE_MS / entries
    made = [
        (f"k{rng.randrange(keys)}", {"ts": int(T0 + i * step + rng.uniform(0, 5000))}) for i in range(entries)
    ]
    made.sort(key=lambda kv: kv[1]["ts"] + rng.uniform(-5000, 5000))
    for _ in range(late):  # well behind the newest event time of any partition
        made.append((f"k{rng.randrange(keys)}", {"ts": int(T0 + rng.uniform(0, 50 * MINUTE_MS))}))
    return made


def reference(
    produced: list[tuple[str, dict[str, Any]]], partitions: int
) -> tuple[Counter[tuple[str, int]], int]:
    """Counts per (key, window start) of the entries on time in their partition, and the late ones."""
    stream_ms: dict[int, int] = {}
    counts: Counter[tuple[str, int]] = Counter()
    late = 0
    for key, value in produced:
        partition = zlib.crc32(key.encode()) % partitions
        ts = value["ts"]
        now = stream_ms[partition] = max(stream_ms.get(partition, ts), ts)
        start = ts - ts % MINUTE_MS
        if start + MINUTE_MS + GRACE_MS <= now:
            late += 1
        else:
            counts[(key, start)] += 1
    return counts, late


def wait_for(count: Callable[[], int], expected: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while count() < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # anything more than expected would show up now
    return count()


def test_tumbling_counts_equal_the_reference_and_late_entries_are_counted_not_applied(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    source, target = make_topic(4), make_topic(2)
    produced = clicks(20_000, keys=50, late=200, seed=7)
    produce(source, produced)
    expected, late = reference(produced, 4)
    assert late >= 150  # the stragglers are late, as the test means them to be
    hooks = LateCount()
    worker = Worker(
        counting_app(names.app(), source, target, hooks),
        make_settings(PSPF_BATCH_SIZE=500, PSPF_WINDOW_IDLE_CLOSE_MS=300),
    )
    running(worker)
    found = wait_for(lambda: sum(rclient.xlen(stream_key(target, p)) for p in range(2)), len(expected))
    emitted = results(rclient, target, 2)
    assert found == len(expected)
    got = Counter({(r["key"], r["start"]): r["value"] for r in emitted})
    assert len(got) == len(emitted), "a window was emitted twice"
    assert got == expected
    assert all(r["end"] == r["start"] + MINUTE_MS for r in emitted)
    assert sum(hooks.late.values()) == late


def test_an_idle_partition_closes_its_window_after_the_timeout_and_later_entries_for_it_are_late(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    source, target = make_topic(1), make_topic(1)
    app, hooks = names.app(), LateCount()
    produce(source, [("u1", {"ts": T0 + 1000}), ("u1", {"ts": T0 + 2000}), ("u2", {"ts": T0 + 3000})])
    settings = make_settings(PSPF_WINDOW_IDLE_CLOSE_MS=1500)
    Worker(counting_app(app, source, target), settings).run(until_idle=True)
    service = Service(settings)
    try:
        assert service.state.state_windows(app, "u1") == [
            OpenWindow(window="count", topic=source, start=T0, end=T0 + MINUTE_MS, value=2)
        ]
        with pytest.raises(NotFound, match="no open window"):
            service.state.state_windows(app, "u3")
        with TestClient(create_app(service, token="t")) as api:
            reply = api.get(f"/apps/{app}/state/u1/windows")
            assert (reply.status_code, reply.json()) == (
                200,
                msgspec.to_builtins(service.state.state_windows(app, "u1")),
            )
            assert api.get(f"/apps/{app}/state/u3/windows").status_code == 404
    finally:
        service.close()
    cli_args = ["state", "get", app, "u1", "--window", "--broker", settings.redis.url]
    shown = CliRunner().invoke(cli, cli_args)
    assert (shown.exit_code, shown.output) == (0, f"count ({source}) [{T0}, {T0 + MINUTE_MS}]: 2\n")
    missing = CliRunner().invoke(cli, [*cli_args[:3], "u3", *cli_args[4:]])
    assert missing.exit_code == 4 and "no open window for key 'u3'" in missing.output
    assert rclient.xlen(stream_key(target, 0)) == 0  # stream time alone closes nothing yet
    started = time.monotonic()
    running(Worker(counting_app(app, source, target, hooks), settings))
    assert wait_for(lambda: rclient.xlen(stream_key(target, 0)), 2) == 2
    assert time.monotonic() - started >= 1.4  # not before the wall-clock timeout
    got = {(r["key"], r["start"]): r["value"] for r in results(rclient, target, 1)}
    assert got == {("u1", T0): 2, ("u2", T0): 1}
    produce(source, [("u1", {"ts": T0 + 4000})])  # its window has closed: late
    deadline = time.monotonic() + 10
    while not hooks.late and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hooks.late == {0: 1}
    assert rclient.xlen(stream_key(target, 0)) == 2


def test_late_entries_go_to_the_dlq_when_the_app_asks(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source, target = make_topic(1), make_topic(1)
    produce(
        source, [("u", {"ts": T0 + 5 * MINUTE_MS}), ("u", {"ts": T0}), ("u", {"ts": T0 + 5 * MINUTE_MS + 1})]
    )
    Worker(counting_app(names.app(), source, target, late="dlq"), make_settings()).run(until_idle=True)
    dead: list[tuple[bytes, dict[bytes, bytes]]] = rclient.xrange(f"{stream_key(source, 0)}:dlq")  # type: ignore[assignment]
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"error_type"] == b"LateEntry"
    assert fields[b"message"].decode().startswith(f"late: event time {T0} is behind every open window")
    assert json.loads(msgspec.msgpack.decode(fields[b"original"])[b"value"]) == {"ts": T0}
    assert rclient.xlen(stream_key(target, 0)) == 0  # the open window is not closed by the late one


def test_a_missing_emit_to_topic_stops_the_worker_at_start_with_a_clear_error(
    make_settings: Callable[..., Settings], make_topic: Callable[[int], str], names: Names
) -> None:
    source = make_topic(1)
    with pytest.raises(
        NotFound, match=r"window 'count' of topic .* emits to a missing topic: topic 'nowhere'"
    ):
        Worker(counting_app(names.app(), source, "nowhere"), make_settings()).run(until_idle=True)


def test_window_state_follows_its_partition_to_a_worker_with_an_empty_state_dir(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    source, target = make_topic(2), make_topic(2)
    produced = clicks(4_000, keys=20, late=50, seed=3)
    app = names.app()
    half = len(produced) // 2
    produce(source, produced[:half])
    first = make_settings(PSPF_STATE_DIR=str(tmp_path / "machine-a"))
    Worker(counting_app(app, source, target), first).run(until_idle=True)
    produce(source, produced[half:])
    second = make_settings(PSPF_STATE_DIR=str(tmp_path / "machine-b"), PSPF_WINDOW_IDLE_CLOSE_MS=200)
    expected, _ = reference(produced, 2)
    worker = Worker(counting_app(app, source, target), second)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        found = wait_for(lambda: sum(rclient.xlen(stream_key(target, p)) for p in range(2)), len(expected))
    finally:
        worker.stop()
        thread.join(timeout=30)
    emitted = results(rclient, target, 2)
    assert found == len(expected)
    assert Counter({(r["key"], r["start"]): r["value"] for r in emitted}) == expected


@pytest.mark.parametrize(
    "spec",
    [
        windows.hopping(
            timedelta(milliseconds=100), timedelta(milliseconds=30), grace=timedelta(milliseconds=20)
        ),
        windows.sliding(timedelta(milliseconds=50), grace=timedelta(milliseconds=30)),
        windows.session(timedelta(milliseconds=40), grace=timedelta(milliseconds=25)),
    ],
    ids=lambda s: s.kind,
)
def test_hopping_sliding_and_session_results_through_a_worker_equal_the_reference(
    spec: windows.WindowSpec,
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    """The unit tests' references, on entries that go through a real worker and the outbox."""
    made = unit_events(11, count=400, keys=5, spread_ms=3_000, disorder_ms=60)
    source, target = make_topic(1), make_topic(1)
    produce(source, [(key, {"ts": ts, "i": i}) for i, (key, ts) in enumerate(made)])
    app = App(names.app())

    def collect(acc: list[int] | None, value: dict[str, int]) -> list[int]:
        return [*(acc or []), value["i"]]

    def merge(a: list[int], b: list[int]) -> list[int]:
        return sorted(a + b)

    app.window(source, spec, timestamp="ts", emit_to=target, merge=merge if spec.kind == "session" else None)(
        collect
    )
    expected, _ = REFERENCES[spec.kind](spec, made)
    running(Worker(app, make_settings(PSPF_BATCH_SIZE=13, PSPF_WINDOW_IDLE_CLOSE_MS=300)))
    assert wait_for(lambda: rclient.xlen(stream_key(target, 0)), len(expected)) == len(expected)
    found = sorted((r["key"], r["start"], r["end"], r["value"]) for r in results(rclient, target, 1))
    assert found == sorted((k, s, e, list(v)) for k, s, e, v in expected)
