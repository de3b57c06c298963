"""The consumer group under a running worker: destroyed (and re-created at the checkpoint), and
entries a foreign consumer of the group took and never acknowledged (periodic XAUTOCLAIM)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.keys import lease_key, stream_key
from tests.conftest import Names
from tests.crash.support import assert_exact, order_records, view_all
from tests.integration.failures_support import WorkerThread, read_state
from tests.support import wait_until

pytestmark = pytest.mark.integration


def totals_app(name: str, topic: str, seen: list[str] | None = None, work_s: float = 0.0) -> App:
    """``{"count", "total"}`` per key, the state ``tests.crash.support.assert_exact`` checks."""
    app = App(name)

    @app.handler(topic)
    def handle(value: dict[str, Any], ctx: Context) -> None:
        state = ctx.state
        state["count"] = state.get("count", 0) + 1
        state["total"] = state.get("total", 0) + value["amount"]
        if seen is not None:
            seen.append(ctx.id)
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass

    return app


def applied(client: Any, state_dir: Path, topic: str, app: str, partitions: int) -> int:
    return sum(v.applied for v in view_all(client, state_dir, topic, app, partitions))


def test_group_destroyed_under_a_running_worker_is_recreated_at_the_checkpoint(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pspf")
    partitions = 4
    topic, app_name = make_topic(partitions), names.app()
    records = order_records(20_000, 300, seed=8)
    produce(topic, records)
    settings = make_settings(PSPF_BATCH_SIZE=200)
    state_dir = Path(settings.state.dir)
    app = totals_app(app_name, topic, work_s=100e-6)

    with WorkerThread(app, settings) as runner:
        wait_until(lambda: applied(rclient, state_dir, topic, app_name, partitions) >= 4000, 20, "progress")
        for p in range(partitions):
            assert rclient.xgroup_destroy(stream_key(topic, p), app_name) == 1
        destroyed_at = applied(rclient, state_dir, topic, app_name, partitions)
        print(f"destroyed the group on every partition after {destroyed_at} entries")
        assert destroyed_at < len(records), "the worker finished before the group was destroyed"
        more = order_records(5_000, 300, seed=9)
        produce(topic, more)
        records += more

        def finished() -> bool:
            runner.check()
            views = view_all(rclient, state_dir, topic, app_name, partitions)
            return sum(v.applied for v in views) >= len(records) and all(
                not v.pending and v.checkpoint == v.last_id for v in views
            )

        wait_until(finished, 60, "every entry applied after the group was re-created")

        # Again while the worker waits for new entries, on one partition.
        assert rclient.xgroup_destroy(stream_key(topic, 2), app_name) == 1
        time.sleep(0.3)
        more = order_records(1_000, 300, seed=10)
        produce(topic, more)
        records += more
        wait_until(finished, 30, "every entry applied after the second re-creation")
        runner.stop()

    assert_exact(rclient, state_dir, topic, app_name, partitions, records)
    messages = [r.getMessage() for r in caplog.records]
    missing = [m for m in messages if "giving the partitions up" in m]
    recreated = [
        m for m in messages if re.search(r"consumer group \S+ is missing on .* re-creating it at \d", m)
    ]
    assert missing, "the worker should log the missing group"
    assert len(recreated) >= partitions + 1, recreated
    for p in range(partitions):
        assert rclient.xinfo_groups(stream_key(topic, p))[0]["name"] == app_name.encode()


# -- entries a foreign consumer of the group left idle -----------------------------------------------


def steal(client: Any, topic: str, app: str, count: int) -> list[bytes]:
    """Add ``count`` entries and read them as consumer "intruder" in one MULTI/EXEC: the worker
    cannot get them first. The intruder never acknowledges them."""
    stream = stream_key(topic, 0)
    with client.pipeline(transaction=True) as pipe:
        for i in range(count):
            pipe.xadd(stream, {b"key": f"stolen{i}".encode(), b"value": b'{"amount": 1000}'})
        pipe.xreadgroup(app, "intruder", {stream: ">"}, count=count)
        *ids, reply = pipe.execute()
    # a cluster client parses the reply into {stream: [entries]}, a server's client into [[stream, entries]]
    entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    got: list[bytes] = [entry_id for entry_id, _ in entries]
    assert got == ids, (got, ids)
    return list(ids)


@pytest.mark.parametrize("later_entries", [0, 50], ids=["last-entries", "with-later-entries"])
def test_periodic_claim_takes_over_entries_a_foreign_consumer_left_idle(
    later_entries: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A raw redis-py consumer in the app's group reads 5 entries and never acknowledges them.

    The worker (``PSPF_MIN_IDLE_MS=300``) must claim them once idle and apply them. With later
    entries, the worker applies those first, so its checkpoint passes the stolen ones before it
    claims them: they must still be applied, not skipped as "at or below the checkpoint".
    """
    caplog.set_level(logging.INFO, logger="pspf")
    topic, app_name = make_topic(1), names.app()
    records = order_records(100, 10, seed=1)
    produce(topic, records)
    settings = make_settings(PSPF_MIN_IDLE_MS=300, PSPF_CONSUMER="worker")
    state_dir = Path(settings.state.dir)
    seen: list[str] = []
    stream = stream_key(topic, 0)

    with WorkerThread(totals_app(app_name, topic, seen), settings) as runner:
        wait_until(lambda: applied(rclient, state_dir, topic, app_name, 1) == 100, 15, "the first entries")
        stolen = steal(rclient, topic, app_name, 5)
        records += [(f"stolen{i}", {"amount": 1000}) for i in range(5)]
        pel = rclient.xpending_range(stream, app_name, "-", "+", 100)
        assert {row["consumer"] for row in pel} == {b"intruder"} and len(pel) == 5
        if later_entries:
            later = order_records(later_entries, 10, seed=2)
            produce(topic, later)
            records += later
            wait_until(
                lambda: applied(rclient, state_dir, topic, app_name, 1) >= 100 + later_entries,
                10,
                "the later entries",
            )
        wait_until(
            lambda: (
                not any(
                    row["consumer"] == b"intruder"
                    for row in rclient.xpending_range(stream, app_name, "-", "+", 100)
                )
            ),
            10,
            "the worker to claim the idle entries",
        )
        wait_until(
            lambda: rclient.xpending(stream, app_name)["pending"] == 0, 10, "the claimed entries acknowledged"
        )
        time.sleep(0.3)
        runner.stop()

    claims = [
        r.getMessage() for r in caplog.records if "idle over 300 ms from other consumers" in r.getMessage()
    ]
    assert claims and claims[0].startswith("claimed 5 entries"), claims
    ran = {entry_id.decode() for entry_id in stolen} & set(seen)
    assert len(ran) == 5, (
        f"the worker claimed and acknowledged the 5 stolen entries but ran {len(ran)} of them; "
        f"state count {applied(rclient, state_dir, topic, app_name, 1)} of {len(records)}"
    )
    assert_exact(rclient, state_dir, topic, app_name, 1, records)
    assert read_state(state_dir, app_name, 1)["stolen0"] == {"count": 1, "total": 1000}


