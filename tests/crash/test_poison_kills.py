"""Poison entries that kill the worker process: a supervisor restarts ``pspf run --until-idle``.

An entry whose handler SIGKILLs the process is never recorded as failed: only its delivery count
grows with each restart. Once it was delivered more than ``max_deliveries`` (5) times it must go to
the DLQ as ``PoisonEntry`` without running, and every other entry must be applied exactly once.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from pspf.failures import DeadLetter
from pspf.keys import dlq_key, partition_for, stream_key
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.support import Records, assert_exact

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.apps_failures:killer"
BATCH = 100
LEASE_TTL_MS = 500  # the smallest allowed: each restart waits for the killed worker's leases
MAX_RESTARTS = 200


class Supervisor:
    """Restarts one ``pspf run --until-idle`` worker (same consumer name) until it exits 0."""

    def __init__(self, tmp_path: Path, redis_url: str, topic: str, app: str) -> None:
        self.tmp_path = tmp_path
        self.args = [
            "--broker",
            redis_url,
            "--state-dir",
            str(tmp_path / "state"),
            "--consumer",
            "poisoned",
            "--batch-size",
            str(BATCH),
            "--block-ms",
            "100",
            "--lease-ttl-ms",
            str(LEASE_TTL_MS),
            "--until-idle",
        ]
        self.env = subprocess_env(PSPF_TEST_TOPIC=topic, PSPF_TEST_APP=app)
        self.codes: list[int] = []
        self.current: subprocess.Popen[bytes] | None = None
        self.last_log = tmp_path / "run-0.log"

    def run(self, max_restarts: int, timeout_s: float) -> list[int]:
        """Exit codes of every run; the last one is the first that was not a kill."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(max_restarts + 1):
            self.last_log = self.tmp_path / f"run-{attempt}.log"
            with self.last_log.open("wb") as out:
                self.current = subprocess.Popen(
                    pspf_command("run", TARGET, *self.args),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.tmp_path,
                )
            try:
                code = self.current.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"no clean exit within {timeout_s}s after {len(self.codes)} runs {self.codes}\n"
                    f"{self.tail()}"
                ) from None
            self.codes.append(code)
            if code != -signal.SIGKILL:
                return self.codes
        raise AssertionError(f"still killed after {max_restarts} restarts\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.last_log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return f"--- last lines of {self.last_log.name} ---\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.current is not None and self.current.poll() is None:
            self.current.kill()
            self.current.wait(timeout=10)


@pytest.fixture
def supervisor(tmp_path: Path, redis_url: str) -> Iterator[Callable[[str, str], Supervisor]]:
    made: list[Supervisor] = []

    def make(topic: str, app: str) -> Supervisor:
        made.append(Supervisor(tmp_path, redis_url, topic, app))
        return made[-1]

    yield make
    for sup in made:
        sup.stop()


Entries = dict[tuple[int, str], dict[bytes, bytes]]


def stream_entries(rclient: redis.Redis, topic: str, partitions: int) -> Entries:
    """Every entry of the topic by (partition, id); ids repeat across partitions."""
    return {
        (p, entry_id.decode()): fields
        for p in range(partitions)
        for entry_id, fields in rclient.xrange(stream_key(topic, p))
    }


def dead_letters(rclient: redis.Redis, topic: str, partitions: int) -> list[DeadLetter]:
    return [
        DeadLetter.from_fields(fields)
        for p in range(partitions)
        for _, fields in rclient.xrange(dlq_key(topic, p))
    ]


def killer_ids(entries: Entries) -> set[tuple[int, str]]:
    return {where for where, fields in entries.items() if msgspec.json.decode(fields[b"value"]).get("kill")}


def test_entries_that_kill_the_worker_reach_the_dlq_and_their_batch_mates_apply_once(
    supervisor: Callable[[str, str], Supervisor],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """12 killers among 1,200 entries in one partition: 4 at random places in each of 3 batches.

    Kills per killer: the first of a batch runs (and kills) at deliveries 1 and 2 with the whole
    batch, then alone at 3, 4 and 5; the others of its batch ride along twice without running, so
    they kill at 3, 4 and 5 only. Delivery 6 is dead-lettered without running.
    """
    topic, app = make_topic(1), names.app()
    rng = random.Random(11)
    records: Records = []
    for number in range(12):
        batch: Records = [(f"k{rng.randrange(40)}", {"amount": rng.randrange(1, 1000)}) for _ in range(BATCH)]
        if number % 4 == 0:
            for position in rng.sample(range(BATCH), 4):
                batch[position] = (f"k{rng.randrange(40)}", {"amount": 1, "kill": True})
        records += batch
    produce(topic, records)
    entries = stream_entries(rclient, topic, 1)
    killers = killer_ids(entries)
    assert len(killers) == 12

    sup = supervisor(topic, app)
    started = time.monotonic()
    codes = sup.run(MAX_RESTARTS, timeout_s=150)
    elapsed = time.monotonic() - started
    kills = codes.count(-signal.SIGKILL)
    print(f"{len(codes)} runs ({kills} killed) in {elapsed:.1f}s")
    assert codes[-1] == 0, f"the last run failed with {codes[-1]}\n{sup.tail()}"
    assert kills == len(codes) - 1, codes
    # A killer runs at most max_deliveries (5) times, so kills it once at least and 5 times at most.
    assert 12 <= kills <= 5 * 12, codes

    dead = dead_letters(rclient, topic, 1)
    by_id = {(d.source_partition, d.source_id): d for d in dead}
    assert len(by_id) == len(dead), "an entry was dead-lettered twice"
    assert set(by_id) == killers, (
        f"DLQ differs from the killers: {len(set(by_id) - killers)} innocent entries "
        f"{[(i, by_id[i].error_type) for i in sorted(set(by_id) - killers)][:5]}, "
        f"{len(killers - set(by_id))} killers missing"
    )
    for where, record in by_id.items():
        assert record.error_type == "PoisonEntry", (where, record.error_type, record.message)
        assert "delivered 6 times" in record.message and "max_deliveries 5" in record.message, record.message
        assert record.original == entries[where], "the DLQ must keep the source fields unchanged"
        assert (record.source_topic, record.app, record.consumer) == (topic, app, "poisoned")
    good = [(key, value) for key, value in records if not value.get("kill")]
    assert_exact(rclient, tmp_path / "state", topic, app, 1, good)


def test_a_killer_does_not_drag_entries_of_other_partitions_into_the_dlq(
    supervisor: Callable[[str, str], Supervisor],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """One killer in partition 0; partition 1 has only good entries, read in the same cycles.

    Every restart reads (XCLAIMs, so counts a delivery of) the next pending entry of EVERY owned
    partition before any handler runs; the killer in partition 0 (handled first) then kills the
    process, so the entry partition 1 was about to retry one by one is delivered again and again
    without ever running. It must not be judged poison for a crash it never took part in.
    """
    topic, app = make_topic(2), names.app()
    keys0 = [k for k in (f"k{i}" for i in range(200)) if partition_for(k.encode(), 2) == 0][:10]
    keys1 = [k for k in (f"k{i}" for i in range(200)) if partition_for(k.encode(), 2) == 1][:10]
    rng = random.Random(5)
    records: Records = [(rng.choice(keys0), {"amount": rng.randrange(1, 100)}) for _ in range(BATCH)]
    records[20] = (keys0[0], {"amount": 1, "kill": True})
    records += [(rng.choice(keys1), {"amount": rng.randrange(1, 100)}) for _ in range(BATCH)]
    produce(topic, records)
    entries = stream_entries(rclient, topic, 2)
    killers = killer_ids(entries)
    assert len(killers) == 1 and next(iter(killers))[0] == 0

    sup = supervisor(topic, app)
    codes = sup.run(30, timeout_s=60)
    assert codes[-1] == 0, f"the last run failed with {codes[-1]}\n{sup.tail()}"

    dead = dead_letters(rclient, topic, 2)
    innocent = [
        (d.source_partition, d.source_id, d.error_type, d.message)
        for d in dead
        if (d.source_partition, d.source_id) not in killers
    ]
    assert not innocent, (
        f"good entries of another partition were dead-lettered as poison after {len(codes) - 1} kills "
        f"by the killer in partition 0: {innocent}"
    )
    assert {(d.source_partition, d.source_id) for d in dead} == killers
    good = [(key, value) for key, value in records if not value.get("kill")]
    assert_exact(rclient, tmp_path / "state", topic, app, 2, good)
