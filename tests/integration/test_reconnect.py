"""Redis restarted under a running worker: it reconnects with backoff and finishes exactly."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pspf import App, Context, Producer, Settings, Worker
from pspf.broker import Broker
from pspf.errors import BrokerUnavailable
from pspf.keys import stream_key
from pspf.service import Service
from pspf.worker import RunSummary
from tests.conftest import RedisServer

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
    names: Any,
    rclient: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = make_topic(1)
    produce(topic, [("k", {"n": 1})] * 500)
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    real_ack = Broker.ack
    failures = []

    def ack_lost_once(self: Broker, requests: Any) -> Any:
        if not failures:
            failures.append(len(requests[0].ids))
            raise BrokerUnavailable("connection dropped before the acknowledgement")
        return real_ack(self, requests)

    monkeypatch.setattr(Broker, "ack", ack_lost_once)
    settings = make_settings(PSPF_BATCH_SIZE=100)
    summary = Worker(app, settings).run(until_idle=True)

    assert failures == [100]
    assert summary.skipped == 100  # committed before the drop: acknowledged, not re-applied
    assert rclient.xpending(stream_key(topic, 0), app.name)["pending"] == 0
    assert Service(settings).state_get(app.name, "k") == {"count": 500}
