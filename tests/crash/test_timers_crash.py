"""Timers and scheduled callbacks under SIGKILL, with real ``pspf run`` workers
(``tests.crash.apps_timers``) moving between hosts (state dirs of their own).

- A timer that ticks every 100 ms: its periods run once each, with their state writes and
  emits, while the partitions move from a worker killed with SIGKILL to another host, whose
  clock is behind, and on to a third. No period runs twice, none is skipped while a host owns
  the partition, and there is one emitted entry per period the state holds, no other.
- ``ctx.schedule`` callbacks run once each while a worker is killed at random moments, over and
  over, each restart on the other host: the state and the emitted reminders are exactly those of
  the reference (``tests.reminders.simulate``).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import signal
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import codec
from pspf.keys import SCHEDULES_NAMESPACE, stream_key
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.crash.apps_timers import TICK_MS, tick_keys
from tests.crash.conftest import Spawner
from tests.crash.support import WorkerProcess, backup_state, held_by, read_store
from tests.reminders import Entries, simulate
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TICKING = "tests.crash.apps_timers:ticking"
REMINDERS = "tests.crash.apps_timers:reminders"
#: Leases of a killed worker expire a second after its last renewal: the next host waits no longer.
OPTIONS = ["--block-ms", "100", "--lease-ttl-ms", "1000"]


def run(
    spawn: Spawner,
    label: str,
    target: str,
    topic: str,
    app: str,
    state_dir: Path,
    *args: str,
    env: dict[str, str],
) -> WorkerProcess:
    options = ["--broker", spawn.redis_url, "--state-dir", str(state_dir), *OPTIONS, *args]
    return spawn(label, topic, app, *options, env=env, cli_settings=False, target=target)


def restored(log: str, app: str) -> list[int]:
    """The partitions a worker's store was rebuilt for from the whole backup, from its log."""
    found = re.findall(rf"state backup restored app={re.escape(app)} partition=(\d+) ", log)
    return sorted(int(p) for p in found)


def emitted(client: Any, topic: str) -> list[dict[str, Any]]:
    """The values of every entry of a one-partition topic, in stream order."""
    return [json.loads(fields[codec.VALUE]) for _, fields in client.xrange(stream_key(topic, 0))]


# -- a timer across SIGKILL and takeovers by other hosts --------------------------------------------

TIMER_PARTITIONS = 2
#: The hosts the partitions move to, in turn, and how far their clocks are off (ms). Each clock is
#: behind the one before by more than a takeover takes: a host that did not know which periods
#: ran would run them again.
HOSTS = [("a", 0), ("b", -4000), ("c", -8000)]
#: Periods each host runs (in every partition) before it is killed, or stopped (the last).
TICKS_PER_HOST = 8


class Ticking:
    """The ticking app of one test, its hosts, and what its state and backup say."""

    def __init__(
        self, spawn: Spawner, tmp_path: Path, make_topic: Callable[[int], str], names: Names
    ) -> None:
        self.spawn, self.tmp_path = spawn, tmp_path
        self.source, self.target = make_topic(TIMER_PARTITIONS), make_topic(1)
        self.app = names.app()
        self.keys = tick_keys(TIMER_PARTITIONS)
        self.env = {"PSPF_TEST_TARGET": self.target, "PSPF_TEST_PARTITIONS": str(TIMER_PARTITIONS)}

    def dir(self, host: str) -> Path:
        return self.tmp_path / f"host-{host}"

    def start(self, host: str, *args: str, **env: str) -> WorkerProcess:
        return run(
            self.spawn, host, TICKING, self.source, self.app, self.dir(host), *args, env={**self.env, **env}
        )

    def backup_ticks(self, client: Any) -> dict[int, list[int]]:
        """Per partition, the periods run as the state backup holds them (what a new host restores)."""
        return {
            p: backup_state(client, self.source, self.app, p).get(self.keys[p][0], {}).get("at", [])
            for p in range(TIMER_PARTITIONS)
        }

    def store_ticks(self, host: str) -> dict[int, tuple[list[int], int]]:
        """Per partition, the periods run and their count as a host's own store holds them."""
        found = {}
        for p in range(TIMER_PARTITIONS):
            state = read_store(self.dir(host), self.app, p)[1]
            listed, counted = self.keys[p]
            found[p] = (state.get(listed, {}).get("at", []), state.get(counted, {}).get("n", 0))
        return found

    def owns_all(self, client: Any, worker: WorkerProcess, restoring: bool) -> bool:
        """The worker holds every lease, and (``restoring``) rebuilt every store from the backup."""
        return held_by(client, self.source, self.app, TIMER_PARTITIONS, worker.pid) and (
            not restoring or restored(worker.log.read_text(), self.app) == list(range(TIMER_PARTITIONS))
        )


