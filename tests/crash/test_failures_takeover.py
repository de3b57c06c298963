"""Takeover of a killed worker's pending entries, some of them deleted from the stream meanwhile."""

from __future__ import annotations

import logging
import random
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.keys import stream_key
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.support import assert_exact, leases, order_records
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

ENTRIES = 10_000
BATCH = 5_000
DELETED = 500
LEASE_TTL_MS = 1000


def test_takeover_of_5000_pending_entries_with_some_deleted_while_pending(
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Worker A (a subprocess, 2 ms per entry) reads a batch of 5,000 and is SIGKILLed with all of
    them pending. 500 of them are XDELed. Worker B (another consumer name) takes the partition over
    after A's lease expires, claims A's pending entries and must apply exactly the surviving ones,
    report the deleted ones and never hand them to its handler."""
    caplog.set_level(logging.INFO, logger="pspf")
    topic, app_name = make_topic(1), names.app()
    records = order_records(ENTRIES, 200, seed=17)
    produce(topic, records)
    stream = stream_key(topic, 0)
    state_dir = tmp_path / "state"
    log_path = tmp_path / "a.log"
    with log_path.open("wb") as out:
        first = subprocess.Popen(
            pspf_command(
                "run",
                "tests.crash.apps_failures:slow",
                "--broker",
                redis_url,
                "--state-dir",
                str(state_dir),
                "--consumer",
                "a",
                "--batch-size",
                str(BATCH),
                "--lease-ttl-ms",
                str(LEASE_TTL_MS),
                "--block-ms",
                "100",
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env(PSPF_TEST_TOPIC=topic, PSPF_TEST_APP=app_name, PSPF_TEST_WORK_US="2000"),
            cwd=tmp_path,
        )
    try:
        wait_until(
            lambda: rclient.exists(stream) and _pending(rclient, stream, app_name) >= BATCH,
            20,
            "worker A to hold a batch pending",
        )
        first.kill()
        assert first.wait(10) == -9
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    pending = rclient.xpending_range(stream, app_name, "-", "+", 2 * BATCH)
    # A batch in hand, and with the read ahead (sent after a full batch) maybe the next one too.
    held = len(pending)
    assert held in (BATCH, 2 * BATCH) and {row["consumer"] for row in pending} == {b"a"}
    assert leases(rclient, topic, app_name, 1)[0] is not None, "A's lease outlives it"

    # One partition: the stream holds the records in order.
    all_ids = [entry_id.decode() for entry_id, _ in rclient.xrange(stream)]
    assert len(all_ids) == ENTRIES
    deleted = set(random.Random(3).sample([row["message_id"].decode() for row in pending], DELETED))
    assert rclient.xdel(stream, *deleted) == DELETED
    kept = [record for record, entry_id in zip(records, all_ids, strict=True) if entry_id not in deleted]

    seen: list[str] = []
    app = App(app_name)

    @app.handler(topic)
    def handle(value: dict[str, Any], ctx: Context) -> None:
        state = ctx.state
        state["count"] = state.get("count", 0) + 1
        state["total"] = state.get("total", 0) + value["amount"]
        seen.append(ctx.id)

    started = time.monotonic()
    summary = Worker(app, make_settings(PSPF_CONSUMER="b")).run(until_idle=True)
    print(f"B ran {time.monotonic() - started:.1f}s: {summary}")

    assert not deleted & set(seen), "a deleted entry reached the handler"
    assert len(seen) == len(set(seen)) == ENTRIES - DELETED
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        re.match(rf"claimed {held - DELETED} pending entries of earlier consumers", m) for m in messages
    ), [m for m in messages if "claimed" in m]
    # Reported: by the takeover's XAUTOCLAIM (a list of ids) or by the processor (one id a line).
    reported: list[str] = []
    for m in messages:
        if "deleted while pending" in m:
            reported += re.findall(r"\d+-\d+", m.partition("ids=")[2] or m.partition(" id=")[2])
    assert sorted(reported) == sorted(deleted), (
        f"{len(deleted - set(reported))} deleted entries not reported, {len(reported)} reports; "
        f"lost_entries={summary.lost_entries}"
    )
    assert summary.handled == ENTRIES - DELETED
    assert_exact(rclient, state_dir, topic, app_name, 1, kept)


def _pending(client: Any, stream: str, group: str) -> int:
    try:
        return int(client.xpending(stream, group)["pending"])
    except Exception:
        return 0
