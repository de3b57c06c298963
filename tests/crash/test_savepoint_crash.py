"""Savepoints and restores SIGKILLed at each of their steps (crash points), then resumed or run again.

A savepoint killed at any step leaves the app as it was and is taken again under its name
(``--resume``); the resumed one forks into exactly the state the app reaches. A restore killed
before its switch leaves the target as it was (run it again); from the switch on the target's
workers are refused until ``--resume`` finishes it, and then the state is exact and the app itself,
back at an earlier cut, publishes nothing twice.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import Settings, Worker
from pspf.broker import Broker
from pspf.errors import NotFound, UnderWay
from pspf.keys import app_key, backup_keys, partition_for, stream_key
from pspf.ownership.operation_lease import operation_key
from pspf.repartition.run import Repartition, make_plan
from pspf.savepoint import restoring
from pspf.savepoint.manifest import MANIFEST
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.support import backup_state
from tests.integration.failures_support import WorkerThread
from tests.integration.test_savepoints import KEYS, after_the_cut, outputs, running_totals, totals
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

#: The operation lease of the CLI processes: a killed one's lapses this long after its kill.
LEASE_TTL_MS = 1000


def pspf_cli(
    redis_url: str, *args: str, crash: tuple[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``pspf app ARGS`` in a process of its own, SIGKILLed at ``crash`` (variable, step) when given."""
    extra = {} if crash is None else {crash[0]: crash[1]}
    env = subprocess_env(PSPF_LEASE_TTL_MS=str(LEASE_TTL_MS), **extra)
    command = pspf_command("app", *args, "--broker", redis_url)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def savepoint_cli(
    redis_url: str, app: str, *args: str, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    crash = None if crash_at is None else ("PSPF_SAVEPOINT_CRASH_AT", crash_at)
    return pspf_cli(redis_url, "savepoint", app, *args, crash=crash)


def restore_cli(
    redis_url: str, app: str, *args: str, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    crash = None if crash_at is None else ("PSPF_RESTORE_CRASH_AT", crash_at)
    return pspf_cli(redis_url, "restore", app, *args, "--yes", crash=crash)


def lease_lapsed(rclient: redis.Redis, app: str) -> None:
    """Wait for the operation lease a killed command held on ``app`` to lapse."""
    wait_until(
        lambda: not rclient.exists(operation_key(app)),
        LEASE_TTL_MS / 1000 + 10,
        f"the killed command's operation lease on {app} to lapse",
    )


def full_state(rclient: redis.Redis, topic: str, app: str, partitions: int) -> dict[str, int]:
    """Every key's total as the app's backups hold it; each key once, in its key's partition."""
    found: dict[str, int] = {}
    for partition in range(partitions):
        for key, value in backup_state(rclient, topic, app, partition).items():
            assert key not in found, f"{app}: key {key} has state in two partitions"
            assert partition_for(key.encode(), partitions) == partition, f"{app}: {key} in {partition}"
            found[key] = value["total"]
    return found


def snapshot_of(rclient: redis.Redis, topic: str, app: str, partitions: int) -> dict[str, Any]:
    """What a restore of ``app`` replaces: its record, its backups and its groups' positions."""
    found: dict[str, Any] = {"record": rclient.hgetall(app_key(app))}
    for p in range(partitions):
        backup = backup_keys(topic, p, app)
        found[f"values {p}"] = rclient.hgetall(backup.values)
        found[f"meta {p}"] = rclient.hgetall(backup.meta)
        groups = rclient.xinfo_groups(stream_key(topic, p))
        found[f"groups {p}"] = sorted((g["name"], g["last-delivered-id"]) for g in groups)
    return found


def entries(start: int, end: int) -> list[tuple[str | None, Any]]:
    return [(f"k{n % KEYS}", {"n": n}) for n in range(start, end)]


# -- A savepoint killed at each step, then --resume -----------------------------------------------


@pytest.mark.parametrize("step", ["partition 0", "partition 1", "manifest"])
def test_a_savepoint_killed_at_any_step_leaves_the_app_running_and_resumes_into_an_exact_fork(
    step: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, out, fork_out = make_topic(3), make_topic(2), make_topic(2)
    app, fork = names.app(), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_BATCH_SIZE="50")
    produce(topic, entries(0, 600))
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    path = tmp_path / "sp" / "cut"

    with WorkerThread(running_totals(app, topic, out, pause_s=0.001), settings) as worker:
        produce(topic, entries(600, 2400))
        killed = savepoint_cli(redis_url, app, "--to", str(tmp_path / "sp"), "--name", "cut", crash_at=step)
        assert killed.returncode == -9, killed.stderr
        worker.check()
        assert worker.alive(), "the app's worker stopped during the killed savepoint"
        listed = service.savepoints.listed(app)
        assert [(e.name, e.state, e.path) for e in listed] == [("cut", "taking", str(path))]
        assert not (path / MANIFEST).exists()
        written = 3 if step == "manifest" else int(step.split()[1]) + 1
        assert sorted(p.name for p in path.iterdir()) == [f"partition-{p}.state" for p in range(written)]
        with pytest.raises(NotFound, match="holds no savepoint"):  # nothing restores an unfinished one
            service.savepoints.restore(app, str(path), as_app=fork, dry_run=True)

        lease_lapsed(rclient, app)
        resumed = savepoint_cli(redis_url, app, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.strip().splitlines()[-1] == str(path)
        assert resumed.stdout.startswith(f"savepoint cut of app {app}: 3 partitions")
        assert "(app running)" in resumed.stdout, resumed.stdout
        produce(topic, entries(2400, 2700))
        worker.check()
        assert worker.alive(), "the app's worker stopped during the resumed savepoint"

    # The app: every entry handled once, by the one worker the savepoint never disturbed.
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    assert full_state(rclient, topic, app, 3) == totals(range(2700))
    original = dict(outputs(rclient, out, 2))
    assert len(outputs(rclient, out, 2)) == len(original) == 2700
    listed = service.savepoints.listed(app)
    assert [(e.name, e.state, e.keys, e.partitions) for e in listed] == [("cut", "complete", KEYS, 3)]
    assert (path / MANIFEST).exists()

    cut = after_the_cut(rclient, topic, 3, str(path))
    assert set(range(2400, 2700)) <= cut  # produced after the savepoint: the fork handles them
    restored = service.savepoints.restore(app, str(path), as_app=fork)
    assert restored.fork and restored.mode == "same" and restored.entries_to_handle == len(cut)
    handled = Worker(
        running_totals(fork, topic, fork_out), make_settings(PSPF_STATE_DIR=str(tmp_path / "fork"))
    ).run(until_idle=True)
    assert handled.handled == len(cut)
    assert full_state(rclient, topic, fork, 3) == full_state(rclient, topic, app, 3)
    forked = outputs(rclient, fork_out, 2)
    assert sorted(n for n, _ in forked) == sorted(cut)  # each entry after the cut, once
    assert dict(forked) == {n: original[n] for n in cut}


# -- A restore (same partition count) killed at each step ------------------------------------------

RESTORE_STEPS = ["staged 0", "staged 1", "switch", "switched 0", "switched 1"]


@pytest.mark.parametrize("as_fork", [False, True], ids=["itself", "fork"])
@pytest.mark.parametrize("step", RESTORE_STEPS)
def test_a_restore_killed_at_any_step_leaves_the_app_as_it_was_or_is_resumed_to_the_exact_state(
    step: str,
    as_fork: bool,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, out, fork_out = make_topic(2), make_topic(2), make_topic(2)
    app, fork = names.app(), names.app()
    target = fork if as_fork else app
    fork_option = ["--as", fork] if as_fork else []
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    produce(topic, entries(0, 400))
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "cut")
    produce(topic, entries(400, 1000))
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    first_run = sorted(outputs(rclient, out, 2))
    assert len(first_run) == 1000
    before = snapshot_of(rclient, topic, app, 2)
    where = make_settings(PSPF_STATE_DIR=str(tmp_path / "fork")) if as_fork else settings
    target_out = fork_out if as_fork else out

    killed = restore_cli(redis_url, app, "--from", taken.path, *fork_option, crash_at=step)
    assert killed.returncode == -9, killed.stderr
    if step.startswith("staged"):
        # Killed while staging: nothing live changed; the restore is run again, not resumed.
        assert snapshot_of(rclient, topic, app, 2) == before
        assert restoring.recorded(service.base.broker, target) is None
        if as_fork:
            assert not rclient.exists(app_key(fork)), "the fork has a record"
            for p in range(2):
                assert fork.encode() not in {g["name"] for g in rclient.xinfo_groups(stream_key(topic, p))}
        else:
            again = Worker(running_totals(app, topic, out), settings).run(until_idle=True)
            assert again.handled == 0
            assert full_state(rclient, topic, app, 2) == totals(range(1000))
            assert sorted(outputs(rclient, out, 2)) == first_run
        lease_lapsed(rclient, target)
        with pytest.raises(NotFound, match="without --resume"):
            service.savepoints.restore(app, resume=True, as_app=fork if as_fork else None)
        rerun = restore_cli(redis_url, app, "--from", taken.path, *fork_option)
        assert rerun.returncode == 0, rerun.stderr
        assert "600 entries to handle after the cut" in rerun.stdout, rerun.stdout
    else:
        # Killed from the switch on: the target's workers wait for the restore to be finished.
        with pytest.raises(UnderWay, match=f"a restore of app '{target}' .* is under way"):
            Worker(running_totals(target, topic, target_out), where).run(until_idle=True)
        lease_lapsed(rclient, target)
        with pytest.raises(UnderWay, match="--resume"):  # not restored anew over the one under way
            service.savepoints.restore(app, taken.path, as_app=fork if as_fork else None)
        resumed = restore_cli(redis_url, app, "--resume", *fork_option)
        assert resumed.returncode == 0, resumed.stderr
        assert "finished the restore" in resumed.stdout, resumed.stdout
    assert restoring.RESTORING.encode() not in rclient.hgetall(app_key(target))

    handled = Worker(running_totals(target, topic, target_out), where).run(until_idle=True)
    assert handled.handled == 600  # the entries after the cut, once
    assert full_state(rclient, topic, target, 2) == totals(range(1000))
    if as_fork:
        forked = outputs(rclient, fork_out, 2)
        assert sorted(n for n, _ in forked) == list(range(400, 1000))
        assert sorted(forked) == [o for o in first_run if o[0] >= 400]
        assert sorted(outputs(rclient, out, 2)) == first_run  # the original's outputs untouched
        assert full_state(rclient, topic, app, 2) == totals(range(1000))
    else:
        # Back at the cut, the app emits again what it had emitted after it: each output once.
        assert sorted(outputs(rclient, out, 2)) == first_run
    produce(topic, entries(1000, 1100))
    more = Worker(running_totals(target, topic, target_out), where).run(until_idle=True)
    assert more.handled == 100
    assert full_state(rclient, topic, target, 2) == totals(range(1100))


# -- A restore after a repartition killed at each step ---------------------------------------------


@pytest.mark.parametrize(
    ("step", "as_fork"),
    [("staged", False), ("switch", True), ("switched 0", False), ("switched 2", True)],
)
def test_a_restore_into_another_partition_count_killed_at_any_step_is_finished_exactly(
    step: str,
    as_fork: bool,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, out, fork_out = make_topic(2), make_topic(1), make_topic(1)
    app, fork = names.app(), names.app()
    target = fork if as_fork else app
    fork_option = ["--as", fork] if as_fork else []
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    where = make_settings(PSPF_STATE_DIR=str(tmp_path / ("fork" if as_fork else "b")))
    target_out = fork_out if as_fork else out
    produce(topic, entries(0, 600))
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "before")
    produce(topic, entries(600, 1200))
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    broker = service.base.broker
    Repartition(broker, make_plan(broker, topic, 3)).run()
    produce(topic, entries(1200, 1500))
    before = snapshot_of(rclient, topic, app, 3)

    options = ["--from", taken.path, "--partitions", "3", *fork_option]
    killed = restore_cli(redis_url, app, *options, crash_at=step)
    assert killed.returncode == -9, killed.stderr
    if step == "staged":
        assert snapshot_of(rclient, topic, app, 3) == before
        assert restoring.recorded(broker, target) is None
        if as_fork:
            assert not rclient.exists(app_key(fork)), "the fork has a record"
        lease_lapsed(rclient, target)
        rerun = restore_cli(redis_url, app, *options)
        assert rerun.returncode == 0, rerun.stderr
        assert "split from 2 into 3 partitions" in rerun.stdout, rerun.stdout
    else:
        plan = restoring.recorded(broker, target)
        assert plan is not None and plan.partitions == 3 and plan.saved_partitions == 2
        with pytest.raises(UnderWay, match=f"a restore of app '{target}' .* is under way"):
            Worker(running_totals(target, topic, target_out), where).run(until_idle=True)
        lease_lapsed(rclient, target)
        resumed = restore_cli(redis_url, app, "--resume", *fork_option)
        assert resumed.returncode == 0, resumed.stderr
        assert restoring.recorded(broker, target) is None

    handled = Worker(running_totals(target, topic, target_out), where).run(until_idle=True)
    assert handled.handled == 900  # the entries after the cut, once
    assert full_state(rclient, topic, target, 3) == totals(range(1500))
    if as_fork:
        forked = outputs(rclient, fork_out, 1)
        assert sorted(n for n, _ in forked) == list(range(600, 1500))
        assert full_state(rclient, topic, app, 3) == totals(range(1200))  # the original untouched
    listed = service.savepoints.listed(app)
    assert [(e.name, e.state) for e in listed] == [("before", "complete")]


# -- Killed at a random moment ---------------------------------------------------------------------


def killed_at_random(command: list[str], delay_s: float) -> int:
    """Run ``command`` and SIGKILL it ``delay_s`` after it started (if it still runs); its exit code."""
    process = subprocess.Popen(
        command,
        env=subprocess_env(PSPF_LEASE_TTL_MS=str(LEASE_TTL_MS)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return process.wait(timeout=delay_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


@pytest.mark.parametrize("seed", range(4))
def test_a_savepoint_and_a_restore_killed_at_random_moments_end_exact(
    seed: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """SIGKILL at a moment drawn from the seed, after the command's start-up (measured first) and
    within the time a savepoint or a restore of 100,000 keys takes: finished with --resume, or run
    again when it had not begun its switch, the fork's state is the original's at the cut, exactly."""
    import random

    draw = random.Random(seed)
    topic, out = make_topic(3), make_topic(1)
    app, fork = names.app(), names.app()
    produce(topic, [(f"u{n}", {"n": n}) for n in range(100_000)])
    Worker(running_totals(app, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))).run(
        until_idle=True
    )
    expected = {f"u{n}": n for n in range(100_000)}
    started = time.monotonic()
    subprocess.run(
        [*pspf_command("app", "savepoints", app), "--broker", redis_url], check=True, capture_output=True
    )
    start_up = time.monotonic() - started

    taking = pspf_command("app", "savepoint", app, "--to", str(tmp_path / "sp"), "--name", "cut")
    code = killed_at_random([*taking, "--broker", redis_url], start_up + draw.uniform(-0.1, 0.3))
    lease_lapsed(rclient, app)
    state = {e.name: e.state for e in service.savepoints.listed(app)}.get("cut")
    if state != "complete":
        how = ("--resume",) if state else ("--to", str(tmp_path / "sp"), "--name", "cut")
        again = savepoint_cli(redis_url, app, *how)
        assert again.returncode == 0, (code, state, again.stderr)
    path = str(tmp_path / "sp" / "cut")

    restoring_cli = pspf_command("app", "restore", app, "--from", path, "--as", fork, "--yes")
    code = killed_at_random([*restoring_cli, "--broker", redis_url], start_up + draw.uniform(-0.1, 0.6))
    lease_lapsed(rclient, fork)
    under_way = restoring.recorded(Broker(make_settings().redis), fork) is not None
    finished = not under_way and rclient.hexists(app_key(fork), "topics")  # killed once done
    if not finished:
        finish = ("--as", fork, "--resume") if under_way else ("--from", path, "--as", fork)
        done = restore_cli(redis_url, app, *finish)
        assert done.returncode == 0, (code, under_way, done.stderr)
    handled = Worker(running_totals(fork, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "f"))).run(
        until_idle=True
    )
    assert handled.handled == 0
    assert full_state(rclient, topic, fork, 3) == expected