def check_ticks(p: int, ticks: list[int], counted: int, at_kill: list[dict[int, list[int]]]) -> None:
    """One partition's periods: each once, in order; counted; each host's run without a gap."""
    twice = sorted(t for t, n in Counter(ticks).items() if n > 1)
    assert not twice, f"partition {p}: periods run twice: {twice}"
    assert ticks == sorted(ticks), f"partition {p}: periods out of order: {ticks}"
    assert all(t % TICK_MS == 0 for t in ticks)
    assert counted == len(ticks), f"partition {p}: counted {counted}, {len(ticks)} periods"
    bounds = [0, *(len(ticks_at_kill[p]) for ticks_at_kill in at_kill), len(ticks)]
    for host, (low, high) in enumerate(itertools.pairwise(bounds)):
        mine = ticks[low:high]
        # Each host: the periods it ran before its kill (the backup's), then the next host's.
        assert len(mine) >= TICKS_PER_HOST, f"partition {p}: host {HOSTS[host][0]} ran {len(mine)} periods"
        # Every period while it owned the partition ran, however long a cycle took.
        gaps = [(a, b) for a, b in itertools.pairwise(mine) if b - a != TICK_MS]
        assert not gaps, f"partition {p}: host {HOSTS[host][0]} skipped periods: {gaps}"
        if low:  # its clock was behind: it waited for the period after the last the backup held
            assert mine[0] == ticks[low - 1] + TICK_MS, (p, HOSTS[host][0], ticks[low - 1], mine[0])


