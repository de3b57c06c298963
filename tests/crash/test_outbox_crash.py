"""The outbox (``ctx.emit``) under SIGKILL: every input's output is published exactly once.

Real ``pspf run`` workers (``tests.crash.apps_outbox``) against a real server, killed at
random moments, at named points of the relay (after the claim, after a publishing call before the
rows are marked, between two publishing calls of one step), frozen as zombie relays that publish
rows another owner published already, and moved to another host (state dir) with rows still
waiting. Each time the target must hold exactly one entry per input, identified by its source
headers (source partition, source id: an id is unique only within its partition), and every row
must end PUBLISHED.

Two tests are about the leases of a worker that publishes: a zombie whose relay step, in a cycle
that read nothing, outlived its lease must give the partition up (not exit), and a worker that
takes over partitions whose backups are large (they keep the published rows) must not lose the
leases it took first while it restores the others.

``PSPF_TEST_CHAIN_INPUTS`` and ``PSPF_TEST_CHAIN_KILLS`` shrink the chain test for quick runs
(50,000 inputs and 10 kills of each app by default); ``PSPF_TEST_SEED`` repeats its kill times.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from pspf import codec
from pspf.broker import Broker
from pspf.errors import NotFound
from pspf.keys import partition_for, stream_key
from pspf.outbox.emit import (
    SOURCE_APP_HEADER,
    SOURCE_ID_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
)
from pspf.outbox.relay import PUBLISH_CHUNK
from pspf.outbox.rows import RowState
from pspf.repartition.run import Repartition, make_plan
from pspf.service import OutboxRowInfo, Service
from pspf.settings import Settings
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import (
    Records,
    WorkerProcess,
    assert_exact,
    backup_applied,
    held_by,
    no_leases,
    process_state,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

ENRICH = "tests.crash.apps_outbox:enrich"
TOTAL = "tests.crash.apps_outbox:total"
#: Leases of a killed worker expire this long after its last renewal: the next one waits no longer.
LEASE_TTL_MS = 1000

CHAIN_INPUTS = int(os.environ.get("PSPF_TEST_CHAIN_INPUTS", "50000"))
CHAIN_KILLS = int(os.environ.get("PSPF_TEST_CHAIN_KILLS", "10"))
CHAIN_PARTITIONS = 4


# -- worker subprocesses of the outbox apps ----------------------------------------------------------


class AppProcess(WorkerProcess):
    """A ``pspf run`` subprocess of one of the outbox apps (``WorkerProcess`` runs the crash app)."""

    def __init__(self, target: str, log: Path, args: list[str], env: dict[str, str], cwd: Path) -> None:
        self.log = log
        self.started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                pspf_command("run", target, *args), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )


class Apps:
    """Starts the outbox apps; the ``spawn`` fixture reaps them and shows their logs on failure."""

    def __init__(self, spawn: Spawner) -> None:
        self.spawn = spawn

    def run(
        self,
        label: str,
        target: str,
        topic: str,
        app: str,
        state_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        lease_ttl_ms: int = LEASE_TTL_MS,
    ) -> WorkerProcess:
        options = ["--broker", self.spawn.redis_url, "--state-dir", str(state_dir)]
        options += ["--block-ms", "100", "--lease-ttl-ms", str(lease_ttl_ms), *args]
        worker = AppProcess(
            target,
            self.spawn.tmp_path / f"{label}.log",
            options,
            subprocess_env(PSPF_TEST_TOPIC=topic, PSPF_TEST_APP=app, **(env or {})),
            self.spawn.tmp_path,
        )
        self.spawn.workers.append(worker)
        return worker


@pytest.fixture
def apps(spawn: Spawner) -> Apps:
    return Apps(spawn)


# -- input, output, rows ---------------------------------------------------------------------------


def orders(n: int, seed: int, order_keys: int = 200, users: int = 1_000) -> Records:
    """Orders keyed by an order key, each for a user; ``n`` numbers them."""
    rng = random.Random(seed)
    return [
        (
            f"k{rng.randrange(order_keys)}",
            {"user": f"u{rng.randrange(users)}", "amount": rng.randrange(1, 1000), "n": i},
        )
        for i in range(n)
    ]


def by_user(records: Records) -> Records:
    """The input as the summing app must see it: keyed by user."""
    return [(value["user"], {"amount": value["amount"]}) for _, value in records]


Source = tuple[int, str]  # (source partition, source id)


class Output(NamedTuple):
    partition: int
    id: str
    key: str
    value: dict[str, Any]
    headers: dict[str, str]

    @property
    def source(self) -> Source:
        return int(self.headers[SOURCE_PARTITION_HEADER]), self.headers[SOURCE_ID_HEADER]


def outputs(client: Any, topic: str, partitions: int) -> list[Output]:
    """Every entry of a topic, partition by partition, in stream order."""
    found = []
    for p in range(partitions):
        stream = stream_key(topic, p)
        if client.type(stream) != b"stream":
            continue
        for entry_id, fields in client.xrange(stream):
            found.append(
                Output(
                    p,
                    entry_id.decode(),
                    fields.get(codec.KEY, b"").decode(),
                    json.loads(fields[codec.VALUE]),
                    codec.decode_headers(fields.get(codec.HEADERS)),
                )
            )
    return found


def inputs(client: Any, topic: str, partitions: int) -> dict[Source, int]:
    """Every input entry by (partition, id): its order number."""
    return {
        (p, entry_id.decode()): json.loads(fields[codec.VALUE])["n"]
        for p in range(partitions)
        for entry_id, fields in client.xrange(stream_key(topic, p))
    }


def _id(raw: str) -> tuple[int, int]:
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq)


def assert_once_per_input(
    client: Any, source: str, source_partitions: int, target: str, target_partitions: int, app: str
) -> list[Output]:
    """The target holds exactly one entry per input, from that input, in each source's order."""
    want = inputs(client, source, source_partitions)
    got = outputs(client, target, target_partitions)
    seen = Counter(out.source for out in got)
    twice = sorted(s for s, c in seen.items() if c > 1)
    missing = sorted(want.keys() - seen.keys())
    foreign = sorted(seen.keys() - want.keys())
    assert not (twice or missing or foreign), (
        f"{len(got)} entries in the target for {len(want)} inputs: {len(twice)} inputs published more "
        f"than once {twice[:5]}, {len(missing)} never {missing[:5]}, {len(foreign)} unknown {foreign[:5]}"
    )
    assert len(got) == len(want)
    last: dict[tuple[int, int], tuple[int, int]] = {}
    for out in got:
        assert out.value["n"] == want[out.source], out
        assert out.key == out.value["user"], out
        assert out.partition == partition_for(out.key.encode(), target_partitions), out
        assert out.headers[SOURCE_APP_HEADER] == app and out.headers[SOURCE_TOPIC_HEADER] == source, out
        # One producer per source partition: its rows reach each target partition in its order.
        lane = (out.partition, out.source[0])
        here = _id(out.source[1])
        assert lane not in last or last[lane] < here, f"target partition {lane[0]}: out of order at {out}"
        last[lane] = here
    return got


