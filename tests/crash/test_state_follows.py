"""State that follows its partition: a partition moves between "hosts" (state dirs) and every
takeover meets a store that is missing, behind, ahead by a batch whose acknowledging call never
ran, or written by a zombie owner whose lease moved on. Each must be repaired from the state
backup in Redis (caught up from its log, or restored whole) before any entry is applied; the
backup itself only ever holds acknowledged batches of the lease holder.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf.keys import backup_keys, stream_key
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import (
    ENGINES,
    WorkerProcess,
    assert_backup_exact,
    assert_exact,
    backup_applied,
    backup_identity,
    backup_raw,
    backup_state,
    expected_state,
    held_by,
    leases,
    no_leases,
    order_records,
    process_state,
    read_store,
    state_get_from_backup,
    store_identity,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 40_000
KEYS = 1_000
KILLS = 10
#: Leases expire a second after a killed worker's last renewal: the next host waits no longer.
OPTIONS = ["--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "1000"]


def acknowledged(client: Any, topic: str, app: str, partitions: int = PARTITIONS) -> int:
    """Entries of the topic the app has acknowledged (delivered and no longer pending)."""
    done = 0
    for p in range(partitions):
        stream = stream_key(topic, p)
        groups = [g for g in client.xinfo_groups(stream) if g["name"] == app.encode()]
        if not groups:
            continue
        delivered = groups[0]["last-delivered-id"].decode()
        done += len(client.xrange(stream, "-", delivered)) - int(groups[0]["pending"])
    return done


class Hosts:
    """Workers of one app on "hosts": each host is a state dir of its own."""

    def __init__(self, spawn: Spawner, redis_url: str, topic: str, app: str) -> None:
        self.spawn, self.redis_url, self.topic, self.app = spawn, redis_url, topic, app

    def run(
        self, label: str, state_dir: Path, *args: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        return self.spawn(
            label,
            self.topic,
            self.app,
            "--broker",
            self.redis_url,
            "--state-dir",
            str(state_dir),
            *OPTIONS,
            *args,
            env=env,
            cli_settings=False,
        )


def restored_partitions(log: str, app: str) -> dict[int, int]:
    """Partition -> values copied, from the lines of a worker's log about a full restore."""
    found = re.findall(rf"state backup restored app={re.escape(app)} partition=(\d+) values=(\d+) ", log)
    return {int(p): int(values) for p, values in found}


def repaired_partitions(log: str, app: str) -> dict[int, str]:
    """Partition -> how its store was made equal to the backup: "restored" or "caught up"."""
    found = re.findall(rf"state backup (restored|caught up) app={re.escape(app)} partition=(\d+) ", log)
    return {int(p): action for action, p in found}


def store_applied(state_dir: Path, app: str, partition: int, engine: str = "sqlite") -> int:
    """Entries whose effects one partition's store holds (the crash app counts them)."""
    return sum(v["count"] for v in read_store(state_dir, app, partition, engine)[1].values())


def backup_applied_in(client: Any, topic: str, app: str, partition: int) -> int:
    return sum(v["count"] for v in backup_state(client, topic, app, partition).values())


def pending_ids(client: Any, topic: str, app: str, partitions: int) -> dict[int, dict[bytes, bytes]]:
    """Per partition: every pending entry id and the consumer that holds it."""
    return {
        p: {
            row["message_id"]: row["consumer"]
            for row in client.xpending_range(stream_key(topic, p), app, "-", "+", 1_000_000)
        }
        for p in range(partitions)
    }


# -- the partitions move to and fro under SIGKILL, then to an empty third dir ---------------------