def test_a_timer_runs_each_period_once_across_sigkill_and_takeovers_by_hosts_with_clocks_behind(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    ticking = Ticking(spawn, tmp_path, make_topic, names)
    rng = random.Random()
    at_kill: list[dict[int, list[int]]] = []  # the backup's ticks as each killed host left them
    for host, skew_ms in HOSTS:
        worker = ticking.start(host, PSPF_TEST_CLOCK_SKEW_MS=str(skew_ms))
        # A new host rebuilds each partition's store from the whole backup before it runs it.
        restoring = bool(at_kill)
        wait_until(lambda w=worker, r=restoring: ticking.owns_all(rclient, w, r), 20, f"{host} to own")
        taken_ms = time.time() * 1000
        base = ticking.backup_ticks(rclient)
        if at_kill:
            # The new host's clock, when it took the partitions over, was behind the periods the
            # one before ran: it must know from the backup which ran, or run them again.
            last = max(ticks[-1] for ticks in at_kill[-1].values())
            assert taken_ms + skew_ms < last, f"host {host}: clock {taken_ms + skew_ms:.0f} not behind {last}"
            assert base == at_kill[-1], "the backup changed between the kill and the takeover"

        def ticked(base: dict[int, list[int]] = base) -> bool:
            now = ticking.backup_ticks(rclient)
            return all(len(now[p]) >= len(base[p]) + TICKS_PER_HOST for p in now)

        wait_until(ticked, 20, f"{host} to run {TICKS_PER_HOST} periods", interval=0.05)
        if host == HOSTS[-1][0]:
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.wait(10) == 0, worker.tail()
            break
        time.sleep(rng.uniform(0, TICK_MS / 1000))  # anywhere in a period, mid-commit or not
        assert worker.kill9() == -9
        at_kill.append(ticking.backup_ticks(rclient))
        # The host's own store is the backup, or ahead of it by its last commit, whose backup call
        # never ran (the next host runs without it, and nothing of it was published).
        for p, (ticks, counted) in ticking.store_ticks(host).items():
            assert ticks[: len(at_kill[-1][p])] == at_kill[-1][p], (host, p, ticks, at_kill[-1][p])
            assert counted == len(ticks), (host, p, counted, ticks)
        print(f"host {host} killed: {sum(map(len, at_kill[-1].values()))} ticks in the backup")
    assert "Traceback" not in "".join(w.log.read_text() for w in spawn.workers)

    # What the last host stopped with may still be in its outbox: a worker of the app without the
    # timer publishes it and stops.
    finisher = ticking.start(HOSTS[-1][0], "--until-idle", PSPF_TEST_TICK="0")
    assert finisher.wait(60) == 0, finisher.tail()

    # Each takeover restored what the host before left in the backup, and went on from there.
    for (host, _), ticks in zip(HOSTS[1:], at_kill, strict=True):
        for p, (found, _) in ticking.store_ticks(host).items():
            assert found[: len(ticks[p])] == ticks[p], (
                f"host {host} partition {p} did not start from the backup"
            )
    out = emitted(rclient, ticking.target)
    for p in range(TIMER_PARTITIONS):
        state = read_store(ticking.dir(HOSTS[-1][0]), ticking.app, p)[1]
        assert state == backup_state(rclient, ticking.source, ticking.app, p)
        listed, counted = ticking.keys[p]
        ticks = state[listed]["at"]
        check_ticks(p, ticks, state[counted]["n"], at_kill)
        # One emitted entry per period the state holds, with the count of that period's commit.
        mine = [(v["at"], v["n"]) for v in out if v["partition"] == p]
        published = Counter(at for at, _ in mine)
        assert not [at for at, n in published.items() if n > 1], f"partition {p}: emitted twice: {mine}"
        assert not set(published) - set(ticks), f"partition {p}: emitted for periods not in the state"
        assert not set(ticks) - set(published), f"partition {p}: periods without their emitted entry"
        assert sorted(mine) == [(at, n) for n, at in enumerate(ticks, 1)]
        print(f"partition {p}: {len(ticks)} periods over {len(HOSTS)} hosts")
    print(f"timer test: {time.monotonic() - started:.1f}s")


# -- scheduled callbacks under random SIGKILLs --------------------------------------------------------

REMINDER_PARTITIONS = 2
REMINDER_ENTRIES = 4_000
KILLS = 6


def reminder_entries(n: int, seed: int) -> Entries:
    """(ms, key, delay): entry times 1-30 ms apart, 30 keys, reminders 0-300 ms after."""
    rng = random.Random(seed)
    entries, ms = [], 1_000_000
    for _ in range(n):
        ms += rng.randint(1, 30)
        entries.append((ms, f"k{rng.randrange(30)}", rng.randint(0, 300)))
    return entries


def differs(found: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]], key: str) -> str:
    """How one key's state differs from the reference's: its count, and the reminders that ran
    more often or less often than there."""
    mine, theirs = found.get(key, {}), want.get(key, {})
    ran = Counter(map(tuple, mine.get("reminded", [])))
    should = Counter(map(tuple, theirs.get("reminded", [])))
    return (
        f"n {mine.get('n')} (want {theirs.get('n')}), reminders [made at n, ran at n] "
        f"run too often: {sorted((ran - should).elements())}, missing: {sorted((should - ran).elements())}"
    )


