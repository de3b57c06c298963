"""1,000,000 entries through a running worker with retention on: the server's memory stays flat.

The topic's streams must stay at their retained size. Besides them the server holds each
partition's state backup, whose log keeps the last BACKUP_LOG_LENGTH updates (one or more per
batch): it grows until it has that many and is bounded by that (its length is checked).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pspf import App, Context, Producer, Settings
from pspf.broker import BACKUP_LOG_LENGTH
from pspf.keys import backup_log_key, stream_key
from pspf.service import Service
from pspf.worker import lease_round
from pspf.worker.retention import Retention
from tests.conftest import RedisServer, standalone_only
from tests.integration.failures_support import WorkerThread
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash, standalone_only]

ENTRIES = 1_000_000
STEP = 100_000
PARTITIONS = 2
MAX_LEN = 20_000


def test_a_million_entries_through_a_worker_with_retention_keep_memory_flat(
    own_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_round, "TRIM_EVERY_S", 0.5)
    settings = Settings.load(
        {"PSPF_BROKER": own_server.url, "PSPF_STATE_DIR": str(tmp_path / "state"), "PSPF_BLOCK_MS": 100},
        environ={},
    )
    service = Service(settings)
    service.create_topic("events", PARTITIONS)
    service.topics.set_retention("events", Retention(max_len=MAX_LEN))
    app = App("counter")

    @app.handler("events")
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    client = own_server.client()

    def caught_up() -> bool:
        return service.apps.lag("counter").lag == 0

    def trimmed() -> bool:
        return all(client.xlen(stream_key("events", p)) <= MAX_LEN for p in range(PARTITIONS))

    streams: list[int] = []  # the topic's partitions (MEMORY USAGE)
    others: list[int] = []  # the server's used_memory less the streams and the backup logs
    logs: list[int] = []  # the state backups' logs: they grow to BACKUP_LOG_LENGTH updates, then stay
    log_keys = [backup_log_key("events", p, "counter") for p in range(PARTITIONS)]
    started = time.monotonic()
    with WorkerThread(app, settings), Producer(settings=settings, batch_size=1000) as producer:
        for sent in range(0, ENTRIES, STEP):
            for i in range(sent, sent + STEP):
                producer.send_raw("events", b'{"n": 1}', key=f"k{i % 1000}")
            producer.flush()
            wait_until(lambda: caught_up() and trimmed(), 120, "the worker to catch up and trim")
            streams.append(
                sum(client.memory_usage(stream_key("events", p), samples=0) or 0 for p in range(PARTITIONS))
            )
            logs.append(sum(client.memory_usage(log, samples=0) or 0 for log in log_keys))
            others.append(int(client.info("memory")["used_memory"]) - streams[-1] - logs[-1])
            assert all(client.xlen(log) <= BACKUP_LOG_LENGTH + 100 for log in log_keys)  # MAXLEN ~
    elapsed = time.monotonic() - started
    assert sum(service.state_get("counter", f"k{j}")["n"] for j in range(1000)) == ENTRIES
    for name, figures in [("topic streams", streams), ("backup logs", logs), ("all else", others)]:
        print(f"{name} after each 100,000 entries (MB): {[round(m / 1e6, 2) for m in figures]}")
    print(f"{ENTRIES} entries in {elapsed:.0f}s")
    # Flat: once the retained window is full, the streams grow no further (1% for node rounding).
    assert max(streams[1:]) <= streams[0] * 1.01, streams
    assert max(others[1:]) <= others[0] * 1.1, others
