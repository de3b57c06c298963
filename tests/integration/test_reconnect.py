"""Redis restarted under a running worker: it reconnects with backoff and finishes exactly."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Context, Producer, Settings, Worker
from pspf.broker import Acknowledging
from pspf.errors import BrokerError, BrokerUnavailable, NotFound
from pspf.keys import StreamId, backup_meta_key, stream_key
from pspf.service import Service
from pspf.state_stores import open_store
from pspf.worker import RunSummary
from tests.conftest import Names, RedisServer
from tests.integration.failures_support import WorkerThread, read_state, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_worker_survives_a_redis_restart_with_exact_state(
    own_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings.load(
        {
            "PSPF_BROKER": own_server.url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": 100,
            "PSPF_LEASE_TTL_MS": 3000,
        },
        environ={},
    )
    service = Service(settings)
    service.create_topic("orders", 2)
    expected: Counter[str] = Counter()
    with Producer(settings=settings) as producer:
        for i in range(30_000):
            key = f"k{i % 50}"
            producer.send("orders", {"n": 1}, key=key)
            expected[key] += 1

    app = App("restart-app")
    under_way = threading.Event()
    calls = Counter[str]()

    @app.handler("orders")
    def count(value: dict[str, int], ctx: Context) -> None:
        time.sleep(0.00005)
        calls["n"] += 1
        if calls["n"] == 3_000:
            under_way.set()
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    summary: list[RunSummary] = []
    worker = Worker(app, settings)
    thread = threading.Thread(target=lambda: summary.append(worker.run(until_idle=True)))
    thread.start()
    assert under_way.wait(timeout=30), "processing did not start"
    own_server.stop()
    time.sleep(1.5)
    own_server.start()

    thread.join(timeout=60)
    assert not thread.is_alive(), "worker did not finish after the restart"
    assert any("Redis unavailable" in r.getMessage() for r in caplog.records)
    got = {key: service.state_get("restart-app", key)["count"] for key in expected}
    assert got == dict(expected)
    # Entries committed before the outage but not acknowledged are skipped, not re-applied.
    assert summary[0].handled <= 30_000
    client = own_server.client()
    for p in range(2):
        assert client.xpending(stream_key("orders", p), "restart-app")["pending"] == 0


def test_entries_committed_but_not_acknowledged_are_acknowledged_after_reconnect(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = make_topic(1)
    produce(topic, [("k", {"n": 1})] * 500)
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    real_ack = Acknowledging.ack_sent
    failures = []

    def ack_lost_once(self: Acknowledging, requests: Any) -> Any:
        if not failures and requests[0].ids:  # the first batch's (not a takeover's backup update)
            failures.append(len(requests[0].ids))
            raise BrokerUnavailable("connection dropped before the acknowledgement")
        return real_ack(self, requests)

    monkeypatch.setattr(Acknowledging, "ack_sent", ack_lost_once)
    settings = make_settings(PSPF_BATCH_SIZE=100)
    summary = Worker(app, settings).run(until_idle=True)

    assert failures == [100]
    assert summary.skipped == 100  # committed before the drop: acknowledged, not re-applied
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
    assert Service(settings).state_get(app.name, "k") == {"count": 500}


@pytest.mark.parametrize("backup", ["off", "on"])
def test_a_stream_whose_tail_went_back_below_the_checkpoint_after_reconnect(
    own_server: RedisServer, tmp_path: Path, backup: str
) -> None:
    """Redis comes back from an older copy of its data (a lost AOF tail, a fail-over, a restore):
    the stream's last id is below the worker's checkpoint, and 1,000 entries added then get ids
    at or below it. None of them may be acknowledged as "already done".

    Without a state backup the running worker stops with a clear error after it reconnects. With
    one, the backup (in the same older copy) is behind the store: the worker takes the partition
    again, which restores the store from the backup, and applies the 1,000 entries, so its state
    is exactly what the server's stream holds."""
    settings = Settings.load(
        {
            "PSPF_BROKER": own_server.url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": 100,
            "PSPF_LEASE_TTL_MS": 3000,
            "PSPF_STATE_BACKUP": backup,
        },
        environ={},
    )
    Service(settings).create_topic("orders", 1)
    stream, data = stream_key("orders", 0), own_server.directory

    def produce(n: int) -> None:
        with Producer(settings=settings) as producer:
            for i in range(n):
                producer.send("orders", {"n": 1}, key=f"k{i % 5}")

    def applied() -> int:
        try:
            return sum(v["count"] for v in read_state(settings.state.dir, "tail-app", 1).values())
        except NotFound:  # not created yet
            return 0

    app = App("tail-app")

    @app.handler("orders")
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    produce(50)
    with WorkerThread(app, settings) as runner:
        wait_until(lambda: applied() == 50, 15, "the first entries")
        own_server.stop()
        shutil.copytree(data, tmp_path / "older")
        own_server.start()
        time.sleep(0.01)  # the next entries' ids are later than the copy's last id
        produce(50)
        wait_until(lambda: applied() == 100, 20, "the entries after the copy")
        checkpoint = read_store_checkpoint(settings.state.dir, "tail-app", "orders")

        own_server.stop()
        shutil.rmtree(data)
        shutil.copytree(tmp_path / "older", data)
        own_server.start()
        client = own_server.client()
        last = StreamId.parse(client.xinfo_stream(stream)["last-generated-id"])
        assert last < checkpoint
        with client.pipeline(transaction=False) as pipe:
            for i in range(1, 1001):
                pipe.xadd(stream, {"key": "late", "value": b'{"n": 1}'}, id=f"{last.ms}-{last.seq + i}")
            pipe.execute()
        assert StreamId(last.ms, last.seq + 1000) < checkpoint
        if backup == "on":
            held = len(client.xrange(stream))  # every entry the server holds now
            wait_until(lambda: applied() == held, 30, "the store restored and the late entries applied")
            assert held >= 1000
            wait_until(lambda: client.xinfo_groups(stream)[0]["pending"] == 0, 10, "acknowledged")
            assert runner.alive()
            return
        wait_until(lambda: not runner.alive(), 20, "the worker to stop")
    assert isinstance(runner.error, BrokerError), runner.error
    assert "below the app's checkpoint" in str(runner.error)
    group = client.xinfo_groups(stream)[0]
    unacknowledged = group["pending"] + len(client.xrange(stream, f"({group['last-delivered-id'].decode()}"))
    assert unacknowledged == 1000, "entries added below the checkpoint were acknowledged as done"
    assert applied() == 100