def test_partitions_move_between_state_dirs_under_kill9_and_the_state_stays_exact(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, KEYS, seed=21)
    produce(topic, records)
    hosts = Hosts(spawn, redis_url, topic, app)
    dirs = [tmp_path / "host-a", tmp_path / "host-b"]
    last = 0
    rng = random.Random(21)
    for kill in range(KILLS):
        state_dir = dirs[kill % 2]  # each restart on the other host
        worker = hosts.run(f"w{kill}", state_dir, env={"PSPF_TEST_WORK_US": "100"})
        # Targets spread over the stream, so that delays do not add up past its end.
        target = max(last + 500, (kill + 1) * ENTRIES // (KILLS + 2))

        def progressed(target: int = target) -> bool:
            return backup_applied(rclient, topic, app, PARTITIONS) >= target

        wait_until(progressed, 60, f"progress past {target}", interval=0.05)
        time.sleep(rng.uniform(0, 0.2))  # the kill lands anywhere in a batch, not just after an ack
        assert worker.kill9() == -9
        last = backup_applied(rclient, topic, app, PARTITIONS)
        log = worker.log.read_text()
        assert "Traceback" not in log, worker.tail()
        repaired = repaired_partitions(log, app)
        if kill:  # every store it met was missing (the first time on host b), behind or ahead
            assert repaired, f"worker {kill} repaired no store from the backup\n{worker.tail()}"
        print(f"kill {kill} on {state_dir.name}: {last} in the backup, {repaired}")
    assert last < ENTRIES, "the workers finished before the last kill"

    final_dir = tmp_path / "host-c"
    final = hosts.run("final", final_dir, "--until-idle")
    assert final.wait(120) == 0, final.tail()
    # The empty dir is rebuilt from the backups, then applies exactly what they lack.
    assert sorted(restored_partitions(final.log.read_text(), app)) == list(range(PARTITIONS)), final.tail()
    assert final.summary() == (ENTRIES - last, 0, 0)
    assert_exact(rclient, final_dir, topic, app, PARTITIONS, records)
    assert_backup_exact(rclient, topic, app, PARTITIONS, records)

    # Any machine reads the state from the backup: no state dir named, none where it runs.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    want = {key: {"count": count, "total": total} for key, (count, total) in expected_state(records).items()}
    assert len(want) == KEYS
    assert state_get_from_backup(redis_url, app, sorted(want), elsewhere) == want
    for key in sorted(want)[:2]:  # and from a process of its own
        got = subprocess.run(
            pspf_command("state", "get", app, key, "--json", "--broker", redis_url),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=elsewhere,
            env=subprocess_env(),
        )
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == want[key]
    assert not any(elsewhere.iterdir()), "state get wrote a state dir"
    print(f"{KILLS} kills, {ENTRIES} entries: {time.monotonic() - started:.1f}s")


# -- a stale store comes back ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("gap", "action"), [("within the log", "caught up"), ("past the log", "restored")], ids=["log", "full"]
)
def test_a_stale_store_coming_back_is_repaired_from_the_backup_before_anything_is_applied(
    engine: str,
    gap: str,
    action: str,
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Host a stops cleanly, host b moves the partitions on, host a comes back with its old store.

    A few updates behind, the store catches up from the backup's log; more updates behind than
    the log keeps (host b acknowledges entry by entry), it is restored whole. Either way before
    any entry is applied, and only the entries after host b's run are applied.
    """
    started = time.monotonic()
    partitions = 2
    topic, app = make_topic(partitions), names.app()
    hosts = Hosts(spawn, redis_url, topic, app)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    moved_on = 4_000 if gap == "past the log" else 3_000
    first, second, third = (
        order_records(n, 200, seed=s) for n, s in ((3_000, 31), (moved_on, 32), (2_000, 33))
    )

    produce(topic, first)
    a = hosts.run("a-1", host_a, "--until-idle", "--store", engine)
    assert a.wait(60) == 0, a.tail()
    assert a.summary() == (3_000, 0, 0)
    # Stopped cleanly: each store and its backup carry the same identity.
    a_identity = {p: store_identity(host_a, app, p, engine) for p in range(partitions)}
    assert all(a_identity.values())
    assert a_identity == {p: backup_identity(rclient, topic, app, p) for p in range(partitions)}
    a_applied = {p: backup_applied_in(rclient, topic, app, p) for p in range(partitions)}

    produce(topic, second)
    batch = ["--batch-size", "1"] if gap == "past the log" else []
    b = hosts.run("b", host_b, "--until-idle", "--store", engine, *batch)
    assert b.wait(120) == 0, b.tail()
    assert sorted(restored_partitions(b.log.read_text(), app)) == list(range(partitions)), b.tail()
    assert b.summary() == (moved_on, 0, 0)
    # Host a's stores are behind now: their identities are ones the backup has moved past.
    for p in range(partitions):
        assert store_identity(host_a, app, p, engine) == a_identity[p]
        assert backup_identity(rclient, topic, app, p) not in (None, a_identity[p])
        assert store_applied(host_a, app, p, engine) == a_applied[p]
        if gap == "past the log":  # more updates than the log keeps: where host a stood is gone
            updates = backup_applied_in(rclient, topic, app, p) - a_applied[p]
            kept = rclient.xlen(backup_keys(topic, p, app).log)
            assert kept < updates, f"partition {p}: the log kept {kept} of {updates} updates"

    produce(topic, third)
    again = hosts.run("a-2", host_a, "--until-idle", "--store", engine)
    assert again.wait(60) == 0, again.tail()
    log = again.log.read_text()
    assert repaired_partitions(log, app) == dict.fromkeys(range(partitions), action), again.tail()
    lines = log.splitlines()
    for p in range(partitions):
        repaired = [
            i for i, line in enumerate(lines) if f"state backup {action} app={app} partition={p} " in line
        ]
        assigned = [
            i for i, line in enumerate(lines) if f"partition assigned app={app} partition={p} " in line
        ]
        assert len(repaired) == 1 and len(assigned) == 1, again.tail()
        assert repaired[0] < assigned[0], f"partition {p} was assigned before its store was repaired"
    # Only the new entries ran: nothing of host b's part twice, nothing skipped as done.
    assert again.summary() == (2_000, 0, 0)
    records = [*first, *second, *third]
    assert_exact(rclient, host_a, topic, app, partitions, records, engine)
    assert_backup_exact(rclient, topic, app, partitions, records)
    assert {p: store_identity(host_a, app, p, engine) for p in range(partitions)} == {
        p: backup_identity(rclient, topic, app, p) for p in range(partitions)
    }
    print(f"stale store ({engine}, {gap}): {time.monotonic() - started:.1f}s")


# -- a zombie owner: stopped mid-batch past its lease, resumed while another owner works ----------


def test_a_zombie_owner_resumed_mid_batch_neither_acknowledges_nor_touches_the_backup(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    partitions, entries = 2, 4_000
    topic, app = make_topic(partitions), names.app()
    records = order_records(entries, 100, seed=51)
    produce(topic, records)
    hosts = Hosts(spawn, redis_url, topic, app)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    stop_a, stop_b = tmp_path / "a.stopped", tmp_path / "b.stopped"

    # Host a stops itself in the handler of its 1,500th entry: the batch in hand is half done.
    a = hosts.run(
        "a",
        host_a,
        "--batch-size",
        "50",
        env={"PSPF_TEST_CRASH": "stop:1500", "PSPF_TEST_MARKER": str(stop_a), "PSPF_TEST_WORK_US": "200"},
    )
    wait_until(lambda: stop_a.exists() and process_state(a.pid) == "T", 60, "host a to stop itself")
    zombie = json.loads(stop_a.read_text())
    zombie_partition, zombie_id = zombie["partition"], zombie["id"].encode()
    wait_until(lambda: no_leases(rclient, topic, app, partitions), 10, "host a's leases to expire")
    in_backup = backup_applied(rclient, topic, app, partitions)
    assert 0 < in_backup < 1_500

    # Host b takes over (its leases live 30 s: it keeps them while stopped) and stops in the
    # handler of its first entry, so every entry host a had in hand is pending at host b when
    # host a wakes up.
    b = hosts.run(
        "b",
        host_b,
        "--until-idle",
        "--lease-ttl-ms",
        "30000",
        env={"PSPF_TEST_CRASH": "stop:1", "PSPF_TEST_MARKER": str(stop_b)},
    )
    wait_until(lambda: stop_b.exists() and process_state(b.pid) == "T", 60, "host b to stop itself")
    assert held_by(rclient, topic, app, partitions, b.pid)
    assert sorted(restored_partitions(b.log.read_text(), app)) == list(range(partitions)), b.tail()
    pending = pending_ids(rclient, topic, app, partitions)
    assert zombie_id in pending[zombie_partition], "host a's batch in hand is not pending"
    b_consumer = {lease.consumer for lease in leases(rclient, topic, app, partitions).values() if lease}
    assert {c.decode() for ids in pending.values() for c in ids.values()} == b_consumer, pending
    backup_before = backup_raw(rclient, topic, app, partitions)
    a_before = store_applied(host_a, app, zombie_partition)

    # The zombie wakes up: it finishes its batch, may commit it locally, but its acknowledging
    # call is refused, so it neither acknowledges nor changes the backup, and gives up.
    os.kill(a.pid, signal.SIGCONT)
    wait_until(lambda: "lease lost, giving the partition up" in a.log.read_text(), 30, "host a's refused ack")
    zombie_stream = stream_key(topic, zombie_partition)
    wait_until(
        lambda: f"partition released app={app} partition={zombie_partition}" in a.log.read_text(),
        10,
        "host a to give the partition up",
    )
    log = a.log.read_text()
    lost = re.findall(r"lease lost, giving the partition up stream=(\S+): (.*)", log)
    assert zombie_stream in {stream for stream, _ in lost}, a.tail()
    assert all("LEASE_LOST" in reason for _, reason in lost), a.tail()
    time.sleep(1.5)  # several of host a's lease rounds (every 1/3 s): it must not take anything back
    log = a.log.read_text()
    assert log.count("partition assigned") == partitions, a.tail()
    assert pending_ids(rclient, topic, app, partitions) == pending, "the zombie acknowledged entries"
    assert backup_raw(rclient, topic, app, partitions) == backup_before, "the zombie changed the backup"
    assert held_by(rclient, topic, app, partitions, b.pid)
    a_after = store_applied(host_a, app, zombie_partition)
    assert store_identity(host_a, app, zombie_partition) != backup_identity(
        rclient, topic, app, zombie_partition
    )
    print(f"zombie store partition {zombie_partition}: {a_before} applied before waking, {a_after} after")
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.tail()

    # Host b goes on and finishes: the backup holds every entry once, never more.
    os.kill(b.pid, signal.SIGCONT)
    assert b.wait(120) == 0, b.tail()
    assert b.summary() == (entries - in_backup, 0, 0)
    assert backup_applied(rclient, topic, app, partitions) == entries
    assert_backup_exact(rclient, topic, app, partitions, records)
    assert_exact(rclient, host_b, topic, app, partitions, records)

    # Host a comes back on its own dir: its zombie store is repaired at takeover.
    again = hosts.run("a-again", host_a, "--until-idle")
    assert again.wait(60) == 0, again.tail()
    # The zombie's store holds a transaction of a history the backup never had: restored whole.
    repaired = repaired_partitions(again.log.read_text(), app)
    assert repaired.keys() == set(range(partitions)), again.tail()
    assert repaired[zombie_partition] == "restored", again.tail()
    assert again.summary() == (0, 0, 0)
    assert_exact(rclient, host_a, topic, app, partitions, records)
    assert_exact(rclient, host_b, topic, app, partitions, records)
    assert_backup_exact(rclient, topic, app, partitions, records)
    print(f"zombie: {time.monotonic() - started:.1f}s")


# -- a crash between the local commit and the acknowledging call, on two hosts in turn ------------


@pytest.mark.parametrize("where", ["commit", "ack"])
def test_a_crash_between_the_local_commit_and_the_acknowledging_call_on_two_hosts(
    where: str,
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    partitions, entries = 2, 4_000
    topic, app = make_topic(partitions), names.app()
    records = order_records(entries, 100, seed=61)
    produce(topic, records)
    hosts = Hosts(spawn, redis_url, topic, app)
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    ahead_on: dict[str, dict[int, int]] = {}
    for label, state_dir, nth in (("a", host_a, 12), ("b", host_b, 9)):
        marker = tmp_path / f"{label}.crashed"
        worker = hosts.run(
            label,
            state_dir,
            "--batch-size",
            "50",
            env={
                "PSPF_TEST_CRASH": f"{where}:{nth}",
                "PSPF_TEST_MARKER": str(marker),
                "PSPF_TEST_WORK_US": "100",
            },
        )
        assert worker.wait(60) == -9, worker.tail()
        report = json.loads(marker.read_text())
        assert report["where"] == where
        # Host a starts with every lease free; host b may take a partition a round later (its
        # lease expires a little after the other) and crash before. Each store it met was empty.
        log = worker.log.read_text()
        assigned = {
            int(p) for p in re.findall(rf"partition assigned app={re.escape(app)} partition=(\d+) ", log)
        }
        assert assigned, worker.tail()
        if label == "a":
            assert assigned == set(range(partitions)), worker.tail()
        else:
            assert restored_partitions(log, app).keys() == assigned, worker.tail()
        # Each store is ahead of its backup by exactly what was committed and not acknowledged.
        ahead = {
            p: store_applied(state_dir, app, p) - backup_applied_in(rclient, topic, app, p) for p in assigned
        }
        if where == "commit":
            assert ahead[report["partition"]] == report["applied"] > 0, (ahead, report)
            assert all(n >= 0 for n in ahead.values()), ahead
        else:
            unacked = report["unacked"]
            assert ahead == {p: unacked.get(stream_key(topic, p), 0) for p in assigned}, (
                ahead,
                report,
            )
            assert sum(ahead.values()) > 0
        for p, n in ahead.items():
            if n:
                assert store_identity(state_dir, app, p) != backup_identity(rclient, topic, app, p)
                pending = rclient.xpending(stream_key(topic, p), app)["pending"]
                assert pending >= n, f"partition {p}: {n} committed entries not pending ({pending})"
        print(f"{where} crash on host {label}: ahead of the backup by {ahead}")
        ahead_on[label] = ahead

    in_backup = backup_applied(rclient, topic, app, partitions)
    final = hosts.run("a-final", host_a, "--until-idle")
    assert final.wait(60) == 0, final.tail()
    # Host a's stores are behind host b's work, and where its batch was not acknowledged ahead
    # of the backup in a history of their own: those are restored whole.
    repaired = repaired_partitions(final.log.read_text(), app)
    assert repaired.keys() == set(range(partitions)), final.tail()
    for p, n in ahead_on["a"].items():
        if n:
            assert repaired[p] == "restored", final.tail()
    assert final.summary() == (entries - in_backup, 0, 0)
    assert_exact(rclient, host_a, topic, app, partitions, records)
    assert_backup_exact(rclient, topic, app, partitions, records)
    print(f"{where} crashes on two hosts: {time.monotonic() - started:.1f}s")


def test_with_the_backup_off_a_missing_store_is_refused_and_nothing_is_acknowledged(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    produce(topic, order_records(1_000, 50, seed=22))
    options = ["--broker", redis_url, "--block-ms", "100", "--state-backup", "off", "--until-idle"]
    first = spawn("first", topic, app, *options, "--state-dir", str(tmp_path / "a"), cli_settings=False)
    assert first.wait(60) == 0, first.tail()
    produce(topic, order_records(500, 50, seed=23))
    before = acknowledged(rclient, topic, app, 2)

    other = spawn("other", topic, app, *options, "--state-dir", str(tmp_path / "b"), cli_settings=False)
    assert other.wait(60) == 5, other.tail()
    log = other.log.read_text()
    assert "is behind its consumer group" in log and "none (no state)" in log, other.tail()
    assert "Traceback" not in log
    assert acknowledged(rclient, topic, app, 2) == before == 1_000