def test_scheduled_callbacks_run_once_each_across_random_sigkills_and_moves_between_hosts(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    source, target = make_topic(REMINDER_PARTITIONS), make_topic(1)
    app = names.app()
    entries = reminder_entries(REMINDER_ENTRIES, seed=11)
    pipe = rclient.pipeline(transaction=False)
    for ms, key, delay in entries:  # explicit ids: stream time is the reference's
        partition = zlib.crc32(key.encode()) % REMINDER_PARTITIONS
        fields = codec.entry_fields(json.dumps({"delay": delay}).encode(), key)
        pipe.xadd(stream_key(source, partition), fields, id=f"{ms}-0")
    pipe.execute()
    want, left = simulate(entries, REMINDER_PARTITIONS)
    reminders = Counter((key, n) for key, s in want.items() for n, _ in s.get("reminded", []))
    assert sum(reminders.values()) > 1000 and REMINDER_ENTRIES - sum(reminders.values()) > 1000
    env = {"PSPF_TEST_TARGET": target, "PSPF_TEST_WORK_US": "300"}

    def applied() -> int:
        """Entries whose effects the backups hold (each counts one in its key's ``n``)."""
        return sum(
            v.get("n", 0)
            for p in range(REMINDER_PARTITIONS)
            for v in backup_state(rclient, source, app, p).values()
        )

    dirs = [tmp_path / "host-a", tmp_path / "host-b"]
    rng = random.Random()
    last = 0
    for kill in range(KILLS):
        worker = run(spawn, f"w{kill}", REMINDERS, source, app, dirs[kill % 2], "--batch-size", "20", env=env)
        goal = max(last + 100, (kill + 1) * REMINDER_ENTRIES // (KILLS + 2))
        wait_until(lambda goal=goal: applied() >= goal, 30, f"progress past {goal}", interval=0.02)
        time.sleep(rng.uniform(0, 0.15))
        assert worker.kill9() == -9
        last = applied()
        log = worker.log.read_text()
        assert "Traceback" not in log, worker.tail()
        # Each restart met a store on its host that was missing or behind (the other host went
        # on meanwhile), or ahead by a batch the backup never got: it started from the backup.
        repaired = re.findall(
            rf"state backup (restored|caught up) app={re.escape(app)} partition=(\d+) ", log
        )
        assert kill == 0 or repaired, f"restart {kill} did not start from the backup\n{worker.tail()}"
        print(f"kill {kill} on {dirs[kill % 2].name}: {last} entries in the backup, {sorted(repaired)}")
    assert last < REMINDER_ENTRIES, "the workers finished before the last kill"

    final_dir = tmp_path / "host-c"
    final = run(spawn, "final", REMINDERS, source, app, final_dir, "--until-idle", env=env)
    assert final.wait(120) == 0, final.tail()
    assert restored(final.log.read_text(), app) == list(range(REMINDER_PARTITIONS)), final.tail()

    found: dict[str, dict[str, Any]] = {}
    scheduled: dict[str, tuple[int, int]] = {}
    for p in range(REMINDER_PARTITIONS):
        found.update(read_store(final_dir, app, p)[1])
        with open_store("sqlite", final_dir, app, p, readonly=True) as store:
            for name, raw in store.items(SCHEDULES_NAMESPACE):
                at, payload, _, _ = msgspec.msgpack.decode(raw)
                scheduled[name.partition("/")[2]] = (at, msgspec.msgpack.decode(payload)["n"])
        assert not rclient.xpending(stream_key(source, p), app)["pending"]
    wrong = sorted(k for k in want.keys() | found.keys() if found.get(k) != want.get(k))
    assert not wrong, (
        f"{len(wrong)} keys differ from the reference, {wrong[0]}: {differs(found, want, wrong[0])}"
    )
    assert scheduled == left, "the reminders still scheduled differ from the reference's"
    out = emitted(rclient, target)
    got = Counter((v["key"], v["n"]) for v in out)
    assert len(out) == sum(reminders.values()), f"{len(out)} reminders emitted, {sum(reminders.values())} ran"
    assert got == reminders, (
        f"emitted twice: {sorted((got - reminders).elements())[:5]}, "
        f"missing: {sorted((reminders - got).elements())[:5]}"
    )
    print(
        f"{KILLS} kills, {REMINDER_ENTRIES} entries, {len(out)} reminders: {time.monotonic() - started:.1f}s"
    )
