"""What the two dataflow crash tests share (``test_dataflow_crash``, ``test_dataflow_pipelines_crash``).

Both run an app of ``tests.crash.dataflow_apps`` whose first chain is the spend pipeline (orders
re-keyed by customer through the managed topic ``<orders>-by-customer``, summed and counted in
tumbling one-minute windows, each closed window's result to a topic), in ``pspf run`` workers one
at a time on two machines in turn (a state dir and a consumer name of each), SIGKILLed at random
moments; then a last worker on a third, fresh state dir, run until idle. ``Flow`` is the app's
topics, its workers, the orders, what the state backups hold and what the spend pipeline's outputs
must be; each test adds its own inputs, outputs and kill plan.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pspf import codec
from pspf.keys import StreamId, backup_meta_key, dlq_key, partition_for, stream_key, topic_key
from pspf.outbox.emit import SOURCE_APP_HEADER, SOURCE_TOPIC_HEADER
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import WorkerProcess, held_by, no_leases
from tests.crash.test_outbox_crash import Output, outputs
from tests.integration.test_dataflow import MINUTE, expected_spend
from tests.support import wait_until

PARTITIONS, OUT_PARTITIONS = 3, 2
LEASE_TTL_MS = 1000
#: Busy work per order (in the spend pipeline's filter): the kills land mid-stream.
WORK_US = 600
#: Small batches: re-keying interleaves the source partitions by publish time, and a batch of a
#: thousand orders of one partition ahead of the others would be more than the grace.
OPTIONS = ["--batch-size", "20", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
MACHINES = ["host-a", "host-b"]
#: Where the workers of some lives kill themselves in their outbox relay (``dataflow_apps``).
RELAY_POINTS = ("sent-last", "sent-first", "claimed")
LATE = "late entries dropped"

Order = dict[str, Any]


def pick_seed() -> int:
    """``PSPF_TEST_SEED``, or a random seed; printed, to repeat the run."""
    value = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {value} (set PSPF_TEST_SEED to repeat)")
    return value


def takeovers(tmp_path: Path, machine: str) -> Counter[str]:
    """How the workers of ``machine`` took their partitions, from their logs."""
    found: Counter[str] = Counter()
    for log in tmp_path.glob(f"{machine}-*.log"):
        found.update(re.findall(r"state backup (\w+(?: up| sync)?) app=", log.read_text()))
    return found


def until(worker: WorkerProcess, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait for ``done``, or for the worker to die (the caller tells which)."""
    wait_until(lambda: done() or not worker.alive(), timeout, what, interval=0.05)


def kill9(worker: WorkerProcess) -> None:
    """SIGKILL a worker that must still be alive."""
    assert worker.alive(), f"the worker exited by itself\n{worker.tail()}"
    assert worker.kill9() == -9


