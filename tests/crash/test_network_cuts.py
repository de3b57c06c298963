"""A worker host cut off from Redis: a cut shorter than the lease TTL moves nothing, a longer one is
a lease that moved (not lost writes), and the state stays exact either way.

The server and the host live in network namespaces of the test's own (``tests.crash.netlab``);
the test skips where they cannot be made (not root, no ``ip netns``).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest

from pspf import Producer, Settings
from pspf.broker import Broker
from tests.crash.netlab import NetLab, netlab  # noqa: F401 (the fixture)
from tests.crash.support import Records, assert_exact, leases, order_records, view_all
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TTL_MS = 3000
#: a short read block: a data call caught by a cut then waits for TCP up to 5.2 s (its socket timeout)
OPTIONS = ("--lease-ttl-ms", str(TTL_MS), "--block-ms", "200", "--batch-size", "50")


class Feeder(threading.Thread):
    """Produces ``records`` over the test's own (never cut) connection, in small steps."""

    def __init__(self, url: str, topic: str, records: Records, seconds: float) -> None:
        super().__init__(daemon=True)
        self.url, self.topic, self.records, self.seconds = url, topic, records, seconds
        self.error: BaseException | None = None

    def run(self) -> None:
        steps = max(1, int(self.seconds / 0.1))
        size = -(-len(self.records) // steps)
        try:
            with Producer(settings=Settings.load({"PSPF_BROKER": self.url}, environ={})) as producer:
                for start in range(0, len(self.records), size):
                    for key, value in self.records[start : start + size]:
                        producer.send(self.topic, value, key=key)
                    producer.flush()
                    time.sleep(0.1)
        except BaseException as exc:
            self.error = exc


def _topic(lab: NetLab, name: str, partitions: int) -> str:
    broker = Broker(Settings.load({"PSPF_BROKER": lab.local_url}, environ={}).redis)
    try:
        broker.topics.create_topic(name, partitions)
    finally:
        broker.close()
    return name


def _done(lab: NetLab, state_dir: Path, topic: str, app: str, partitions: int, count: int) -> bool:
    """Every entry applied in ``state_dir``'s stores, acknowledged, and the checkpoints at the ends."""
    with lab.client() as client:
        views = view_all(client, state_dir, topic, app, partitions)
    return sum(v.applied for v in views) == count and all(
        v.checkpoint == v.last_id and not v.pending for v in views
    )


def test_cuts_shorter_than_the_lease_ttl_move_no_partition(netlab: NetLab) -> None:  # noqa: F811
    """Four cuts of 1.5 s (TTL 3 s) while entries flow: the host keeps every lease (same tokens)."""
    partitions, app = 2, "cut-app"
    topic = _topic(netlab, "cut-orders", partitions)
    records = order_records(6_000, 200, seed=16)
    host = netlab.worker("host", topic, app, *OPTIONS, PSPF_TEST_WORK_US="100")
    with netlab.client() as client:
        wait_until(
            lambda: all(
                lease and lease.consumer == "host"
                for lease in leases(client, topic, app, partitions).values()
            ),
            20,
            "the host to take its partitions",
        )
        before = leases(client, topic, app, partitions)
    feeder = Feeder(netlab.local_url, topic, records, seconds=14)
    feeder.start()
    for pause in (1.0, 1.7, 1.3, 2.1):
        time.sleep(pause)
        netlab.cut(1.5)
    feeder.join(60)
    assert not feeder.is_alive() and feeder.error is None, feeder.error
    state_dir = netlab.tmp_path / "state-host"
    wait_until(
        lambda: _done(netlab, state_dir, topic, app, partitions, len(records)), 60, "the host to catch up"
    )
    with netlab.client() as client:
        after = leases(client, topic, app, partitions)
    log = host.log.read_text()
    assert after == before, f"leases moved in cuts shorter than the TTL: {before} -> {after}\n{host.tail()}"
    assert "lease expired" not in log, host.tail()
    host.proc.send_signal(signal.SIGTERM)
    assert host.wait(30) == 0, host.tail()
    with netlab.client() as client:
        assert_exact(client, state_dir, topic, app, partitions, records)


def test_a_cut_longer_than_the_ttl_is_a_moved_lease_not_lost_writes(netlab: NetLab) -> None:  # noqa: F811
    """The host is cut off for 6 s (TTL 3 s); the other worker takes partition 0 over (a new token,
    its own backup identity). Healed, the host says the lease moved; Redis lost nothing."""
    app = "long-cut-app"
    topic = _topic(netlab, "long-cut-orders", 1)
    first, second = order_records(2_000, 50, seed=15), order_records(2_000, 50, seed=151)
    host = netlab.worker("host", topic, app, *OPTIONS, PSPF_TEST_WORK_US="100")
    with netlab.client() as client:
        wait_until(lambda: leases(client, topic, app, 1)[0] or None, 20, "the host to take partition 0")
        assert leases(client, topic, app, 1)[0].consumer == "host"  # type: ignore[union-attr]
    Feeder(netlab.local_url, topic, first, seconds=0.5).run()
    other = netlab.worker("other", topic, app, *OPTIONS, on_host=False)
    wait_until(lambda: "worker started" in other.log.read_text(), 20, "the other worker to start")
    time.sleep(TTL_MS / 1000)  # the other counts as a member
    with netlab.client() as client:
        token = leases(client, topic, app, 1)[0].token  # type: ignore[union-attr]

    netlab.cut(6.0)
    with netlab.client() as client:
        moved = leases(client, topic, app, 1)[0]
    assert moved is not None and moved.consumer == "other" and moved.token > token, moved
    Feeder(netlab.local_url, topic, second, seconds=0.5).run()
    said = re.compile(r"lease of partition 0 .*expired.* now held by other")
    wait_until(lambda: said.search(host.log.read_text()), 20, "the host to say its lease moved")

    log = host.log.read_text()
    assert "went back" not in log and "lost writes" not in log, host.tail()
    wait_until(
        lambda: _done(netlab, netlab.tmp_path / "state-other", topic, app, 1, len(first) + len(second)),
        60,
        "the other worker to catch up",
    )
    for worker in (host, other):
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.tail()
    with netlab.client() as client:
        assert_exact(client, netlab.tmp_path / "state-other", topic, app, 1, first + second)
