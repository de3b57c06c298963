"""SIGTERM mid-stream: the worker commits, acknowledges, releases its leases and exits 0 at once."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import (
    assert_exact,
    assert_no_ack_before_commit,
    held_by,
    no_leases,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 30_000
OPTIONS = ["--batch-size", "200", "--block-ms", "1000", "--lease-ttl-ms", "10000", "--consumer", "term-w"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_mid_stream_exits_clean_and_restart_is_exact(
    signum: signal.Signals,
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 300, seed=23)
    produce(topic, records)
    env = {"PSPF_TEST_WORK_US": "100"}

    worker = spawn("worker", topic, app, *OPTIONS, env=env)
    wait_until(lambda: held_by(rclient, topic, app, PARTITIONS, worker.pid), 15, "the worker to start")
    wait_until(
        lambda: sum(v.applied for v in view_all(rclient, state_dir, topic, app, PARTITIONS)) > 0,
        15,
        "the first commit",
    )
    time.sleep(random.uniform(0.1, 0.6))
    assert worker.alive(), worker.tail()
    worker.proc.send_signal(signum)
    sent = time.monotonic()
    assert worker.wait(timeout=5) == 0, f"graceful stop failed\n{worker.tail()}"
    print(f"exited {time.monotonic() - sent:.2f}s after {signum.name}")

    # Leases released at once (a standby need not wait for the TTL of 10 s).
    assert no_leases(rclient, topic, app, PARTITIONS)
    views = view_all(rclient, state_dir, topic, app, PARTITIONS)
    assert_no_ack_before_commit(views)
    # Nothing committed is left unacknowledged.
    for v in views:
        assert v.pending_done == 0, f"partition {v.partition}: committed entries left pending"
    applied = sum(v.applied for v in views)
    assert 0 < applied < ENTRIES, "the SIGTERM should land mid-stream"
    handled, skipped, failures = worker.summary()
    assert (handled, skipped, failures) == (applied, 0, 0), "the summary must count what was committed"

    again = spawn("again", topic, app, *OPTIONS, "--until-idle", env=env)
    assert again.wait(timeout=60) == 0, again.tail()
    assert again.summary() == (ENTRIES - applied, 0, 0)
    assert_exact(rclient, state_dir, topic, app, PARTITIONS, records)


def test_second_sigterm_exits_at_once_and_loses_nothing(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The first signal waits for the batch in hand; the second exits now, with nothing acked early."""
    topic, app = make_topic(2), names.app()
    records = order_records(2_000, 40, seed=29)
    produce(topic, records)
    options = ["--batch-size", "50", "--block-ms", "100", "--lease-ttl-ms", "1000", "--consumer", "w2x"]
    # 20 ms per entry: one cycle (2 partitions x 50 entries) takes about 2 s.
    worker = spawn("slow", topic, app, *options, env={"PSPF_TEST_WORK_US": "20000"})
    wait_until(lambda: held_by(rclient, topic, app, 2, worker.pid), 15, "the worker to start")
    # A batch in hand (read, about 2 s of work left), not a guess at when the first read comes.
    wait_until(
        lambda: any(v.pending for v in view_all(rclient, state_dir, topic, app, 2)), 15, "a batch in hand"
    )
    worker.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert worker.alive(), "the first signal must let the batch in hand finish"
    worker.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert worker.wait(timeout=2) == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 1.0
    views = view_all(rclient, state_dir, topic, app, 2)
    assert_no_ack_before_commit(views)
    assert any(v.pending_todo for v in views), "the batch in hand should be left pending, uncommitted"

    wait_until(lambda: no_leases(rclient, topic, app, 2), 10, "the leases to expire")
    again = spawn("again", topic, app, *options, "--until-idle")
    assert again.wait(timeout=30) == 0, again.tail()
    assert_exact(rclient, state_dir, topic, app, 2, records)


def test_sigterm_stops_an_idle_owner_and_a_standby_within_5s(
    spawn: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    records = order_records(200, 10, seed=31)
    produce(topic, records)
    options = ["--lease-ttl-ms", "3000"]  # default --block-ms (1000)
    owner = spawn("owner", topic, app, *options, "--consumer", "one")
    wait_until(lambda: held_by(rclient, topic, app, 2, owner.pid), 15, "the owner to start")
    standby = spawn("standby", topic, app, *options, "--consumer", "two")
    wait_until(lambda: b"worker started" in standby.log.read_bytes(), 15, "the standby to start")

    def finished() -> bool:
        return all(
            not v.pending and v.checkpoint == v.last_id for v in view_all(rclient, state_dir, topic, app, 2)
        )

    wait_until(finished, 15, "the owner to finish the input")
    time.sleep(0.5)
    for worker in (owner, standby):
        worker.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert owner.wait(timeout=5) == 0, owner.tail()
    assert standby.wait(timeout=5) == 0, standby.tail()
    assert time.monotonic() - sent < 5
    assert standby.summary() == (0, 0, 0)
    assert owner.summary() == (200, 0, 0)
    assert no_leases(rclient, topic, app, 2)
    assert_exact(rclient, state_dir, topic, app, 2, records)