def outbox_rows(
    redis_url: str,
    app: str,
    state_dir: Path,
    backups: bool = False,
    row_state: RowState | None = None,
    limit: int | None = None,
    engine: str = "sqlite",
) -> list[OutboxRowInfo]:
    """An app's outbox rows as ``pspf outbox list`` gives them, from the stores under ``state_dir``
    (read-only: also while a worker runs; ``engine``: the workers' ``--store``) or, with
    ``backups``, from the state backups in Redis (give an empty ``state_dir`` then: a partition
    without a backup would be read from there)."""
    values = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(state_dir), "PSPF_STORE": engine}
    settings = Settings.load(values, environ={})
    service = Service(settings, local_state=not backups)
    try:
        return service.outbox.outbox_list(app, None if row_state is None else str(row_state), limit=limit)
    except NotFound:  # no backup, or no store, yet
        return []
    finally:
        service.close()


def row_source(row: OutboxRowInfo) -> Source:
    """(source partition, source id) of the input that emitted a row."""
    assert row.source is not None, row
    return int(row.row_id.partition(":")[0]), row.source.rpartition("/")[2]


def assert_rows_numbered(
    rows: list[OutboxRowInfo], sources: dict[Source, int], complete: bool = True
) -> None:
    """Row n of a source partition is the output of its n-th input (one emit per input), the rows
    of each source partition run to its last input without a gap and, when ``complete`` (nothing
    pruned), from its first."""
    ordered: dict[int, list[str]] = defaultdict(list)
    for p, entry_id in sources:  # in stream order
        ordered[p].append(entry_id)
    seqs: dict[int, list[int]] = defaultdict(list)
    for row in rows:
        p, entry_id = row_source(row)
        assert ordered[p][row.seq - 1] == entry_id, f"row {row.row_id} (seq {row.seq}) is from {entry_id}"
        seqs[p].append(row.seq)
    assert seqs.keys() == ordered.keys(), f"rows of source partitions {sorted(seqs)}"
    for p, numbers in seqs.items():
        first = 1 if complete else min(numbers)
        assert sorted(numbers) == list(range(first, len(ordered[p]) + 1)), f"source partition {p}: gaps"


def states(rows: list[OutboxRowInfo]) -> Counter[RowState]:
    return Counter(RowState(row.state) for row in rows)


