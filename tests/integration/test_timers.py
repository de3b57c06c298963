"""Scheduled callbacks, timers and state expiry against a real server."""

from __future__ import annotations

import itertools
import json
import random
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.codec import entry_fields
from pspf.context import TimerContext
from pspf.errors import NotFound
from pspf.keys import STATE_NAMESPACE, backup_keys, stream_key
from pspf.partition.backup import field
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.reminders import reference, reminder_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_scheduled_callbacks_run_between_entries_as_stream_time_passes_them_whatever_the_batches(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source, target = make_topic(2), make_topic(1)
    rng = random.Random(5)
    entries = []
    ms = 1_000_000
    for _ in range(600):
        ms += rng.randint(1, 30)
        entries.append((ms, f"k{rng.randrange(6)}", rng.randint(0, 120)))
    for ms, key, delay in entries:
        partition = zlib.crc32(key.encode()) % 2
        fields = entry_fields(json.dumps({"delay": delay}).encode(), key)
        rclient.xadd(stream_key(source, partition), fields, id=f"{ms}-0")  # type: ignore[arg-type]
    app = names.app()
    settings = make_settings(PSPF_BATCH_SIZE=7)
    Worker(reminder_app(app, source, target), settings).run(until_idle=True)
    expected = reference(entries, 2)
    service = Service(settings)
    try:
        found = {key: service.state_get(app, key) for key in expected}
    finally:
        service.close()
    assert found == expected
    reminders = sum(len(s.get("reminded", [])) for s in expected.values())
    assert reminders > 100  # the test means many reminders to run, and many to be replaced
    assert sum(1 for *_, delay in entries) - reminders > 100
    emitted = rclient.xrange(stream_key(target, 0))
    assert len(emitted) == reminders  # type: ignore[arg-type]


def test_a_callback_that_raises_is_dropped_alone_and_a_schedule_of_an_unknown_name_fails_its_entry(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source = make_topic(1)
    app = App(names.app())

    @app.handler(source)
    def plan(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["seen"] = ctx.state.get("seen", 0) + 1
        ctx.schedule(0, value["callback"], value.get("payload"))

    @app.on_schedule("boom")
    def boom(payload: Any, ctx: Context) -> None:
        ctx.state["boomed"] = True
        raise RuntimeError("callback broke")

    @app.on_schedule("fine")
    def fine(payload: int, ctx: Context) -> None:
        ctx.state["fine"] = payload

    produce(
        source,
        [
            ("a", {"callback": "boom"}),
            ("b", {"callback": "nosuch"}),
            ("c", {"callback": "fine", "payload": 7}),
        ],
    )
    settings = make_settings(PSPF_MAX_RETRIES=1, PSPF_RETRY_BASE_MS=1)
    summary = Worker(app, settings).run(until_idle=True)
    service = Service(settings)
    try:
        assert service.state_get(app.name, "a") == {"seen": 1}  # the callback's writes dropped
        assert service.state_get(app.name, "c") == {"seen": 1, "fine": 7}
        with pytest.raises(NotFound):
            service.state_get(app.name, "b")  # its entry failed: no state, to the DLQ
    finally:
        service.close()
    assert summary.dead_lettered == 1
    dead: list[tuple[bytes, dict[bytes, bytes]]] = rclient.xrange(f"{stream_key(source, 0)}:dlq")  # type: ignore[assignment]
    assert b"no @app.on_schedule('nosuch')" in dead[0][1][b"message"]


def test_a_timer_runs_once_per_period_per_partition_with_state_and_emits(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    source, target = make_topic(2), make_topic(1)
    app = App(names.app())
    keys = {0: "", 1: ""}
    for i in range(50):  # a key of each partition
        keys[zlib.crc32(f"k{i}".encode()) % 2] = keys[zlib.crc32(f"k{i}".encode()) % 2] or f"k{i}"

    @app.handler(source)
    def nothing(value: Any, ctx: Context) -> None:
        """The timer's app needs a topic."""

    @app.timer(every=timedelta(milliseconds=100))
    def tick(ctx: TimerContext) -> None:
        state = ctx.state(keys[ctx.partition])
        state["ticks"] = [*state.get("ticks", []), ctx.time_ms]
        ctx.emit(target, {"partition": ctx.partition, "at": ctx.time_ms})

    settings = make_settings()
    running(Worker(app, settings))
    service = Service(settings)

    def ticked(key: str) -> list[int]:
        try:
            return list(service.state_get(app.name, key)["ticks"])
        except NotFound:  # no tick committed yet
            return []

    try:
        # Five periods at least (on a busy machine they take longer than 0.5 s to come).
        wait_until(lambda: all(len(ticked(key)) >= 5 for key in keys.values()), 15, "five ticks each")
        for key in keys.values():
            ticks = ticked(key)
            assert ticks == sorted(set(ticks)) and all(t % 100 == 0 for t in ticks)
            # none skipped, though a blocked read ends on the server's 100 ms tick, not sooner
            assert all(b - a == 100 for a, b in itertools.pairwise(ticks)), ticks
        with pytest.raises(NotFound):
            service.state_get(app.name, "elsewhere")
    finally:
        service.close()
    wait_until(lambda: rclient.xlen(stream_key(target, 0)) >= 10, 15, "the ticks' emits")


def test_state_not_written_for_its_ttl_is_deleted_from_the_store_and_the_backup(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    running: Callable[[Worker], None],
) -> None:
    source, other = make_topic(1), make_topic(1)
    app = App(names.app(), state_ttl=timedelta(milliseconds=600))

    @app.handler(source)
    def count(value: Any, ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    @app.handler(other, state_ttl=timedelta(days=1))
    def keep(value: Any, ctx: Context) -> None:
        ctx.state["kept"] = True

    settings = make_settings()
    running(Worker(app, settings))
    produce(source, [("gone", 1), ("fresh", 1)])
    produce(other, [("kept", 1)])
    service = Service(settings)
    values_key = backup_keys(source, 0, app.name).values
    try:
        deadline = time.monotonic() + 10
        while not rclient.hget(values_key, field(STATE_NAMESPACE, "gone")):
            assert time.monotonic() < deadline, "the worker did not apply the first entries"
            time.sleep(0.02)
        written = time.monotonic()
        while time.monotonic() < deadline:
            produce(source, [("fresh", 1)])  # written again and again: it stays
            try:
                service.state_get(app.name, "gone")
            except NotFound:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the state of 'gone' did not expire")
        assert time.monotonic() - written >= 0.5  # not before its TTL
        assert rclient.hget(values_key, field(STATE_NAMESPACE, "gone")) is None
        with open_store(settings.state.engine, settings.state.dir, app.name, 0, readonly=True) as store:
            assert store.get(STATE_NAMESPACE, "gone") is None
            assert store.get(STATE_NAMESPACE, "kept") is not None
        assert service.state_get(app.name, "fresh")["n"] > 3
        assert service.state_get(app.name, "kept") == {"kept": True}
        assert rclient.hget(values_key, field(STATE_NAMESPACE, "kept")) is not None
    finally:
        service.close()
