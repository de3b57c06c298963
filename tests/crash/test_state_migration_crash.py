"""A state migration under SIGKILL on two state dirs: every key's state migrated once, exact (DESIGN).

Real ``pspf run`` workers of ``tests.crash.apps_migration``: v1 of an order-totals app sums each
key's amounts; v2, the same app with a new state type, counts cents and orders and migrates a v1
total by x100 (``@app.migrate_state``), a function that must run on a key's old state exactly once
in effect: a key migrated twice shows x10000, a migrated state lost shows the v1 total again. A key
is migrated when it is read and stored migrated with its batch; a kill before the commit leaves the
old state, to be migrated again from the same old value, on the same dir or through the backup on
another one. Keys no v2 entry touches stay as v1 wrote them.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import keys
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.apps_migration import TotalsV1, TotalsV2, v2
from tests.crash.conftest import Spawner
from tests.crash.support import Records, WorkerProcess, backup_hash, backup_state, leases, no_leases
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

MODULE = "tests.crash.apps_migration"
#: Leases expire a second after a killed worker's last renewal: the next owner waits no longer.
OPTIONS = ["--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "1000"]

State = dict[str, dict[str, Any]]


class Versions:
    """One test's topic and app, and workers of its versions on "hosts" (a state dir each)."""

    def __init__(self, spawn: Spawner, names: Names, topic: str, rclient: redis.Redis) -> None:
        self.spawn, self.topic, self.rclient = spawn, topic, rclient
        self.app = names.app()

    def run(
        self, label: str, version: str, state_dir: Path, *args: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        return self.spawn(
            label,
            self.topic,
            self.app,
            "--broker",
            self.spawn.redis_url,
            "--state-dir",
            str(state_dir),
            *OPTIONS,
            *args,
            env=env,
            cli_settings=False,
            target=f"{MODULE}:{version}",
        )

    def exported(self, cwd: Path, *args: str) -> State:
        """Each key's state as ``pspf state export`` writes it (from the backups unless ``args`` say)."""
        run = subprocess.run(
            pspf_command("state", "export", self.app, "--broker", self.spawn.redis_url, *args),
            capture_output=True,
            timeout=60,
            cwd=cwd,
            env=subprocess_env(),
        )
        assert run.returncode == 0, run.stderr.decode(errors="replace")
        found: State = {}
        for line in run.stdout.splitlines():
            row = json.loads(line)
            if row["kind"] == "value" and row["namespace"] == keys.STATE_NAMESPACE:
                assert row["key"] not in found, f"key {row['key']} exported twice"
                found[row["key"]] = row["state"]
        return found

    def backups(self, partitions: int) -> State:
        """Every key's state as the backups in Redis hold it, shown without a state type."""
        found: State = {}
        for p in range(partitions):
            found |= backup_state(self.rclient, self.topic, self.app, p)
        return found

    def backup_raw(self, partitions: int, key: str) -> bytes:
        """The stored bytes of ``key``'s state in whichever partition's backup holds it."""
        name = f"{keys.STATE_NAMESPACE}\x00{key}".encode()
        for p in range(partitions):
            raw = backup_hash(self.rclient, self.topic, p, self.app).get(name)
            if raw is not None:
                return raw
        raise AssertionError(f"no backup holds the state of key {key}")


def orders(rng: random.Random, n: int, keys_from: int, keys_to: int) -> Records:
    return [(f"k{rng.randrange(keys_from, keys_to)}", {"amount": rng.randrange(1, 1000)}) for _ in range(n)]


def sums(records: Records) -> dict[str, tuple[int, int]]:
    """Per key (entries, sum of amounts)."""
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, value in records:
        assert key is not None
        found[key][0] += 1
        found[key][1] += value["amount"]
    return {key: (n, total) for key, (n, total) in found.items()}


def v1_state(phase1: Records) -> State:
    return {key: {"t": {"total": total}} for key, (_, total) in sums(phase1).items()}


def v2_state(phase1: Records, phase2: Records) -> State:
    """Every key's state after both phases: a key no v2 entry reads keeps its v1 state."""
    before, after = sums(phase1), sums(phase2)
    want = v1_state(phase1)
    for key, (n, total) in after.items():
        want[key] = {"t": {"total_cents": 100 * (before.get(key, (0, 0))[1] + total), "orders": n}}
    return want


def differing(got: State, want: State) -> dict[str, tuple[Any, Any]]:
    """Key -> (got, want) where the state differs (None: absent)."""
    return {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys() if got.get(k) != want.get(k)}


def assert_state(got: State, want: State, where: str) -> None:
    wrong = differing(got, want)
    assert not wrong, (
        f"{where}: the state of {len(wrong)} of {len(want)} keys differs (got, want): "
        f"{dict(sorted(wrong.items())[:5])}"
    )


def repairs(log: str, app: str) -> int:
    """Stores a worker made equal to the backup (restored whole or caught up from its log)."""
    return len(re.findall(rf"state backup (?:restored|caught up) app={re.escape(app)} ", log))


def assert_refused(worker: WorkerProcess) -> None:
    """The worker exits 2 with one line that says to declare a migration."""
    assert worker.wait(60) == 2, worker.tail()
    log = worker.log.read_text()
    assert "Traceback" not in log, worker.tail()
    errors = [line for line in log.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and log.rstrip().endswith(errors[0]), worker.tail()
    assert "cannot read the state its stores hold" in errors[0], errors[0]
    assert "@app.migrate_state(OldType)" in errors[0], errors[0]
    assert "total_cents" in errors[0], errors[0]


# -- without the migration, v2 is refused at start -------------------------------------------------


def test_the_new_state_type_without_a_migration_is_refused_at_start_and_handles_nothing(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """A v2 worker without ``migrate_state`` over v1 state would fail every old key at its first
    entry: it must stop at start, in one line, before taking any entry; with the migration the same
    entries are then handled once each."""
    partitions = 2
    versions = Versions(spawn, names, make_topic(partitions), rclient)
    rng = random.Random(5)
    phase1, phase2 = orders(rng, 300, 0, 20), orders(rng, 100, 0, 30)
    state_dir = tmp_path / "host-a"
    produce(versions.topic, phase1)
    first = versions.run("v1", "v1", state_dir, "--until-idle")
    assert first.wait(60) == 0, first.tail()
    assert first.summary() == (len(phase1), 0, 0), first.tail()

    produce(versions.topic, phase2)
    assert_refused(versions.run("v2-unmigrated", "v2_unmigrated", state_dir, "--until-idle"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert_state(versions.exported(elsewhere), v1_state(phase1), "after the refusal")
    assert no_leases(rclient, versions.topic, versions.app, partitions), "the refused worker took leases"

    second = versions.run("v2", "v2", state_dir, "--until-idle")
    assert second.wait(60) == 0, second.tail()
    assert second.summary() == (len(phase2), 0, 0), second.tail()
    want = v2_state(phase1, phase2)
    assert_state(versions.exported(elsewhere), want, "the backups")
    assert_state(versions.exported(elsewhere, "--state-dir", str(state_dir)), want, "the stores")


# -- the migration under kill -9 on two state dirs, while entries are produced ----------------------

PARTITIONS = 4
KEYS = 200
#: v1 entries go to k0..k159, v2 entries to k40..k199: k0..k39 are never migrated, k160..k199 are
#: new in v2, the rest are migrated by their first v2 entry.
V1_KEYS, V2_FROM = 160, 40
V1_ENTRIES = 4_000
V2_ENTRIES = 8_000
KILLS = 8
#: Busy work per entry, so that the entries between two kills outlast the wait before a kill.
WORK_US = 400
#: The producer stays at most this many entries ahead of the backups, so it writes until the end.
LEAD = 1_200
CHUNK = 200


def growing_orders(rng: random.Random, n: int, names: list[str]) -> Records:
    """``n`` orders over ``names`` let in one by one: the i-th order is the first of the key let in
    at ``i``, if any, else picks among those let in before. A key's first order (where a v1 key is
    migrated) comes anywhere in the stream, not only near its start, and every key has one."""
    found: Records = []
    for i in range(n):
        let_in = 1 + i * len(names) // n
        first = i == 0 or let_in > 1 + (i - 1) * len(names) // n
        key = names[let_in - 1] if first else names[rng.randrange(let_in)]
        found.append((key, {"amount": rng.randrange(1, 1000)}))
    return found


def v2_applied(backups: State) -> int:
    """v2 entries the backups hold (v2 counts them per key)."""
    return sum(value["t"].get("orders", 0) for value in backups.values())


class Writer(threading.Thread):
    """Writes the v2 entries by chunks, at most ``LEAD`` ahead of the backups: it writes until near
    the end, while the workers are killed."""

    def __init__(self, produce: Callable[..., int], versions: Versions, records: Records) -> None:
        super().__init__(daemon=True)
        self.send, self.versions, self.records = produce, versions, records
        self.produced = 0
        self.failed: list[BaseException] = []

    def run(self) -> None:
        try:
            while self.produced < len(self.records):
                if self.produced - v2_applied(self.versions.backups(PARTITIONS)) >= LEAD:
                    time.sleep(0.02)
                    continue
                chunk = self.records[self.produced : self.produced + CHUNK]
                self.produced += self.send(self.versions.topic, chunk)
        except BaseException as exc:
            self.failed.append(exc)


def run_v1(
    versions: Versions, dirs: list[Path], produce: Callable[..., int], phase1: Records, elsewhere: Path
) -> None:
    """v1 on both dirs until the backups hold every v1 entry, then a graceful stop: each dir holds
    stores of v1 state (the entries are written once both workers hold partitions)."""
    first = [versions.run(f"v1-{i}", "v1", d, env={"PSPF_TEST_WORK_US": "100"}) for i, d in enumerate(dirs)]

    def shared() -> bool:
        held = leases(versions.rclient, versions.topic, versions.app, PARTITIONS).values()
        return {lease.pid for lease in held if lease is not None} == {w.pid for w in first}

    wait_until(shared, 30, "both v1 workers to hold partitions", 0.05)
    produce(versions.topic, phase1)
    want = v1_state(phase1)
    wait_until(lambda: versions.backups(PARTITIONS) == want, 120, "the v1 entries in the backups", 0.1)
    for worker in first:
        worker.proc.terminate()
        assert worker.wait(10) == 0, worker.tail()
    assert_state(versions.exported(elsewhere), want, "v1, the backups")
    held = [len(list(d.glob(f"{versions.app}/p*.sqlite"))) for d in dirs]
    assert all(held), f"v1 left stores on one dir only: {held}"


def kill_while_migrating(
    versions: Versions, dirs: list[Path], writer: Writer, to_migrate: set[str], rng: random.Random
) -> tuple[list[WorkerProcess], dict[str, int]]:
    """Two v2 workers, one per dir, killed ``KILLS`` times as the backups pass goals spread over
    the v2 entries: one (restarted on its dir) or both (restarted on each other's dir). Returns the
    workers running at the end and counts of where the kills landed."""
    env = {"PSPF_TEST_WORK_US": str(WORK_US)}
    on = [0, 1]  # the dir each worker runs on
    workers = [versions.run(f"v2-{i}-start", "v2", dirs[i], env=env) for i in range(2)]
    writer.start()
    landed = {"while producing": 0, "while migrating": 0, "mid-stream": 0, "swaps": 0}
    for kill in range(KILLS):
        goal = (kill + 1) * V2_ENTRIES // (KILLS + 1)

        def reached(goal: int = goal) -> bool:
            return bool(writer.failed) or v2_applied(versions.backups(PARTITIONS)) >= goal

        wait_until(reached, 90, f"{goal} v2 entries in the backups")
        assert not writer.failed, writer.failed
        time.sleep(rng.uniform(0.0, 0.15))  # anywhere in a batch, not just after a commit
        swap = kill % 3 == 2
        victims = [0, 1] if swap else [rng.randrange(2)]
        landed["while producing"] += writer.is_alive()
        for i in victims:
            assert workers[i].alive(), f"worker exited by itself\n{workers[i].tail()}"
            assert workers[i].kill9() == -9
            assert "Traceback" not in workers[i].log.read_text(), workers[i].tail()
        backups = versions.backups(PARTITIONS)
        landed["mid-stream"] += v2_applied(backups) < V2_ENTRIES
        migrated = sum(1 for key in to_migrate if "total_cents" in backups[key]["t"])
        landed["while migrating"] += 0 < migrated < len(to_migrate)
        if swap:
            on.reverse()
            landed["swaps"] += 1
        for i in victims:
            workers[i] = versions.run(f"v2-{i}-{kill}", "v2", dirs[on[i]], env=env)
    return workers, landed


def assert_read_migrated(versions: Versions, untouched: list[str], want: State) -> None:
    """The keys no v2 entry read still hold v1 bytes, which v2's decoder reads migrated once."""
    decoder = v2().state_decoder
    as_v1 = msgspec.msgpack.Decoder(dict[str, TotalsV1])
    for key in untouched:
        raw = versions.backup_raw(PARTITIONS, key)
        total = want[key]["t"]["total"]
        assert as_v1.decode(raw) == {"t": TotalsV1(total=total)}, key
        assert decoder.decode(key, raw) == {"t": TotalsV2(total_cents=100 * total, orders=0)}, key


def test_a_state_migration_under_random_kill9_on_two_state_dirs_migrates_every_key_once(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """v1 runs on two state dirs over the v1 entries; v2 then runs as two workers on the two dirs,
    killed at random moments while a producer writes the v2 entries and v1 keys are being
    migrated; one worker then runs until idle.

    Every key's state, in the backups and in the final dir's stores, is its v1 total migrated once
    plus each v2 entry applied once; a key no v2 entry read is still v1 and reads as migrated.
    """
    started = time.monotonic()
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    versions = Versions(spawn, names, make_topic(PARTITIONS), rclient)
    phase1 = orders(rng, V1_ENTRIES, 0, V1_KEYS)
    let_in = [f"k{i}" for i in range(V2_FROM, KEYS)]
    rng.shuffle(let_in)  # migrated and new keys come in mixed
    phase2 = growing_orders(rng, V2_ENTRIES, let_in)
    want = v2_state(phase1, phase2)
    untouched = sorted(key for key, value in want.items() if "total" in value["t"])
    to_migrate = set(sums(phase1)) & set(sums(phase2))
    fresh = set(sums(phase2)) - set(sums(phase1))
    assert len(want) == KEYS and untouched and to_migrate and fresh, (len(untouched), len(fresh))
    dirs = [tmp_path / "host-a", tmp_path / "host-b"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    run_v1(versions, dirs, produce, phase1, elsewhere)

    writer = Writer(produce, versions, phase2)
    workers, landed = kill_while_migrating(versions, dirs, writer, to_migrate, rng)
    writer.join(120)
    assert not writer.is_alive() and not writer.failed, writer.failed
    assert writer.produced == V2_ENTRIES
    assert landed["while producing"] >= KILLS // 2, landed
    assert landed["mid-stream"] >= KILLS - 1 and landed["while migrating"] >= KILLS - 1, landed
    for worker in workers:  # the last kill, of both
        assert worker.kill9() == -9
    left = V2_ENTRIES - v2_applied(versions.backups(PARTITIONS))
    logs = "".join(w.log.read_text() for w in spawn.workers if w.log.stem.startswith("v2-"))
    repaired = repairs(logs, versions.app)
    assert repaired > 0, "no store was repaired from a backup: the state never moved between dirs"

    # --until-idle stops early while a dead worker's lease lives: let the leases expire first.
    wait_until(
        lambda: no_leases(rclient, versions.topic, versions.app, PARTITIONS), 10, "the leases to expire"
    )
    final_dir = dirs[rng.randrange(2)]
    final = versions.run("final", "v2", final_dir, "--until-idle")
    assert final.wait(120) == 0, final.tail()
    assert final.summary()[2] == 0, final.tail()

    # Every key exact, from the backups and from the final dir's stores.
    assert_state(versions.exported(elsewhere), want, "the backups")
    assert_state(versions.exported(elsewhere, "--state-dir", str(final_dir)), want, "the final stores")
    monkeypatch.setenv("PSPF_TEST_APP", versions.app)
    monkeypatch.setenv("PSPF_TEST_TOPIC", versions.topic)
    assert_read_migrated(versions, untouched, want)

    # Their old state is still stored: a v2 without the migration is still refused, and changes nothing.
    assert_refused(versions.run("v2-unmigrated", "v2_unmigrated", final_dir, "--until-idle"))
    assert_state(versions.exported(elsewhere), want, "the backups after the refusal")
    print(
        f"{KILLS} kills {landed}, {repaired} stores repaired, {left} entries left at the end, "
        f"{V1_ENTRIES}+{V2_ENTRIES} entries, {len(to_migrate)} keys migrated, {len(untouched)} not, "
        f"{len(fresh)} new: {time.monotonic() - started:.1f}s"
    )
