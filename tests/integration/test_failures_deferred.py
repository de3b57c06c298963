"""Deferred retries: failing entries are parked, the partition goes on, and a parked entry is
retried when due, also by a new worker after a restart, until it succeeds or reaches the DLQ."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.failures import Failure
from pspf.keys import FAILURES_NAMESPACE, stream_key
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.integration.failures_support import (
    WorkerThread,
    assert_drained,
    dead_by_entry,
    read_state,
    stream_entries,
)
from tests.support import wait_until

pytestmark = pytest.mark.integration

PARTITIONS = 2
ENTRIES = 400
FLAKY = {17, 60, 61, 99, 150, 151, 152, 230, 301, 390}  # fail once, then succeed
DOOMED = {40, 200, 333}  # always fail
#: Backoff 1.5-3 s (base 3 s, equal jitter): long enough to stop the first worker before it is due.
POLICY = RetryPolicy(mode="deferred", max_retries=3, base_delay_ms=3000, factor=1.0, max_delay_ms=3000)


class Flaky(Exception):
    pass


class Doomed(Exception):
    pass


class Recorder:
    """The app under test and what its handler saw: attempts per entry, the order of applies."""

    def __init__(self, name: str, topic: str) -> None:
        self.attempts: Counter[int] = Counter()
        self.attempted_ms: dict[int, list[float]] = defaultdict(list)
        self.applied: list[int] = []
        self.app = App(name)

        @self.app.handler(topic, retry=POLICY)
        def handle(value: dict[str, Any], ctx: Context) -> None:
            n = value["n"]
            self.attempts[n] += 1
            self.attempted_ms[n].append(time.time() * 1000)
            if n in DOOMED:
                raise Doomed(f"entry {n} never works")
            if n in FLAKY and self.attempts[n] == 1:
                raise Flaky(f"entry {n} fails once")
            state = ctx.state
            state["count"] = state.get("count", 0) + 1
            state["sum"] = state.get("sum", 0) + n
            self.applied.append(n)


def records() -> list[tuple[str, dict[str, int]]]:
    return [(f"k{n % 10}", {"n": n}) for n in range(ENTRIES)]


def expected_state() -> dict[str, dict[str, int]]:
    want: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "sum": 0})
    for key, value in records():
        if value["n"] not in DOOMED:
            want[key]["count"] += 1
            want[key]["sum"] += value["n"]
    return dict(want)


def parked(settings: Settings, app: str) -> dict[tuple[int, str], Failure]:
    """The retry bookkeeping of every partition store, by (partition, "topic/id")."""
    found = {}
    for p in range(PARTITIONS):
        with open_store("sqlite", settings.state.dir, app, p, readonly=True) as store:
            for name, raw in store.items(FAILURES_NAMESPACE):
                found[(p, name)] = msgspec.msgpack.decode(raw, type=Failure)
    return found


@pytest.mark.parametrize("second_consumer", ["same", "other"])
def test_parked_entries_survive_a_worker_restart_and_are_retried_when_due(
    second_consumer: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app_name = make_topic(PARTITIONS), names.app()
    produce(topic, records())
    rec = Recorder(app_name, topic)
    failing = FLAKY | DOOMED

    # Worker 1: every entry is tried once; the failing ones are parked and the partitions go on.
    settings1 = make_settings(PSPF_CONSUMER="first")
    started_ms = time.time() * 1000
    with WorkerThread(rec.app, settings1) as first:
        wait_until(
            lambda: len(rec.applied) == ENTRIES - len(failing) and set(rec.attempts) == set(range(ENTRIES)),
            15,
            "every entry tried once",
        )
        wait_until(
            lambda: len(parked(settings1, app_name)) == len(failing), 5, "the parked entries committed"
        )
        summary1 = first.stop()
    assert summary1.parked == len(failing) and summary1.dead_lettered == 0
    assert all(rec.attempts[n] == 1 for n in range(ENTRIES)), "an entry was retried before its due time"
    # Later entries, of other keys and of the same key, were applied while the failing ones wait.
    assert set(rec.applied) == set(range(ENTRIES)) - failing
    book = parked(settings1, app_name)
    entries = stream_entries(rclient, topic, PARTITIONS)
    due_ms = {
        msgspec.json.decode(entries[(p, name.rpartition("/")[2])][b"value"])["n"]: failure.due_ms
        for (p, name), failure in book.items()
    }
    assert set(due_ms) == failing
    for name, failure in book.items():
        assert failure.attempts == 1 and failure.due_ms >= started_ms + 1400, (name, failure)
    assert all(failure.due_ms > time.time() * 1000 for failure in book.values()), (
        "the first worker ran past a due time: the restart would not be tested"
    )
    total_pending = sum(
        rclient.xpending(stream_key(topic, p), app_name)["pending"] for p in range(PARTITIONS)
    )
    assert total_pending == len(failing), "parked entries stay pending until they are dealt with"

    # Worker 2 (a new process in real life): the parked entries come back when due.
    consumer2 = "first" if second_consumer == "same" else "second"
    settings2 = make_settings(PSPF_CONSUMER=consumer2)
    with WorkerThread(rec.app, settings2) as second:

        def done() -> bool:
            second.check()
            return (
                len(rec.applied) == ENTRIES - len(DOOMED)
                and len(dead_by_entry(rclient, topic, PARTITIONS)) == 3
            )

        wait_until(done, 20, "the flaky entries applied and the doomed ones dead-lettered")
        wait_until(lambda: not parked(settings2, app_name), 5, "the retry bookkeeping cleared")
        summary2 = second.stop()

    assert {n: rec.attempts[n] for n in FLAKY} == dict.fromkeys(FLAKY, 2)
    early = {n: due_ms[n] - rec.attempted_ms[n][1] for n in failing if rec.attempted_ms[n][1] < due_ms[n]}
    assert not early, f"retried before the due time (ms early): {early}"
    assert {n: rec.attempts[n] for n in DOOMED} == dict.fromkeys(DOOMED, 3)
    assert all(rec.attempts[n] == 1 for n in range(ENTRIES) if n not in failing)
    assert Counter(rec.applied) == Counter(n for n in range(ENTRIES) if n not in DOOMED), "applied twice"
    assert summary2.handled == len(FLAKY) and summary2.dead_lettered == len(DOOMED)
    dead = {
        msgspec.json.decode(d.original[b"value"])["n"]: d
        for d in dead_by_entry(rclient, topic, PARTITIONS).values()
    }
    assert set(dead) == DOOMED
    for n, record in dead.items():
        assert (record.error_type, record.message, record.attempts) == ("Doomed", f"entry {n} never works", 3)
        # Attempts 2 and 3 each waited for a backoff of at least 1.5 s.
        assert record.last_failed_ms - record.first_failed_ms >= 2 * 1500 - 50, record
        assert record.consumer == consumer2
    assert read_state(settings2.state.dir, app_name, PARTITIONS) == expected_state()
    assert_drained(rclient, settings2.state.dir, topic, app_name, PARTITIONS)


def test_until_idle_does_not_stop_while_entries_are_parked(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """``--until-idle`` promises to stop once "everything read is committed and acknowledged"
    (docs/reference/cli.md): a parked entry is read and not acknowledged, so the run must wait until it is
    retried (and applied or dead-lettered)."""
    topic, app_name = make_topic(PARTITIONS), names.app()
    produce(topic, records())
    rec = Recorder(app_name, topic)
    settings = make_settings()
    summary = Worker(rec.app, settings).run(until_idle=True)
    pending = sum(rclient.xpending(stream_key(topic, p), app_name)["pending"] for p in range(PARTITIONS))
    assert pending == 0 and summary.dead_lettered == len(DOOMED), (
        f"run(until_idle=True) returned with {pending} entries still pending ({summary.parked} parked, "
        f"{summary.dead_lettered} dead-lettered): {summary}"
    )
    assert read_state(settings.state.dir, app_name, PARTITIONS) == expected_state()
