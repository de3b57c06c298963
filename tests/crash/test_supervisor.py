"""``pspf run --workers N``: a supervisor of N worker processes on one machine, with real processes.

The supervisor passes its children's stderr through with a ``[worker i pid P]`` prefix and logs
each start, exit and restart; the tests read both from its log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import (
    SUMMARY,
    WorkerProcess,
    assert_exact,
    assert_no_ack_before_commit,
    backup_applied,
    backup_checkpoint,
    no_leases,
    order_records,
    view_all,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

STARTED = re.compile(r"worker (\d+) started pid=(\d+) consumer=(\S+)")
ASSIGNED = re.compile(r"\[worker (\d+) pid (\d+)\] .*partition assigned app=\S+ partition=(\d+)")
CHILD_SUMMARY = re.compile(r"\[worker (\d+) pid (\d+)\] " + SUMMARY.pattern.decode())
#: A worker that lost a partition's lease mid-batch (its cycle outlasted the lease TTL, on a busy
#: machine): that batch was committed locally but refused at the acknowledgement, so the store is one
#: batch ahead of the backup until the next owner rolls it back.
LEASE_LOST = re.compile(
    r"lease lost, giving the partition up stream=pspf:\{[^}]*:(\d+)\}|lease expired .* partition=(\d+)"
)
#: Short leases: a rebalance settles, and a killed child's partitions move, within a few seconds.
FAST = ["--batch-size", "50", "--block-ms", "100", "--lease-ttl-ms", "3000"]


def log_text(supervisor: WorkerProcess) -> str:
    return supervisor.log.read_text(errors="replace")


def started(supervisor: WorkerProcess) -> list[tuple[int, int, str]]:
    """(index, pid, consumer) of every child start, in order."""
    return [(int(i), int(pid), name) for i, pid, name in STARTED.findall(log_text(supervisor))]


def assigned(supervisor: WorkerProcess) -> dict[int, set[int]]:
    """Child index -> the partitions it was assigned (over all its processes)."""
    found: dict[int, set[int]] = defaultdict(set)
    for index, _, partition in ASSIGNED.findall(log_text(supervisor)):
        found[int(index)].add(int(partition))
    return dict(found)


def handled_by_children(supervisor: WorkerProcess) -> dict[int, int]:
    """Child pid -> entries it handled, from the summary line each child prints when it stops."""
    return {int(pid): int(handled) for _, pid, handled, *_ in CHILD_SUMMARY.findall(log_text(supervisor))}


def alive(pid: int, consumer: str) -> bool:
    """Whether ``pid`` is still one of our children (a recycled pid runs something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return f"\0{consumer}-".encode() in cmdline and process_running(pid)


def lost_leases(supervisor: WorkerProcess) -> set[int]:
    return {int(a or b) for a, b in LEASE_LOST.findall(log_text(supervisor))}


def process_running(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def consumer(names: Names) -> str:
    """A consumer name of this test's own: its children are ``NAME-1`` ... ``NAME-N``."""
    return f"sv-{names.app()}"


@pytest.fixture
def supervised(spawn: Spawner, consumer: str) -> Iterator[Spawner]:
    """``spawn``, and at the end no child left running: they live in process groups of their own,
    so killing the supervisor alone would leave them behind."""
    yield spawn
    for proc in spawn.workers:
        if proc.alive():
            proc.kill9()
        for _, pid, _ in started(proc):
            if alive(pid, consumer):
                os.kill(pid, signal.SIGKILL)


def test_three_workers_share_six_partitions_until_idle(
    supervised: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    consumer: str,
) -> None:
    topic, app = make_topic(6), names.app()
    records = order_records(6_000, 200, seed=41)
    produce(topic, records)
    supervisor = supervised(
        "supervisor",
        topic,
        app,
        *FAST,
        "--consumer",
        consumer,
        "--workers",
        "3",
        "--until-idle",
        env={"PSPF_TEST_WORK_US": "1000"},
    )
    assert supervisor.wait(timeout=60) == 0, supervisor.tail()

    children = started(supervisor)
    assert sorted((i, name) for i, _, name in children) == [(i, f"{consumer}-{i}") for i in (1, 2, 3)]
    owned = assigned(supervisor)
    assert sorted(owned) == [1, 2, 3], f"every child should own partitions: {owned}"
    assert set().union(*owned.values()) == set(range(6))
    handled = handled_by_children(supervisor)
    assert sorted(handled) == sorted(pid for _, pid, _ in children)
    if not lost_leases(supervisor):
        # Partitions moved only at safe points: no entry was handled twice.
        assert sum(handled.values()) == len(records), handled
    for stream in (f"pspf:{{{topic}:{p}}}" for p in range(6)):
        for row in rclient.xinfo_consumers(stream, app):
            assert row["name"].decode() in {f"{consumer}-{i}" for i in (1, 2, 3)}
    assert no_leases(rclient, topic, app, 6)
    assert_exact(rclient, state_dir, topic, app, 6, records)
    assert "all 3 workers exited 0" in log_text(supervisor)


def test_sigterm_stops_every_worker_gracefully(
    supervised: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    consumer: str,
) -> None:
    topic, app = make_topic(6), names.app()
    records = order_records(6_000, 200, seed=43)
    produce(topic, records)
    options = [*FAST, "--consumer", consumer]
    env = {"PSPF_TEST_WORK_US": "2000"}  # 12 s of work: the signal lands mid-run
    supervisor = supervised("supervisor", topic, app, *options, "--workers", "3", env=env)

    def working() -> bool:
        return len(assigned(supervisor)) == 3 and all(
            v.applied > 0 for v in view_all(rclient, state_dir, topic, app, 6)
        )

    wait_until(working, 25, "every child to own partitions and every partition to commit", interval=0.1)
    supervisor.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert supervisor.wait(timeout=5) == 0, supervisor.tail()
    print(f"supervisor exited {time.monotonic() - sent:.2f}s after SIGTERM")

    children = started(supervisor)
    assert len(children) == 3, "no child was restarted"
    for index, pid, _ in children:
        assert f"worker {index} pid={pid} exited 0" in log_text(supervisor), supervisor.tail()
        assert not alive(pid, consumer)
    assert no_leases(rclient, topic, app, 6), "each child releases its partitions"
    views = view_all(rclient, state_dir, topic, app, 6)
    assert_no_ack_before_commit(views)
    lost = lost_leases(supervisor)
    for v in views:
        # Nothing committed is left unacknowledged: the backup (the truth) and the acknowledgements
        # move in one call, and so do the store and the acknowledgements unless a lease was lost.
        backup_cp = backup_checkpoint(rclient, topic, app, v.partition)
        assert not [i for i in v.pending if backup_cp is not None and i <= backup_cp], v.partition
        if v.partition not in lost:
            assert v.pending_done == 0, f"partition {v.partition}: committed entries left pending"
    applied = backup_applied(rclient, topic, app, 6)
    assert 0 < applied < len(records), "the SIGTERM should land mid-run"
    if not lost:
        assert sum(handled_by_children(supervisor).values()) == applied
    else:
        print(f"leases lost mid-batch (a slow cycle) on partitions {sorted(lost)}")

    again = supervised("again", topic, app, *options, "--until-idle")
    assert again.wait(timeout=60) == 0, again.tail()
    assert again.summary() == (len(records) - applied, 0, 0)
    assert_exact(rclient, state_dir, topic, app, 6, records)


def test_a_killed_worker_is_restarted_under_its_name_and_the_result_is_exact(
    supervised: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    consumer: str,
) -> None:
    topic, app = make_topic(6), names.app()
    records = order_records(6_000, 200, seed=47)
    produce(topic, records)
    supervisor = supervised(
        "supervisor",
        topic,
        app,
        *FAST,
        "--consumer",
        consumer,
        "--workers",
        "3",
        "--until-idle",
        env={"PSPF_TEST_WORK_US": "1500"},
    )

    def second_child_working() -> int | None:
        owned = assigned(supervisor).get(2, set())
        views = view_all(rclient, state_dir, topic, app, 6)
        if owned and any(views[p].applied for p in owned):
            return next(pid for i, pid, _ in started(supervisor) if i == 2)
        return None

    victim = wait_until(second_child_working, 25, "child 2 to commit a batch", interval=0.1)
    os.kill(victim, signal.SIGKILL)
    assert supervisor.wait(timeout=60) == 0, supervisor.tail()

    text = log_text(supervisor)
    assert re.search(rf"worker 2 pid={victim} was killed by SIGKILL after \S+; restarting in 0.5s", text), (
        supervisor.tail()
    )
    children = started(supervisor)
    assert len(children) == 4, children
    index, pid, name = children[-1]
    assert (index, name) == (2, f"{consumer}-2") and pid != victim
    assert f"worker 2 started pid={pid} consumer={consumer}-2 (restart 1)" in text
    assert pid in handled_by_children(supervisor), "the restarted child ran to its end"
    assert_exact(rclient, state_dir, topic, app, 6, records)


def test_workers_stop_gracefully_when_the_supervisor_is_killed(
    supervised: Spawner,
    state_dir: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    consumer: str,
) -> None:
    """The children live in process groups of their own: SIGKILL of the supervisor must not orphan them."""
    topic, app = make_topic(4), names.app()
    records = order_records(4_000, 100, seed=53)
    produce(topic, records)
    options = [*FAST, "--consumer", consumer]
    supervisor = supervised(
        "supervisor", topic, app, *options, "--workers", "2", env={"PSPF_TEST_WORK_US": "2000"}
    )
    wait_until(lambda: len(assigned(supervisor)) == 2, 25, "both children to own partitions", interval=0.1)
    assert supervisor.kill9() == -signal.SIGKILL
    pids = [pid for _, pid, _ in started(supervisor)]
    wait_until(lambda: not any(alive(pid, consumer) for pid in pids), 5, "the children to stop")
    assert no_leases(rclient, topic, app, 4), "they stopped gracefully, releasing their partitions"
    views = view_all(rclient, state_dir, topic, app, 4)
    assert_no_ack_before_commit(views)
    assert all(v.pending_done == 0 for v in views)

    again = supervised("again", topic, app, *options, "--until-idle")
    assert again.wait(timeout=60) == 0, again.tail()
    assert_exact(rclient, state_dir, topic, app, 4, records)


def test_an_unknown_app_module_fails_once_with_exit_2(tmp_path: Path, redis_url: str) -> None:
    command = pspf_command("run", "no_such_module:main", "--workers", "3", "--broker", redis_url)
    done = subprocess.run(command, capture_output=True, env=subprocess_env(), cwd=tmp_path, timeout=30)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [
        f"Error: cannot import module 'no_such_module': no module 'no_such_module' in the current "
        f"directory {tmp_path} (which is on the path) or elsewhere on the path"
    ]
    assert done.stdout == b""


def test_a_setting_every_child_refuses_stops_the_supervisor_with_exit_2(
    supervised: Spawner, make_topic: Callable[[int], str], names: Names, consumer: str
) -> None:
    """A bad setting only a worker sees (--standby needs the backup): no restart loop."""
    topic, app = make_topic(2), names.app()
    options = ["--consumer", consumer, "--workers", "3", "--standby", "--state-backup", "off"]
    supervisor = supervised("supervisor", topic, app, *options)
    assert supervisor.wait(timeout=25) == 2, supervisor.tail()
    assert len(started(supervisor)) == 3, "each child started once, none again"
    assert "restarting" not in log_text(supervisor)
    last = log_text(supervisor).splitlines()[-1]
    assert re.fullmatch(
        r"Error: worker [123] stopped on a configuration error: "
        r"--standby follows the state backup: it needs --state-backup on",
        last,
    ), supervisor.tail()
