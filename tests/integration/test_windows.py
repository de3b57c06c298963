"""Window aggregations against a real server: results emitted once, equal to a reference."""

from __future__ import annotations

import json
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis

from pspf import App, Settings, Worker, windows
from pspf.keys import stream_key
from pspf.processor import ProcessorHooks
from tests.conftest import Names

pytestmark = pytest.mark.integration

MINUTE_MS = 60_000
GRACE_MS = 10_000
T0 = 1_700_000_040_000 - 1_700_000_040_000 % MINUTE_MS


def results(rclient: redis.Redis, topic: str, partitions: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for p in range(partitions):
        entries: list[tuple[bytes, dict[bytes, bytes]]] = rclient.xrange(stream_key(topic, p))  # type: ignore[assignment]
        found += (json.loads(fields[b"value"]) for _, fields in entries)
    return found


class LateCount(ProcessorHooks):
    def __init__(self) -> None:
        self.late: Counter[int] = Counter()

    def on_late(self, topic: str, partition: int, entries: int) -> None:
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


@pytest.fixture
def running() -> Iterator[Callable[[Worker], None]]:
    """Run workers in threads until the test ends (results of idle partitions need wall time)."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(worker: Worker) -> None:
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))

    yield start
    for worker, thread in started:
        worker.stop()
        thread.join(timeout=30)


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