def test_entries_a_foreign_consumer_took_are_applied_at_takeover_though_below_the_checkpoint(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """A foreign consumer takes 5 entries; the worker applies the 25 after them, so its checkpoint
    passes the 5; it restarts long before ``min_idle_ms``. Its takeover claims the 5 with the
    rest of the pending list: they were never applied and must be, not acknowledged as done."""
    topic, app_name = make_topic(1), names.app()
    records = order_records(10, 5, seed=3)
    produce(topic, records)
    settings = make_settings(PSPF_MIN_IDLE_MS=600_000, PSPF_CONSUMER="worker")
    state_dir = Path(settings.state.dir)
    seen: list[str] = []

    with WorkerThread(totals_app(app_name, topic, seen), settings) as runner:
        wait_until(lambda: applied(rclient, state_dir, topic, app_name, 1) == 10, 15, "the first entries")
        stolen = steal(rclient, topic, app_name, 5)
        records += [(f"stolen{i}", {"amount": 1000}) for i in range(5)]
        later = order_records(25, 5, seed=4)
        produce(topic, later)
        records += later
        wait_until(lambda: applied(rclient, state_dir, topic, app_name, 1) == 35, 15, "the later entries")
        runner.stop()
    stream = stream_key(topic, 0)
    assert {row["consumer"] for row in rclient.xpending_range(stream, app_name, "-", "+", 100)} == {
        b"intruder"
    }

    with WorkerThread(totals_app(app_name, topic, seen), settings) as runner:
        wait_until(lambda: rclient.xpending(stream, app_name)["pending"] == 0, 15, "the takeover")
        runner.stop()

    ran = {entry_id.decode() for entry_id in stolen} & set(seen)
    assert len(ran) == 5, f"the restarted worker acknowledged the 5 stolen entries but ran {len(ran)}"
    assert_exact(rclient, state_dir, topic, app_name, 1, records)


def test_a_lease_of_our_own_that_a_timed_out_call_took_is_given_up_and_taken_again(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """After a stall of Redis, a lease acquisition whose reply the worker never got (its call timed
    out) was applied by the server later: the lease carries the worker's own identity, and nobody
    works the partition until it expires. The worker must recognise it as its own at once."""
    topic, app_name = make_topic(2), names.app()
    records = order_records(200, 20, seed=5)
    produce(topic, records)
    settings = make_settings(PSPF_LEASE_TTL_MS=2000)
    worker = Worker(totals_app(app_name, topic), settings)
    # What the late acquisition left: the worker's owner id, a token, a long time to live.
    rclient.set(lease_key(topic, 0, app_name), f"{worker.leases.owner}|999", px=60_000)
    thread = threading.Thread(target=worker.run, kwargs={"until_idle": True}, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(15)
    if thread.is_alive():
        worker.stop()
        thread.join(10)
        raise AssertionError(
            "partition 0 stayed without a working owner while its lease was the worker's own"
        )
    print(f"finished in {time.monotonic() - started:.1f}s")
    assert_exact(rclient, Path(settings.state.dir), topic, app_name, 2, records)