def read_store_checkpoint(state_dir: str | Path, app: str, topic: str) -> StreamId:
    with open_store("sqlite", state_dir, app, 0, readonly=True) as store:
        return store.checkpoints()[topic]


def test_entries_below_the_checkpoint_read_as_new_stop_the_worker_without_a_reconnect(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The stream is deleted and written again with low ids under a running worker (its group
    re-created at 0): the entries arrive as new, at or below the checkpoint. The worker looks the
    stream's last id up, sees it below the checkpoint and stops; nothing is acknowledged."""
    topic, app_name = make_topic(1), names.app()
    produce(topic, [(f"k{i}", {"n": 1}) for i in range(20)])
    settings = make_settings()
    stream = stream_key(topic, 0)
    app = App(app_name)

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    with WorkerThread(app, settings) as runner:
        last = StreamId.parse(rclient.xinfo_stream(stream)["last-generated-id"])

        def done() -> bool:
            try:
                return read_store_checkpoint(settings.state.dir, app_name, topic) == last
            except (NotFound, KeyError):
                return False

        wait_until(done, 15, "the first entries")
        with rclient.pipeline(transaction=True) as pipe:
            pipe.delete(stream)
            pipe.xgroup_create(stream, app_name, id="0", mkstream=True)
            for i in range(1, 11):
                pipe.xadd(stream, {"key": "late", "value": b'{"n": 1}'}, id=f"1-{i}")
            pipe.execute()
        wait_until(lambda: not runner.alive(), 15, "the worker to stop")
    assert isinstance(runner.error, BrokerError), runner.error
    assert "below the app's checkpoint" in str(runner.error)
    group = rclient.xinfo_groups(stream)[0]
    assert group["pending"] + len(rclient.xrange(stream, f"({group['last-delivered-id'].decode()}")) == 10


def test_a_backup_that_went_back_under_its_owner_is_logged_as_that_not_as_a_lost_lease(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The backup's identity is not the one this worker left (as after a fail-over that lost writes)."""
    topic, app = make_topic(1), names.app()
    meta = backup_meta_key(topic, 0, app)
    produce(topic, [("k", {"n": 1})] * 10)
    caplog.set_level(logging.WARNING, logger="pspf")

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if "BACKUP_WENT_BACK" in r.getMessage()]

    with WorkerThread(summing_app(app, topic), make_settings()):
        wait_until(lambda: rclient.hget(meta, "identity"), 15, "the first batch in the backup")
        rclient.hset(meta, "identity", "written-by-no-one")
        produce(topic, [("k", {"n": 1})])
        wait_until(refusals, 15, "the refused acknowledgement")
    for message in refusals():
        assert "lease lost" not in message, message
        assert "the state backup went back" in message, message