class Flow:
    """A dataflow app under test: its topics, its workers, the orders and where they went.

    ``inputs`` are the app's input topics, the orders first (the app's first topic: it holds the
    state backups, with every topic's checkpoint), all keyed by customer; the closing orders
    (``closing``) come after every other input. A subclass sets ``target`` (the app), ``work``
    (what ``progress`` reaches once every input is handled) and ``total_inputs``, and writes
    orders (``send_orders``).
    """

    target: str
    work: int

    def __init__(
        self,
        spawn: Spawner,
        client: Any,
        tmp_path: Path,
        names: Names,
        inputs: tuple[str, ...],
        windows_out: str,
        orders: list[Order],
        closing: list[Order],
    ) -> None:
        self.spawn, self.client, self.tmp_path = spawn, client, tmp_path
        self.inputs, self.orders_topic, self.windows_out = inputs, inputs[0], windows_out
        self.rekey = f"{self.orders_topic}-by-customer"
        self.app = names.app()
        assert client.hget(topic_key(self.rekey), "partitions") is None  # the app creates it
        self.orders, self.closing = orders, closing
        self.expected = expected_spend(orders)
        #: orders to re-key (a positive quantity), before the closing orders
        self.positive = sum(1 for o in orders if o["qty"] > 0)
        #: input entries written so far (the subclass counts them)
        self.total_inputs = 0
        #: entry ids of each (topic, partition) known so far, in stream order
        self.ids: dict[tuple[str, int], list[StreamId]] = {}
        self.workers: list[WorkerProcess] = []
        #: the outputs by kind: their topic, its partitions, and what names an output (each is in
        #: its topic once); a subclass adds its own
        self.kinds: dict[str, tuple[str, int, Callable[[Output], Any]]] = {
            "windows": (windows_out, OUT_PARTITIONS, lambda out: (out.value["key"], out.value["start"])),
            # a re-keyed value: named by its order's entry
            "rekeyed": (self.rekey, PARTITIONS, lambda out: out.source),
        }

    # -- the workers ----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The app's variables (``dataflow_apps``) besides its orders topic and its name."""
        return {"PSPF_TEST_REKEY": self.rekey, "PSPF_TEST_TARGET": self.windows_out}

    def run(self, machine: str, label: str, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        """A worker on ``machine``: its state dir and consumer name are the machine's."""
        worker = self.spawn(
            label,
            self.orders_topic,
            self.app,
            *OPTIONS,
            "--broker",
            self.spawn.redis_url,
            "--state-dir",
            str(self.tmp_path / machine),
            "--consumer",
            machine,
            *args,
            env={**self.env(), "PSPF_TEST_WORK_US": str(WORK_US), **(env or {})},
            cli_settings=False,
            target=self.target,
        )
        self.workers.append(worker)
        return worker

    def start(self, life: int, relay: int | None, rng: random.Random) -> tuple[WorkerProcess, dict[str, str]]:
        """The worker of ``life``, on each machine in turn, and its crash variables: with ``relay``,
        it SIGKILLs itself at ``RELAY_POINTS[relay]`` (round) of its outbox relay, at a random call."""
        machine = MACHINES[life % 2]
        crash: dict[str, str] = {}
        if relay is not None:
            where = RELAY_POINTS[relay % len(RELAY_POINTS)]
            marker = self.tmp_path / f"relay-{life}.json"
            crash = {"PSPF_TEST_CRASH": f"{where}:{rng.randint(2, 30)}", "PSPF_TEST_MARKER": str(marker)}
        return self.run(machine, f"{machine}-{life}", env=crash), crash

    def until_holds_all(self, worker: WorkerProcess) -> None:
        until(
            worker,
            lambda: held_by(self.client, self.orders_topic, self.app, PARTITIONS, worker.pid),
            "the worker to take every partition",
        )

    def died_in_relay(self, worker: WorkerProcess, crash: dict[str, str], life: int) -> str | None:
        """Wait for the worker to die at its crash point, or for all the work to be done; where its
        relay killed it (its marker's report), or None if it still lives."""
        point = crash["PSPF_TEST_CRASH"]
        until(worker, lambda: self.progress() >= self.work, f"the worker to die at {point}")
        if worker.alive():
            return None
        assert worker.wait(10) == -9, worker.tail()
        report = json.loads(Path(crash["PSPF_TEST_MARKER"]).read_text())
        print(f"life {life} died at {point}: {report}")
        return str(report["where"])

    def until_share(self, worker: WorkerProcess, target: int, rng: random.Random) -> None:
        """Wait for the backups to hold ``target`` input entries, then a moment more."""
        until(worker, lambda: self.inputs_in_backups() >= target, f"the backups to reach {target} inputs")
        time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a cycle: handling, commit, ack, relay

    def leases_expired(self) -> None:
        wait_until(
            lambda: no_leases(self.client, self.orders_topic, self.app, PARTITIONS),
            10,
            "the killed worker's leases to expire",
        )

    def assert_restored_on_each_machine(self) -> None:
        for machine in MACHINES:
            taken = takeovers(self.tmp_path, machine)
            print(f"{machine} took partitions: {dict(taken)}")
            assert taken["restored"], f"{machine} never restored a partition from its backup: {dict(taken)}"

    def send_orders(self, orders: list[Order]) -> int:
        """Write ``orders`` to the orders topic; how many were written."""
        raise NotImplementedError

    def produce_closing(self) -> None:
        assert self.send_orders(self.closing) == len(self.closing)
        self.total_inputs += len(self.closing)

    def run_final(self) -> tuple[int, int]:
        """The closing orders, then a last worker on a third, fresh state dir (``host-c``), run until
        idle: it exits 0, restores every partition, fails nothing; what it handled (and skipped)."""
        self.produce_closing()
        final = self.run("host-c", "host-c-final", "--until-idle")
        assert final.wait(timeout=120) == 0, final.tail()
        assert takeovers(self.tmp_path, "host-c")["restored"] == PARTITIONS, final.tail()
        handled, skipped, failures = final.summary()
        assert failures == 0, final.tail()
        return handled, skipped

    # -- progress, from the state backups -------------------------------------------------------

    def in_backup(self, topic: str, partition: int) -> int:
        """Entries of one topic partition at or below its backup's checkpoint."""
        # The backup of a partition lives beside the app's first topic, with every topic's checkpoint.
        raw = self.client.hget(backup_meta_key(self.orders_topic, partition, self.app), f"cp:{topic}")
        if raw is None:
            return 0
        checkpoint = StreamId.parse(raw)
        ids = self.ids.setdefault((topic, partition), [])
        if not ids or ids[-1] < checkpoint:
            low = f"({ids[-1]}" if ids else "-"
            ids += [StreamId.parse(i) for i, _ in self.client.xrange(stream_key(topic, partition), low, "+")]
        return bisect.bisect_right(ids, checkpoint)

    def inputs_in_backups(self) -> int:
        return sum(self.in_backup(t, p) for t in self.inputs for p in range(PARTITIONS))

    def progress(self) -> int:
        """The work done (of ``work``), from the backups: here the input entries in them."""
        return self.inputs_in_backups()

    def all_rekeyed(self) -> bool:
        """Every input entry is in the backups, and every re-keyed value in the re-keying topic."""
        if self.inputs_in_backups() < self.total_inputs:
            return False
        published = sum(self.client.xlen(stream_key(self.rekey, p)) for p in range(PARTITIONS))
        return bool(published == self.positive)

    # -- the outputs ----------------------------------------------------------------------------

    def outputs(self) -> dict[str, list[Output]]:
        return {kind: outputs(self.client, topic, n) for kind, (topic, n, _) in self.kinds.items()}

    def assert_once(self) -> dict[str, int]:
        """No output in its topic twice (also while they come); how many of each there are."""
        found = self.outputs()
        for kind, outs in found.items():
            identity = self.kinds[kind][2]
            seen = Counter(identity(out) for out in outs)
            twice = sorted(name for name, n in seen.items() if n > 1)
            assert not twice, f"{len(twice)} of {len(seen)} {kind} emitted more than once: {twice[:5]}"
        return {kind: len(outs) for kind, outs in found.items()}

    def after_kill(self, progress: list[int]) -> dict[str, int]:
        """After a kill: the backups' ``progress`` (appended) did not go backwards, no output is in
        its topic twice; how many of each there are."""
        progress.append(self.progress())
        assert progress[-1] >= progress[-2], f"the state backup went backwards: {progress}"
        return self.assert_once()

    def assert_windows(self, results: list[Output]) -> None:
        """Each window's result once, equal to ``expected_spend``, and nothing else."""
        seen = Counter((out.value["key"], out.value["start"]) for out in results)
        twice = sorted(window for window, n in seen.items() if n > 1)
        got = {(o.value["key"], o.value["start"]): (o.value["total"], o.value["n"]) for o in results}
        want = self.expected
        missing = sorted(want.keys() - got.keys())
        extra = sorted(got.keys() - want.keys())
        wrong = {w: (got[w], want[w]) for w in want.keys() & got.keys() if got[w] != want[w]}
        assert not (twice or missing or extra or wrong), (
            f"{len(results)} results for {len(want)} windows: {len(twice)} emitted more than once "
            f"{twice[:5]}, {len(missing)} never {missing[:5]}, {len(extra)} unknown {extra[:5]}, "
            f"{len(wrong)} wrong ((total, n) got, want) {dict(list(wrong.items())[:5])}"
        )
        assert len(results) == len(want)
        for out in results:
            assert set(out.value) == {"key", "start", "end", "total", "n"}, out
            assert out.value["end"] == out.value["start"] + MINUTE, out
            assert out.key == out.value["key"], out
            assert out.partition == partition_for(out.key.encode(), OUT_PARTITIONS), out
            assert out.headers[SOURCE_APP_HEADER] == self.app, out

    def assert_rekeyed(self, rekeyed: list[Output]) -> None:
        """The re-keying topic holds each order with a positive quantity once (closing orders too),
        as its map made it, from that order's entry, under its customer; and nothing else."""
        by_source: dict[tuple[int, str], Order] = {}
        for p in range(PARTITIONS):
            for entry_id, fields in self.client.xrange(stream_key(self.orders_topic, p)):
                by_source[(p, entry_id.decode())] = json.loads(fields[codec.VALUE])
        assert self.client.hget(topic_key(self.rekey), "partitions") == str(PARTITIONS).encode()
        sources = Counter(out.source for out in rekeyed)
        again = sorted(source for source, n in sources.items() if n > 1)
        want = {s for s, o in by_source.items() if o["qty"] > 0}
        missing = sorted(want - sources.keys())
        foreign = sorted(sources.keys() - want)
        assert not (again or missing or foreign), (
            f"{len(rekeyed)} entries in the re-keying topic for {len(want)} orders to re-key: "
            f"{len(again)} more than once {again[:5]}, {len(missing)} never {missing[:5]}, "
            f"{len(foreign)} unknown {foreign[:5]}"
        )
        assert len(rekeyed) == self.positive + len(self.closing)
        for out in rekeyed:
            order = by_source[out.source]
            amount = order["qty"] * order["price"]
            assert out.value == {"customer": order["customer"], "amount": amount, "ts": order["ts"]}, out
            assert out.key == order["customer"], out
            assert out.partition == partition_for(out.key.encode(), PARTITIONS), out
            assert out.headers[SOURCE_TOPIC_HEADER] == self.orders_topic, out

    def assert_clean(self) -> None:
        """No DLQ entry, nothing pending in the inputs or the re-keying topic, no worker logged a
        late entry or a traceback."""
        for topic in (*self.inputs, self.rekey):
            for p in range(PARTITIONS):
                assert self.client.xlen(dlq_key(topic, p)) == 0, f"DLQ entries in {topic} partition {p}"
                pending = self.client.xpending(stream_key(topic, p), self.app)["pending"]
                assert pending == 0, f"{pending} entries still pending in {topic} partition {p}"
        for worker in self.workers:
            text = worker.log.read_text(errors="replace")
            assert LATE not in text, worker.tail()
            assert "Traceback" not in text, worker.tail()