def events(path: Path) -> list[dict[str, Any]]:
    """The relay events the apps recorded (``PSPF_TEST_EVENTS``)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# -- 1. the chain under random SIGKILLs ------------------------------------------------------------

#: The chain's leases outlive a takeover of its four partitions, each restored from its backup;
#: published rows are pruned after a few seconds, which keeps the backups (and so the takeovers)
#: small. Backups that keep 50,000 rows take longer to restore than two thirds of such a lease,
#: and a worker then loses the leases it took first: see
#: test_a_worker_restoring_large_backups_keeps_the_leases_it_took_first.
CHAIN_LEASE_TTL_MS = 3000
CHAIN_RETENTION_S = 10


class Role:
    """One app of the chain: the worker of its current life and what its lives did."""

    def __init__(self, name: str, target: str, topic: str, app: str, state_dir: Path, env: dict[str, str]):
        self.name, self.target, self.topic, self.app = name, target, topic, app
        self.state_dir, self.env = state_dir, env
        self.worker: WorkerProcess | None = None
        self.lives = 0
        self.kills = 0
        #: entries applied in the backups after each kill
        self.applied: list[int] = [0]

    def start(self, apps: Apps, *args: str) -> WorkerProcess:
        self.worker = apps.run(
            f"{self.name}-{self.lives}",
            self.target,
            self.topic,
            self.app,
            self.state_dir,
            "--batch-size",
            "100",
            "--consumer",
            f"chain-{self.name}",
            *args,
            env=self.env,
            lease_ttl_ms=CHAIN_LEASE_TTL_MS,
        )
        self.lives += 1
        return self.worker

    def progressed(self, client: Any, target: int) -> bool:
        assert self.worker is not None
        assert self.worker.alive(), f"{self.name} exited by itself\n{self.worker.tail()}"
        return backup_applied(client, self.topic, self.app, CHAIN_PARTITIONS) >= target

    def kill(self, client: Any) -> None:
        assert self.worker is not None
        assert self.worker.kill9() == -9, f"{self.name} exited by itself\n{self.worker.tail()}"
        assert "Traceback" not in self.worker.log.read_text(), self.worker.tail()
        self.kills += 1
        self.applied.append(backup_applied(client, self.topic, self.app, CHAIN_PARTITIONS))
        assert self.applied[-1] >= self.applied[-2], f"{self.name}: the state backup went backwards"


def test_a_chain_of_two_apps_under_random_kill9_publishes_each_output_once_and_sums_exactly(
    apps: Apps,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """App A reads orders and emits one entry per order to ``enriched`` (keyed by user); app B sums
    ``enriched`` per user. Both are SIGKILLed at random moments, again and again, while they run
    side by side; then both finish. The target holds each input's output once and B's sums are
    exact."""
    started = time.monotonic()
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    orders_topic, enriched = make_topic(CHAIN_PARTITIONS), make_topic(CHAIN_PARTITIONS)
    records = orders(CHAIN_INPUTS, seed)
    assert produce(orders_topic, records) == CHAIN_INPUTS
    # Busy work per entry keeps the apps at a few thousand entries a second, so the kills land
    # mid-stream; published rows are pruned under the kills too.
    a_env = {
        "PSPF_TEST_TARGET": enriched,
        "PSPF_TEST_WORK_US": "150",
        "PSPF_OUTBOX_RETENTION_S": str(CHAIN_RETENTION_S),
    }
    a = Role("a", ENRICH, orders_topic, names.app(), tmp_path / "a", a_env)
    b = Role("b", TOTAL, enriched, names.app(), tmp_path / "b", {"PSPF_TEST_WORK_US": "30"})
    waiting_rows = 0  # kills of A after which its backups held rows not published yet
    nowhere = tmp_path / "no-state"  # rows are read from the backups only

    for life in range(CHAIN_KILLS):
        for role in (a, b):  # each waits for the leases of its killed predecessor to expire
            role.start(apps)
        # Each life works a while before its kill, so that kills do not all land on takeovers:
        # A gets through its share of the input, B through some of what A published.
        targets = {
            a: max(a.applied[-1] + 500, (life + 1) * CHAIN_INPUTS // (CHAIN_KILLS + 2)),
            b: b.applied[-1] + 200,
        }
        for role, target in targets.items():

            def progressed(role: Role = role, target: int = target) -> bool:
                return role.progressed(rclient, target)

            wait_until(progressed, 60, f"{role.name} to progress past {target}", interval=0.05)
        for role in sorted(targets, key=lambda _: rng.random()):
            time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a cycle: handling, commit, ack, relay
            role.kill(rclient)
            if role is a:
                waiting_rows += any(
                    outbox_rows(redis_url, a.app, nowhere, backups=True, row_state=state, limit=1)
                    for state in (RowState.PENDING, RowState.CLAIMED)
                )
        print(f"life {life}: A applied {a.applied[-1]}, B applied {b.applied[-1]}")

    assert a.kills == b.kills == CHAIN_KILLS
    assert 0 < a.applied[-1] < CHAIN_INPUTS, f"A's kills should land mid-stream: {a.applied}"
    assert 0 < b.applied[-1] < CHAIN_INPUTS, f"B's kills should land mid-stream: {b.applied}"
    assert waiting_rows, "no kill of A left outbox rows unpublished"
    published_before = len(outputs(rclient, enriched, CHAIN_PARTITIONS))
    assert 0 < published_before < CHAIN_INPUTS, published_before

    # Both finish (B once A published everything: --until-idle stops at what is there).
    for role in (a, b):

        def expired(role: Role = role) -> bool:
            return no_leases(rclient, role.topic, role.app, CHAIN_PARTITIONS)

        wait_until(expired, 10, f"{role.name}'s leases to expire")
    final_a = a.start(apps, "--until-idle")
    assert final_a.wait(180) == 0, final_a.tail()
    final_b = b.start(apps, "--until-idle")
    assert final_b.wait(180) == 0, final_b.tail()

    assert_once_per_input(rclient, orders_topic, CHAIN_PARTITIONS, enriched, CHAIN_PARTITIONS, a.app)
    assert_exact(rclient, a.state_dir, orders_topic, a.app, CHAIN_PARTITIONS, records)
    assert_exact(rclient, b.state_dir, enriched, b.app, CHAIN_PARTITIONS, by_user(records))
    # Every row A kept (the last ones: the older are pruned) is published, in its stores and in
    # its backups alike, and is the output of its input.
    sources = inputs(rclient, orders_topic, CHAIN_PARTITIONS)
    for where, rows in (
        ("stores", outbox_rows(redis_url, a.app, a.state_dir)),
        ("backups", outbox_rows(redis_url, a.app, nowhere, backups=True)),
    ):
        assert set(states(rows)) == {RowState.PUBLISHED}, f"A's rows in its {where}: {states(rows)}"
        assert_rows_numbered(rows, sources, complete=False)
    print(f"A kept {len(rows)} published rows")
    print(f"chain: {CHAIN_INPUTS} inputs, {a.kills} + {b.kills} kills: {time.monotonic() - started:.1f}s")


# -- the tests of one enriching app ----------------------------------------------------------------


class Emitting:
    """An enriching app on its source and target topics, with its relay events and crash markers."""

    def __init__(
        self,
        apps: Apps,
        client: Any,
        tmp_path: Path,
        make_topic: Callable[[int], str],
        names: Names,
        source_partitions: int,
        target_partitions: int,
    ) -> None:
        self.apps, self.client, self.tmp_path = apps, client, tmp_path
        self.source, self.target = make_topic(source_partitions), make_topic(target_partitions)
        self.source_partitions, self.target_partitions = source_partitions, target_partitions
        self.app = names.app()
        self.events = tmp_path / "events.jsonl"
        # A server new to the publishing script runs no call of a step until its replies are read
        # (NOSCRIPT, sent again then): the counts of calls in flight at a kill assume it is loaded.
        client.script_load(resources.files("pspf").joinpath("lua/publish.lua").read_text())

    def run(
        self,
        label: str,
        state_dir: Path,
        *args: str,
        crash: str | None = None,
        env: dict[str, str] | None = None,
        lease_ttl_ms: int = LEASE_TTL_MS,
    ) -> WorkerProcess:
        """Start a worker whose consumer (and relay) name is its label."""
        extra = {"PSPF_TEST_TARGET": self.target, "PSPF_TEST_EVENTS": str(self.events), **(env or {})}
        if crash:
            extra |= {"PSPF_TEST_CRASH": crash, "PSPF_TEST_MARKER": str(self.marker(label))}
        return self.apps.run(
            label,
            ENRICH,
            self.source,
            self.app,
            state_dir,
            "--consumer",
            label,
            *args,
            env=extra,
            lease_ttl_ms=lease_ttl_ms,
        )

    def marker(self, label: str) -> Path:
        return self.tmp_path / f"{label}.crashed"

    def report(self, label: str) -> dict[str, Any]:
        return dict(json.loads(self.marker(label).read_text()))

    def stopped(self, label: str, worker: WorkerProcess) -> dict[str, Any]:
        """Wait for a worker to stop itself (SIGSTOP at its crash point); its report."""
        wait_until(
            lambda: self.marker(label).exists() and process_state(worker.pid) == "T",
            60,
            f"{label} to stop itself",
        )
        return self.report(label)

    def leases_expired(self) -> None:
        wait_until(
            lambda: no_leases(self.client, self.source, self.app, self.source_partitions),
            10,
            "the leases to expire",
        )

    def holds_all(self, worker: WorkerProcess) -> bool:
        return held_by(self.client, self.source, self.app, self.source_partitions, worker.pid)

    def once_per_input(self) -> list[Output]:
        return assert_once_per_input(
            self.client, self.source, self.source_partitions, self.target, self.target_partitions, self.app
        )

    def in_target(self) -> int:
        return len(outputs(self.client, self.target, self.target_partitions))

    def rows(self, state_dir: Path) -> list[OutboxRowInfo]:
        """The rows of the stores under ``state_dir``."""
        return outbox_rows(self.apps.spawn.redis_url, self.app, state_dir)

    def backup_rows(self) -> list[OutboxRowInfo]:
        """The rows of the state backups in Redis."""
        return outbox_rows(self.apps.spawn.redis_url, self.app, self.tmp_path / "no-state", backups=True)

    def claimed_by(self, state_dir: Path, row: OutboxRowInfo) -> str | None:
        """The relay that claimed a row, as the store under ``state_dir`` says."""
        settings = Settings.load(
            {"PSPF_BROKER": self.apps.spawn.redis_url, "PSPF_STATE_DIR": str(state_dir)}, environ={}
        )
        service = Service(settings, local_state=True)
        try:
            return service.outbox.outbox_show(self.app, row.row_id).claimed_by
        finally:
            service.close()

    def all_published(self, state_dir: Path, inputs_: int) -> None:
        """Every row published, in the store and in the backup, numbered without gaps."""
        sources = inputs(self.client, self.source, self.source_partitions)
        assert len(sources) == inputs_
        for where, rows in (("store", self.rows(state_dir)), ("backup", self.backup_rows())):
            assert states(rows) == {RowState.PUBLISHED: inputs_}, f"rows in the {where}: {states(rows)}"
            assert_rows_numbered(rows, sources)

    def sent(self, pid: int | None = None, after_resume: bool = False) -> tuple[int, int]:
        """(rows sent, rows appended) over the publishing calls of every relay, or of one process.

        ``after_resume``: only the calls of that process after it was resumed (SIGCONT).
        """
        found = [e for e in events(self.events) if pid in (None, e["pid"])]
        if after_resume:
            resumed = [i for i, e in enumerate(found) if e["event"] == "resumed"]
            found = found[resumed[0] + 1 :] if resumed else []
        calls = [e for e in found if e["event"] == "sent"]
        return sum(e["rows"] for e in calls), sum(e["appended"] for e in calls)


# -- 2. named crash points of the relay, then a restart --------------------------------------------


@pytest.mark.parametrize(
    ("crash", "source_partitions", "target_partitions", "batch", "inputs_"),
    [
        pytest.param("claimed:3", 2, 3, 200, 3_000, id="after-claim"),
        pytest.param("sent-last:3", 2, 3, 200, 3_000, id="after-publish-before-marking"),
        pytest.param("sent-first:2", 1, 4, 400, 3_000, id="mid-step-between-target-partitions"),
        pytest.param("sent-first:1", 1, 1, 3 * PUBLISH_CHUNK, 4_000, id="mid-step-between-chunks"),
    ],
)
def test_a_kill_at_a_relay_step_then_a_restart_publishes_each_row_once(
    crash: str,
    source_partitions: int,
    target_partitions: int,
    batch: int,
    inputs_: int,
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    started = time.monotonic()
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, source_partitions, target_partitions)
    produce(chain.source, orders(inputs_, seed=71))
    state_dir = tmp_path / "state"

    first = chain.run("first", state_dir, "--batch-size", str(batch), "--until-idle", crash=crash)
    assert first.wait(60) == -9, f"the crash point was not reached\n{first.tail()}"
    report = chain.report("first")
    rows = chain.rows(state_dir)
    by_state = states(rows)
    published, in_target = by_state[RowState.PUBLISHED], chain.in_target()
    print(f"{crash}: killed at {report}; rows {dict(by_state)}, {in_target} in the target")
    # The step's rows are durably claimed (with rows of batches whose step is still to come);
    # what earlier steps published is marked PUBLISHED, and the target holds just that, plus the
    # rows whose calls were sent (other partitions' steps in flight, and this step's once sent).
    assert published < inputs_
    claimed = by_state[RowState.CLAIMED]
    in_flight = report["in_flight"]
    if report["where"] == "claimed":
        assert claimed >= report["rows"] > 0
        expected = published + in_flight
    else:  # sent-last, or sent-first: the step's calls ran, some replies unread
        assert claimed >= report["claimed"] > 0
        expected = published + report["claimed"] + in_flight
        if report["where"] == "sent-first":
            assert report["claimed"] > report["rows"] > 0 and report["unread"] > 0
            if target_partitions == 1:
                assert report["rows"] == PUBLISH_CHUNK
    # Calls sent before the kill have reached the server; give it the moment it takes to run them.
    wait_until(lambda: chain.in_target() >= expected, 10, f"{expected} entries in the target")
    in_target = chain.in_target()
    assert in_target == expected, "the target holds rows no publishing call had sent"
    unread = report.get("unread", 0) + in_flight
    assert chain.sent()[1] + unread == in_target, "the relay's publishing calls do not add up to the target"

    chain.leases_expired()
    again = chain.run("again", state_dir, "--batch-size", str(batch), "--until-idle")
    assert again.wait(60) == 0, again.tail()
    chain.once_per_input()
    chain.all_published(state_dir, inputs_)
    rows_sent, appended = chain.sent()
    # Rows whose calls ran but whose replies were never read were appended unrecorded.
    assert appended + unread == inputs_, f"appended {appended} + {unread} unread for {inputs_} inputs"
    # What reached the target unmarked is not sent again: the restart marks it from the target's
    # record of the producer (``Relay._published_before``), so rows_sent may stay below inputs_.
    print(f"{crash}: {rows_sent} rows sent for {inputs_}: {time.monotonic() - started:.1f}s")


# -- 3. two relays publishing the same rows ---------------------------------------------------------


@pytest.mark.parametrize("first", ["new-owner", "zombie"])
def test_a_zombie_relay_and_the_new_owner_publish_the_same_rows_and_each_appears_once(
    first: str,
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Host a stops itself right after its relay claimed rows (SIGSTOP); its lease expires and host
    b (another state dir: it restores state and rows from the backup) takes the partition over.

    new-owner: b publishes everything and finishes, then the zombie wakes up and publishes the rows
    it claimed. zombie: b stops right after claiming the same rows, the zombie wakes up and
    publishes them first, then b goes on and publishes them too. Either way both relays publish
    the same rows, and each appears once in the target.
    """
    started = time.monotonic()
    inputs_ = 3_000
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, 1, 3)
    produce(chain.source, orders(inputs_, seed=73))
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    slow = {"PSPF_TEST_WORK_US": "200"}  # host a is still reading when it stops

    a = chain.run("a", host_a, "--batch-size", "100", crash="stop-claimed:4", env=slow)
    zombie = chain.stopped("a", a)
    claimed = [row for row in chain.rows(host_a) if row.state == RowState.CLAIMED]
    assert len(claimed) >= zombie["rows"] > 0
    assert {chain.claimed_by(host_a, row) for row in (claimed[0], claimed[-1])} == {"a"}
    assert chain.in_target() < inputs_
    chain.leases_expired()

    # b's leases outlive the stops: the zombie cannot take the partition back while b runs.
    b_args = ["--batch-size", "100", "--until-idle"]
    if first == "new-owner":
        b = chain.run("b", host_b, *b_args, lease_ttl_ms=30_000)
        assert b.wait(60) == 0, b.tail()
        chain.once_per_input()
    else:
        b = chain.run("b", host_b, *b_args, crash="stop-claimed:1", lease_ttl_ms=30_000)
        b_claim = chain.stopped("b", b)
        assert chain.holds_all(b)
        b_claimed = {row.row_id for row in chain.rows(host_b) if row.state == RowState.CLAIMED}
        assert len(b_claimed) >= b_claim["rows"]
        assert {row.row_id for row in claimed} <= b_claimed, "b did not claim the zombie's rows"
    assert "state backup restored" in b.log.read_text(), b.tail()

    # The zombie wakes up: it publishes the rows it claimed, then finds its lease gone.
    os.kill(a.pid, signal.SIGCONT)
    wait_until(lambda: chain.sent(a.pid, after_resume=True)[0] >= zombie["rows"], 30, "the zombie to publish")
    wait_until(
        lambda: "partition released" in a.log.read_text() or not a.alive(), 30, "the zombie to give up"
    )
    zombie_sent, zombie_appended = chain.sent(a.pid, after_resume=True)
    if first == "new-owner":
        assert zombie_appended == 0, f"the zombie appended {zombie_appended} rows b had published"
    else:
        assert zombie_appended > 0, "the zombie published nothing new: no race"
        os.kill(b.pid, signal.SIGCONT)
        assert b.wait(60) == 0, b.tail()
    assert a.alive(), f"the zombie exited instead of giving the partition up\n{a.tail()}"
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.tail()

    chain.once_per_input()
    chain.all_published(host_b, inputs_)
    rows_sent, appended = chain.sent()
    assert appended == inputs_ and rows_sent >= inputs_ + zombie_sent, (rows_sent, appended, zombie_sent)
    print(f"zombie ({first}): {zombie_sent} rows sent again, {time.monotonic() - started:.1f}s")


