"""Tumbling window counts under SIGKILL: each window's result is emitted once and equals a reference.

50,000 clicks of 100 keys with event times over 60 minutes, shuffled within 5 s (the grace is
10 s), then 250 stragglers later than the grace (``tests.integration.test_windows``' ``clicks``),
on a 4-partition topic. Real ``pspf run`` workers of ``tests.crash.apps_windows:counts`` count
them per key in one-minute windows and emit each window's count to a 2-partition topic; they are
killed with SIGKILL at random moments, again and again, and restarted; then killed once more
when they have handled every click, with the last minutes' windows still open. Only then are the
stragglers produced, and a last worker, whose idle partitions close their windows after 500 ms,
finishes: it restores the open windows and the stream time, and must find every straggler late.
The target must hold exactly the counts the test computes (``reference``: stream time per
partition), each window once; after every kill no window is in the target twice and no entry is
acknowledged that no store committed. In the end every result's outbox row is PUBLISHED and no
window is left open, in the stores and in the backups.

One test runs a single worker (with each store engine); the other two workers, each with a state
dir of its own (two machines), killed one at a time: partitions move between the machines with
their open windows.

Late entries are counted by a worker's metric, which a process loses when it dies: the last
worker handles every straggler (none existed before), so its ``pspf_window_late_entries`` must
count them all; that none was applied shows in the counts, which would differ.

A third test runs a handler and two windows on the topic (``tests.crash.apps_windows:shared``:
the same count, a hopping sum to a second target, the handler counting each key's clicks in its
state), on fewer clicks and kills: each entry is one attempt for the three, so every result of
both windows equals its reference once and each key's state counts its clicks once.

``PSPF_TEST_WINDOW_ENTRIES`` and ``PSPF_TEST_WINDOW_KILLS`` shrink the tests for quick runs
(``PSPF_TEST_SHARED_ENTRIES`` and ``PSPF_TEST_SHARED_KILLS`` the third);
``PSPF_TEST_SEED`` repeats the input and the kill times.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import re
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf.keys import WINDOWS_NAMESPACE, StreamId, partition_for, stream_key
from pspf.outbox.rows import RowState
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import (
    ENGINES,
    WorkerProcess,
    backup_checkpoint,
    backup_hash,
    backup_identity,
    leases,
    no_leases,
    read_store,
    store_identity,
)
from tests.crash.test_outbox_crash import Apps, outbox_rows, outputs, states
from tests.integration.test_windows import MINUTE_MS, clicks, reference
from tests.integration.test_windows_shared import Reference, shared_clicks
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

COUNTS = "tests.crash.apps_windows:counts"
SHARED = "tests.crash.apps_windows:shared"
PARTITIONS, TARGET_PARTITIONS = 4, 2
ENTRIES = int(os.environ.get("PSPF_TEST_WINDOW_ENTRIES", "50000"))
KEYS = 100
KILLS = int(os.environ.get("PSPF_TEST_WINDOW_KILLS", "12"))
SHARED_ENTRIES = int(os.environ.get("PSPF_TEST_SHARED_ENTRIES", "20000"))
SHARED_KILLS = int(os.environ.get("PSPF_TEST_SHARED_KILLS", "6"))
LEASE_TTL_MS = 1000
#: Busy work per entry: a few thousand entries a second, so the kills land mid-stream.
WORK_US = 150
OPTIONS = ["--batch-size", "100"]
#: The last worker closes the windows of a partition that got nothing for this long.
IDLE_CLOSE_MS = 500
#: No new result for this long: the last worker is done, whatever the target holds.
STALLED_S = 10
METRICS_URL = re.compile(r"serving metrics on (http://\S+/metrics)")


class Windowed:
    """The counting app on its source and target, the input, and what the reference expects.

    ``shared``: the handler and two windows of ``SHARED`` instead, the sums to a second target.
    """

    def __init__(
        self,
        apps: Apps,
        client: Any,
        tmp_path: Path,
        make_topic: Callable[[int], str],
        produce: Callable[..., int],
        names: Names,
        seed: int,
        engine: str,
        shared: bool = False,
    ) -> None:
        self.apps, self.client, self.tmp_path = apps, client, tmp_path
        self.engine, self.shared = engine, shared
        self.entries = SHARED_ENTRIES if shared else ENTRIES
        self.stragglers = self.entries // 200
        self.kills = SHARED_KILLS if shared else KILLS
        self.source, self.target = make_topic(PARTITIONS), make_topic(TARGET_PARTITIONS)
        #: where the second window's results go (``shared``)
        self.sums = make_topic(TARGET_PARTITIONS) if shared else ""
        self.app = names.app()
        if shared:
            self.produced = shared_clicks(self.entries, KEYS, self.stragglers, seed, fail_every=10**9)
            ref = Reference(self.produced, PARTITIONS)
            assert ref.late == {"count": self.stragglers, "total": self.stragglers}
            self.expected, self.expected_sums, self.seen = ref.counts, ref.sums, ref.seen
            #: late entries the metrics must count: each straggler once per window
            self.late = 2 * self.stragglers
        else:
            self.produced = clicks(self.entries, keys=KEYS, late=self.stragglers, seed=seed)
            self.expected, self.late = reference(self.produced, PARTITIONS)
            self.expected_sums, self.seen = Counter(), Counter()
            assert self.late == self.stragglers
        # The input is what the test means it to be: the shuffle within the grace makes no entry
        # late, every straggler is.
        assert sum(self.expected.values()) == self.entries
        self.produce = produce
        assert produce(self.source, self.produced[: self.entries]) == self.entries
        #: each source partition's entry ids, in stream order
        self.ids = self.entry_ids()
        assert sum(len(ids) for ids in self.ids.values()) == self.entries

    def entry_ids(self) -> dict[int, list[StreamId]]:
        return {
            p: [StreamId.parse(i) for i, _ in self.client.xrange(stream_key(self.source, p))]
            for p in range(PARTITIONS)
        }

    def produce_stragglers(self) -> None:
        """The stragglers, after the clicks in every partition (as the reference has them)."""
        assert self.produce(self.source, self.produced[self.entries :]) == self.stragglers
        self.ids = self.entry_ids()
        assert sum(len(ids) for ids in self.ids.values()) == self.entries + self.stragglers

    def open_in_backups(self) -> int:
        """Windows the state backups hold open (a closed window's state is deleted)."""
        head = WINDOWS_NAMESPACE.encode() + b"\x00"
        return sum(
            1
            for p in range(PARTITIONS)
            for name in backup_hash(self.client, self.source, p, self.app)
            if name.startswith(head)
        )

    def state_dir(self, machine: str) -> Path:
        return self.tmp_path / machine

    def run(self, machine: str, label: str, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        """Start a worker on ``machine``: its consumer name and state dir are the machine's."""
        extra = {"PSPF_TEST_TARGET": self.target, "PSPF_TEST_WORK_US": str(WORK_US), **(env or {})}
        if self.shared:
            extra["PSPF_TEST_SUMS"] = self.sums
        return self.apps.run(
            label,
            SHARED if self.shared else COUNTS,
            self.source,
            self.app,
            self.state_dir(machine),
            "--consumer",
            machine,
            "--store",
            self.engine,
            *OPTIONS,
            *args,
            env=extra,
        )

    def in_backups(self) -> int:
        """Entries at or below the checkpoints of the state backups (what a new owner starts from)."""
        done = 0
        for p, ids in self.ids.items():
            checkpoint = backup_checkpoint(self.client, self.source, self.app, p)
            done += 0 if checkpoint is None else bisect.bisect_right(ids, checkpoint)
        return done

    def targets(self) -> list[tuple[str, Counter[tuple[str, int]], int]]:
        """Each window's target, expected results and window size."""
        found = [(self.target, self.expected, MINUTE_MS)]
        if self.shared:
            found.append((self.sums, self.expected_sums, 2 * MINUTE_MS))
        return found

    def results_expected(self) -> int:
        return sum(len(expected) for _, expected, _ in self.targets())

    def in_target(self) -> int:
        return sum(
            self.client.xlen(stream_key(target, p))
            for target, _, _ in self.targets()
            for p in range(TARGET_PARTITIONS)
        )

    def unpublished(self) -> bool:
        """Whether the backups hold results not published yet."""
        nowhere = self.tmp_path / "no-state"  # rows are read from the backups only
        return any(
            outbox_rows(self.apps.spawn.redis_url, self.app, nowhere, backups=True, row_state=state, limit=1)
            for state in (RowState.PENDING, RowState.CLAIMED)
        )

    def leases_expired(self) -> None:
        wait_until(
            lambda: no_leases(self.client, self.source, self.app, PARTITIONS), 10, "the leases to expire"
        )

    def assert_once(self) -> int:
        """No window's result is in a target twice (also while results are still coming); how
        many results there are."""
        total = 0
        for target, _, _ in self.targets():
            emitted = outputs(self.client, target, TARGET_PARTITIONS)
            seen = Counter((out.value["key"], out.value["start"]) for out in emitted)
            twice = sorted(window for window, n in seen.items() if n > 1)
            assert not twice, f"{len(twice)} of {len(seen)} windows emitted more than once: {twice[:5]}"
            total += len(emitted)
        return total

    def assert_results(self) -> None:
        """Each target holds each window's result once, equal to the reference, under its key."""
        for target, expected, size_ms in self.targets():
            self.assert_target(target, expected, size_ms)

    def assert_target(self, target: str, expected: Counter[tuple[str, int]], size_ms: int) -> None:
        emitted = outputs(self.client, target, TARGET_PARTITIONS)
        seen = Counter((out.value["key"], out.value["start"]) for out in emitted)
        twice = sorted(window for window, n in seen.items() if n > 1)
        got = Counter({(out.value["key"], out.value["start"]): out.value["value"] for out in emitted})
        missing = sorted(expected.keys() - got.keys())
        extra = sorted(got.keys() - expected.keys())
        wrong = {w: (got[w], expected[w]) for w in expected.keys() & got.keys() if got[w] != expected[w]}
        assert not (twice or missing or extra or wrong), (
            f"{len(emitted)} results for {len(expected)} windows: {len(twice)} emitted more than once "
            f"{twice[:5]}, {len(missing)} never {missing[:5]}, {len(extra)} unknown {extra[:5]}, "
            f"{len(wrong)} wrong (got, want) {dict(list(wrong.items())[:5])}"
        )
        assert got == expected and len(emitted) == len(expected)
        for out in emitted:
            assert out.value["end"] == out.value["start"] + size_ms, out
            assert out.key == out.value["key"], out
            assert out.partition == partition_for(out.key.encode(), TARGET_PARTITIONS), out

    def current_stores(self, state_dirs: list[Path]) -> dict[int, list[Path]]:
        """Per partition, the state dirs whose store is the backup's (the same batch identity):
        the last owner's; a machine that lost the partition keeps a stale store."""
        found: dict[int, list[Path]] = {}
        for p in range(PARTITIONS):
            identity = backup_identity(self.client, self.source, self.app, p)
            found[p] = [d for d in state_dirs if store_identity(d, self.app, p, self.engine) == identity]
            assert identity and found[p], f"partition {p}: no store holds the backup's batch {identity}"
        return found

    def assert_published_and_closed(self, state_dirs: list[Path]) -> None:
        """Every result's outbox row is PUBLISHED, in the stores and in the backups, and no window
        is left open in either (a closed window's state goes in the commit that emits it)."""
        redis_url = self.apps.spawn.redis_url
        nowhere = self.tmp_path / "no-state"
        current = self.current_stores(state_dirs)
        rows_of = {d: outbox_rows(redis_url, self.app, d, engine=self.engine) for d in state_dirs}
        for p, dirs in current.items():
            backup_rows = [
                row
                for row in outbox_rows(redis_url, self.app, nowhere, backups=True)
                if row.row_id.startswith(f"{p}:")
            ]
            # The windows of a source partition's keys: each emitted once, by that partition.
            want = sum(
                1
                for _, expected, _ in self.targets()
                for key, _ in expected
                if partition_for(key.encode(), PARTITIONS) == p
            )
            for where, rows in [("the backup", backup_rows)] + [
                (f"the store in {d.name}", [row for row in rows_of[d] if row.row_id.startswith(f"{p}:")])
                for d in dirs
            ]:
                assert states(rows) == {RowState.PUBLISHED: want}, f"partition {p}: rows in {where}"
            for d in dirs:
                with open_store(self.engine, d, self.app, p, readonly=True) as store:
                    held = [name for name, _ in store.items(WINDOWS_NAMESPACE)]
                assert not held, f"partition {p}: the store in {d.name} holds windows {held[:3]}"
        assert not self.open_in_backups(), "the backups hold open windows"

    def assert_handler_state(self, state_dirs: list[Path]) -> None:
        """Each key's state (``shared``'s handler) counts its clicks once: the last stores hold it."""
        found: dict[str, dict[str, Any]] = {}
        for p, dirs in self.current_stores(state_dirs).items():
            found.update(read_store(dirs[0], self.app, p, self.engine)[1])
        assert found == {key: {"count": n} for key, n in self.seen.items()}


def late_counted(worker: WorkerProcess, app: str) -> int:
    """The late entries a running worker's metrics endpoint reports for ``app``."""
    found = METRICS_URL.search(worker.log.read_text())
    assert found, f"the worker serves no metrics\n{worker.tail()}"
    with urllib.request.urlopen(found.group(1), timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pspf_window_late_entries_total{") and f'app="{app}"' in line:
            total += float(line.rpartition(" ")[2])
    return int(total)


def finish(windowed: Windowed, workers: list[WorkerProcess]) -> int:
    """Wait for every result in the target (or for results to stop coming: the assertions after
    say what is missing), then a little for any extra; the late entries the workers counted.
    Stops them with SIGTERM: each must exit 0."""
    deadline = time.monotonic() + 120
    found, changed = windowed.in_target(), time.monotonic()
    while found < windowed.results_expected() and time.monotonic() < deadline:
        time.sleep(0.1)
        now = windowed.in_target()
        if now != found:
            found, changed = now, time.monotonic()
        elif time.monotonic() - changed > STALLED_S:
            break
    time.sleep(1.0)  # a result emitted twice would show up now
    late = sum(late_counted(worker, windowed.app) for worker in workers)
    for worker in workers:
        worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        assert worker.wait(30) == 0, worker.tail()
        assert "Traceback" not in worker.log.read_text(), worker.tail()
        assert worker.summary()[2] == 0, "failures"
    return late


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {value} (set PSPF_TEST_SEED to repeat)")
    return value


@pytest.fixture
def engine() -> str:
    """The workers' store (``--store``); a test parametrized on ``engine`` runs each."""
    return "sqlite"


@pytest.fixture
def shared() -> bool:
    """Whether the workers run ``SHARED`` (a test parametrized on ``shared`` says so)."""
    return False


@pytest.fixture
def windowed(
    spawn: Spawner,
    tmp_path: Path,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    seed: int,
    engine: str,
    shared: bool,
) -> Windowed:
    return Windowed(Apps(spawn), rclient, tmp_path, make_topic, produce, names, seed, engine, shared)


def takeovers(windowed: Windowed, machine: str) -> Counter[str]:
    """How the workers of ``machine`` took their partitions, from their logs."""
    found: Counter[str] = Counter()
    for log in windowed.tmp_path.glob(f"{machine}-*.log"):
        found.update(re.findall(r"state backup (\w+)", log.read_text()))
    return found


def kill_target(windowed: Windowed, life: int) -> int:
    """How far the backups must be before the kill of ``life``: up to four fifths of the clicks."""
    return (life + 1) * windowed.entries * 4 // (5 * windowed.kills)


def holds_any(windowed: Windowed, worker: WorkerProcess) -> bool:
    found = leases(windowed.client, windowed.source, windowed.app, PARTITIONS).values()
    return any(lease is not None and lease.pid == worker.pid for lease in found)


def assert_acked_committed(windowed: Windowed, machines: list[str]) -> bool:
    """Every entry acknowledged is committed in the store of some machine; whether entries were
    pending (delivered, not acknowledged).

    Per partition, Redis is read once and the stores after it: an entry acknowledged then was
    committed before (if the workers keep their promise), in the store of the machine that
    acknowledged it; a partition can move meanwhile, so each machine's store is read after the
    one reading of Redis (as ``tests.crash.support.view_partition`` does for one store).
    """
    client, app = windowed.client, windowed.app
    pending_any = False
    for p in range(PARTITIONS):
        stream = stream_key(windowed.source, p)
        groups = [g for g in client.xinfo_groups(stream) if g["name"] == app.encode()]
        if not groups:
            continue
        delivered = StreamId.parse(groups[0]["last-delivered-id"])
        pending = {
            StreamId.parse(row["message_id"])
            for row in client.xpending_range(stream, app, "-", "+", 1_000_000)
        }
        pending_any |= bool(pending)
        checkpoints = {
            m: read_store(windowed.state_dir(m), app, p, windowed.engine)[0].get(windowed.source)
            for m in machines
        }
        covered = max((c for c in checkpoints.values() if c is not None), default=StreamId(0, 0))
        acked = [i for i in windowed.ids[p] if covered < i <= delivered and i not in pending]
        assert not acked, (
            f"partition {p}: {len(acked)} entries acknowledged but committed in no store (first "
            f"{acked[:3]}; the stores' checkpoints {checkpoints}, last delivered {delivered})"
        )
    return pending_any


def kill_again_and_again(windowed: Windowed, rng: random.Random, machines: list[str]) -> int:
    """Run a worker on each machine; SIGKILL one at a random moment and restart it, ``kills``
    times; then SIGKILL every worker once the backups hold every click. Returns the kills."""
    lives: Counter[str] = Counter()

    def start(machine: str) -> WorkerProcess:
        lives[machine] += 1
        return windowed.run(machine, f"{machine}-{lives[machine]}")

    workers = {m: start(m) for m in machines}
    progress, published = [0], [0]
    kills = mid_batch = unpublished = 0
    for life in range(windowed.kills):
        victim = rng.choice(machines)
        worker = workers[victim]
        if life % 4 == 3:  # right after it took a partition: restoring, barely started

            def took(worker: WorkerProcess = worker) -> bool:
                return holds_any(windowed, worker) or not worker.alive()

            wait_until(took, LEASE_TTL_MS / 1000 + 15, f"{victim} to take a partition")
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            target = kill_target(windowed, life)

            def reached(target: int = target) -> bool:
                return windowed.in_backups() >= target or not all(w.alive() for w in workers.values())

            wait_until(reached, 60, f"the backups to reach {target} entries", interval=0.05)
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a cycle: handling, commit, ack, relay
        for w in workers.values():
            assert w.alive(), f"a worker exited by itself\n{w.tail()}"
        assert worker.kill9() == -9
        kills += 1
        assert "Traceback" not in worker.log.read_text(), worker.tail()

        mid_batch += assert_acked_committed(windowed, machines)
        progress.append(windowed.in_backups())
        assert progress[-1] >= progress[-2], f"the state backup went backwards: {progress}"
        published.append(windowed.assert_once())
        unpublished += windowed.unpublished()
        workers[victim] = start(victim)

    # Once more when every click is handled: windows are open, waiting for stream time.
    every = windowed.entries
    wait_until(lambda: windowed.in_backups() == every, 60, "the backups to hold every click", interval=0.05)
    time.sleep(rng.uniform(0.0, 0.3))
    for worker in workers.values():
        assert worker.alive(), f"a worker exited by itself\n{worker.tail()}"
        assert worker.kill9() == -9
        kills += 1
    assert windowed.open_in_backups(), "no window open when the clicks were all handled"
    published.append(windowed.assert_once())

    print(f"entries in the backups after each kill: {progress[1:]}")
    print(f"results in the target after each kill: {published[1:]}")
    assert kills >= windowed.kills >= (6 if windowed.shared else 10)
    assert 0 < progress[-1] < windowed.entries, "the kills should land mid-stream"
    assert sum(1 for a, b in itertools.pairwise(progress) if b > a) >= windowed.kills // 2, progress
    results = published[windowed.kills]
    assert 0 < results < windowed.results_expected(), "the kills should land while results come"
    assert mid_batch, "no kill left entries pending"
    assert unpublished, "no kill left results unpublished"
    return kills


def run_to_the_end(windowed: Windowed, machines: list[str]) -> None:
    """The stragglers, then a last worker on each machine, whose idle partitions close their
    windows: every result equals the reference, once; their metrics count every straggler."""
    state_dirs = [windowed.state_dir(m) for m in machines]
    windowed.produce_stragglers()
    windowed.leases_expired()
    in_backup = windowed.in_backups()
    idle = {"PSPF_WINDOW_IDLE_CLOSE_MS": str(IDLE_CLOSE_MS)}
    finals = [windowed.run(m, f"{m}-final", "--metrics-port", "0", env=idle) for m in machines]
    late = finish(windowed, finals)
    handled = sum(worker.summary()[0] for worker in finals)
    skipped = sum(worker.summary()[1] for worker in finals)
    # A store ahead of its backup is rolled back to it: the last workers handle the rest once.
    assert (handled, skipped) == (windowed.entries + windowed.stragglers - in_backup, 0)

    windowed.assert_results()
    assert late == windowed.late, (
        f"the last workers counted {late} late entries, the reference {windowed.late}"
    )
    windowed.assert_published_and_closed(state_dirs)
    if windowed.shared:
        windowed.assert_handler_state(state_dirs)


@pytest.mark.parametrize("engine", ENGINES)
def test_tumbling_counts_under_random_kill9_equal_the_reference_each_window_once(
    windowed: Windowed, seed: int
) -> None:
    started = time.monotonic()
    kills = kill_again_and_again(windowed, random.Random(seed), ["host"])
    run_to_the_end(windowed, ["host"])
    took = time.monotonic() - started
    print(f"{windowed.entries} + {windowed.stragglers} entries, {kills} kills: {took:.1f}s")


def test_two_machines_under_random_kill9_emit_each_window_once(windowed: Windowed, seed: int) -> None:
    """Two workers, each with a state dir of its own, share the partitions; one or the other is
    killed: partitions move between the machines with their open windows (restored from the
    backups), and every window's result is still emitted once, equal to the reference."""
    started = time.monotonic()
    machines = ["host-a", "host-b"]
    kills = kill_again_and_again(windowed, random.Random(seed), machines)
    for machine in machines:  # partitions moved here from the other machine: restored from backups
        taken = takeovers(windowed, machine)
        print(f"{machine} took partitions: {dict(taken)}")
        assert taken["restored"], f"{machine} never restored a partition from its backup: {dict(taken)}"
    run_to_the_end(windowed, machines)
    took = time.monotonic() - started
    print(f"{windowed.entries} + {windowed.stragglers} entries on two machines, {kills} kills: {took:.1f}s")


@pytest.mark.parametrize("shared", [True])
def test_a_handler_and_two_windows_on_one_topic_under_random_kill9_emit_each_window_once(
    windowed: Windowed, seed: int
) -> None:
    """Each entry is one attempt for the handler and both windows: after the kills, every result
    of both windows equals its reference once, and each key's state counts its clicks once."""
    started = time.monotonic()
    kills = kill_again_and_again(windowed, random.Random(seed), ["host"])
    run_to_the_end(windowed, ["host"])
    took = time.monotonic() - started
    print(f"{windowed.entries} + {windowed.stragglers} entries, {kills} kills: {took:.1f}s")