# -- 4. the partition moves to another host with rows still waiting --------------------------------


#: Rows retry a broken target every few hundred milliseconds, and never go DEAD in these tests.
RETRY_FAST = {
    "PSPF_OUTBOX_RETRY_BASE_MS": "50",
    "PSPF_OUTBOX_RETRY_MAX_MS": "300",
    "PSPF_OUTBOX_MAX_ATTEMPTS": "10000",
}


def break_target(client: Any, topic: str, partition: int) -> None:
    """Replace a target partition's stream by a string: publishing to it fails (WRONGTYPE)."""
    client.delete(stream_key(topic, partition))
    client.set(stream_key(topic, partition), "not a stream")


def test_rows_waiting_for_a_broken_target_move_with_the_partition_and_are_published_once(
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Rows to a broken target partition (a string where its stream was: WRONGTYPE) wait on host a,
    with their failed attempts, while the rest is published; host a is SIGKILLed, the target
    repaired, and host b (another state dir: it restores state and rows from the backup) publishes
    the rows that waited, once each, and nothing else again."""
    started = time.monotonic()
    inputs_, broken = 2_000, 1
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, 2, 3)
    produce(chain.source, orders(inputs_, seed=79))
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    break_target(rclient, chain.target, broken)

    # Host a handles every input; rows to the broken partition fail and wait, the others publish.
    a = chain.run("a", host_a, "--batch-size", "200", env=RETRY_FAST)

    def failed_twice_in_backup() -> bool:
        assert a.alive(), a.tail()
        rows = chain.backup_rows()
        return (
            backup_applied(rclient, chain.source, chain.app, chain.source_partitions) == inputs_
            and len(rows) == inputs_
            and all(
                (row.state == RowState.PENDING and row.attempts >= 2)
                if row.partition == broken
                else row.state == RowState.PUBLISHED
                for row in rows
            )
        )

    wait_until(
        failed_twice_in_backup, 60, "the backup to hold every input, rows waiting for the broken target"
    )
    waiting = [row for row in chain.backup_rows() if row.partition == broken]
    assert waiting and all("WRONGTYPE" in (row.last_error or "") for row in waiting)
    assert a.kill9() == -9
    assert rclient.type(stream_key(chain.target, broken)) == b"string"
    in_target = chain.in_target()
    assert in_target == inputs_ - len(waiting)

    # The target is repaired; host b restores state and rows from the backup and publishes them.
    rclient.delete(stream_key(chain.target, broken))
    chain.leases_expired()
    b = chain.run("b", host_b, "--batch-size", "200", "--until-idle")
    assert b.wait(60) == 0, b.tail()
    assert b.log.read_text().count("state backup restored") == 2, b.tail()
    outs = chain.once_per_input()
    assert sum(out.partition == broken for out in outs) == len(waiting)
    chain.all_published(host_b, inputs_)
    moved = {row.row_id: row for row in chain.rows(host_b) if row.partition == broken}
    assert set(moved) == {row.row_id for row in waiting}, "b published other rows than those waiting on a"
    # Each kept its failed attempts. A row a held claimed when it was killed was reaped by b at the
    # takeover: one attempt more, and the reap is its last error (the seed's CLAIMED -> PENDING).
    for row in waiting:
        last_error = moved[row.row_id].last_error or ""
        assert moved[row.row_id].attempts >= row.attempts, (row, moved[row.row_id])
        assert "WRONGTYPE" in last_error or "claim of a reaped at takeover" in last_error, moved[row.row_id]
    b_sent, b_appended = chain.sent(b.pid)
    assert b_appended == len(waiting), (b_sent, b_appended, len(waiting))
    print(f"moved with {len(waiting)} rows waiting: {time.monotonic() - started:.1f}s")


# -- a relay step in an idle cycle after the lease moved on ----------------------------------------


def test_a_zombie_whose_idle_relay_step_outlived_its_lease_gives_the_partition_up_and_keeps_running(
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Rows wait for a broken target, so the relay retries them in cycles that read nothing. Host a
    stops itself right after such a step settled (its failures are journaled, not yet in the
    backup); its lease expires and host b takes the partition. Woken up, host a must find its lease
    gone and give the partition up, like after a refused acknowledgement: the cycle's backup flush
    (``run_once`` after a cycle that read nothing) is refused, and that is no reason to exit.
    """
    inputs_ = 100
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, 1, 1)
    produce(chain.source, orders(inputs_, seed=83))
    break_target(rclient, chain.target, 0)

    # The first step settles in the cycle that read the inputs; the second in one that read nothing.
    a = chain.run("a", tmp_path / "host-a", "--batch-size", "1000", crash="stop-settled:2", env=RETRY_FAST)
    report = chain.stopped("a", a)
    assert report["failed"] > 0 and report["published"] == 0, report
    chain.leases_expired()
    b = chain.run("b", tmp_path / "host-b", "--until-idle", env=RETRY_FAST, lease_ttl_ms=30_000)
    wait_until(lambda: chain.holds_all(b), 30, "b to take the partition")

    os.kill(a.pid, signal.SIGCONT)
    wait_until(lambda: "partition released" in a.log.read_text() or not a.alive(), 30, "a to give up")
    time.sleep(0.5)
    zombie_alive, zombie_log = a.alive(), a.tail()

    rclient.delete(stream_key(chain.target, 0))  # repaired: b publishes the rows, once
    assert b.wait(60) == 0, b.tail()
    chain.once_per_input()
    assert zombie_alive, f"the zombie exited instead of giving the partition up\n{zombie_log}"
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(30) == 0, a.tail()


# -- a takeover that restores an emitting app's large backups --------------------------------------


#: Short leases, so that restoring these backups (a fraction of a second each) is long for them.
TAKEOVER_LEASE_TTL_MS = 600


def test_a_worker_restoring_large_backups_keeps_the_leases_it_took_first(
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Published rows stay in the state backup for the retention (300 s by default), so an emitting
    app's backups grow with what it emits, and a new owner restores them whole. Host a emits
    30,000 rows over four partitions; host b (an empty state dir) takes them over, each restored
    from its backup, and then owns them alone: it must keep each lease it took.

    Leases are renewed between lease rounds (every third of their TTL) and, during a restore, by
    ``keep_alive`` only once that one partition's restore has lasted a third of the TTL: when the
    takeovers of one round add up to more than two thirds of the TTL, the lease taken first
    expires before its first renewal, and the partition is lost and restored again.
    """
    inputs_, partitions = 30_000, 4
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, partitions, 1)
    produce(chain.source, orders(inputs_, seed=89))
    a = chain.run("a", tmp_path / "host-a", "--batch-size", "200", "--until-idle")
    assert a.wait(120) == 0, a.tail()
    chain.once_per_input()
    assert len(chain.backup_rows()) == inputs_  # every published row is kept, in the backups too
    chain.leases_expired()

    b = chain.run("b", tmp_path / "host-b", lease_ttl_ms=TAKEOVER_LEASE_TTL_MS)
    wait_until(
        lambda: b.log.read_text().count("partition assigned") >= partitions, 60, "b to take every partition"
    )
    took = b.log.read_text()
    time.sleep(2.0)  # several lease rounds
    log = b.log.read_text()
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(30) == 0, b.tail()
    restores = re.findall(
        r"state backup restored app=\S+ partition=(\d) values=(\d+) \(a full restore\) in (\S+)s", took
    )
    print(f"b's restores (partition, values, seconds): {restores}")
    lost = [
        line for line in log.splitlines() if "lease expired or taken over" in line or "lease lost" in line
    ]
    assert not lost and log.count("partition assigned") == partitions, (
        f"b lost leases it had just taken ({len(lost)} times) and took partitions "
        f"{log.count('partition assigned')} times for {partitions}\n" + "\n".join(lost[:4])
    )
    chain.once_per_input()


# -- 6. the target repartitioned while rows published before a kill were not yet marked --------------


def test_rows_published_before_a_kill_are_not_routed_again_when_the_target_is_repartitioned(
    apps: Apps,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Killed after a publishing call, before its rows were marked; the target goes 4 -> 3; the
    restarted app routes its waiting rows again for 3 partitions, but not the rows the target's
    records say were appended (they moved with the topic): each input once, in its key's partition.
    """
    chain = Emitting(apps, rclient, tmp_path, make_topic, names, 2, 4)
    inputs_ = 3_000
    produce(chain.source, orders(inputs_, seed=79))
    state_dir = tmp_path / "state"
    first = chain.run("first", state_dir, "--batch-size", "200", "--until-idle", crash="sent-last:3")
    assert first.wait(60) == -9, f"the crash point was not reached\n{first.tail()}"
    report = chain.report("first")
    assert report["claimed"] > 0  # rows appended, their marks lost
    published = states(chain.rows(state_dir))[RowState.PUBLISHED]
    wait_until(lambda: chain.in_target() >= published + report["claimed"], 10, "the sent rows in the target")
    chain.leases_expired()

    broker = Broker(Settings.load({"PSPF_BROKER": apps.spawn.redis_url}, environ={}).redis)
    Repartition(broker, make_plan(broker, chain.target, 3)).run()
    broker.close()
    again = chain.run("again", state_dir, "--batch-size", "200", "--until-idle")
    assert again.wait(60) == 0, again.tail()

    want = inputs(rclient, chain.source, 2)
    got = outputs(rclient, chain.target, 3)
    seen = Counter(out.source for out in got)
    assert [s for s, n in seen.items() if n > 1] == [] and seen.keys() == want.keys()
    last: dict[tuple[str, int], tuple[int, int]] = {}
    for out in got:  # partition by partition, in stream order
        assert out.partition == partition_for(out.key.encode(), 3), out
        lane = (out.key, out.source[0])  # one producer's rows of one key keep their order
        assert lane not in last or last[lane] < _id(out.source[1]), out
        last[lane] = _id(out.source[1])
    for where, rows in (("store", chain.rows(state_dir)), ("backup", chain.backup_rows())):
        assert states(rows) == {RowState.PUBLISHED: inputs_}, f"rows in the {where}: {states(rows)}"
