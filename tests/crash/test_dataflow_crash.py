"""The spend pipeline of the dataflow API under SIGKILL: each window's result once, exact.

Orders (``tests.integration.test_dataflow``' ``make_orders``: 5,000 of 12 customers, over about
42 minutes of event time) on a 3-partition topic; real ``pspf run`` workers of
``tests.crash.dataflow_apps:spend`` filter them, map them to amounts, re-key them by customer
through the managed re-keying topic (created by the first worker), sum and count them per
customer in tumbling one-minute windows with a grace of ten minutes, and publish each closed
window's result to a 2-partition topic. One worker at a time, on two machines in turn (a state dir
and a consumer name of each): each is SIGKILLed at a random moment, some soon after taking the
partitions (restoring them), most once the backups reached a share of the orders, so the kills
land while orders are re-keyed and windows close; the next worker, on the other machine, takes
the partitions with their open windows and the rows not yet published from the state backups.
The last of them is killed only once every order is re-keyed, with the last windows still open.

Only then come the closing orders (one per customer an hour later: they close every window of the
orders), and a last worker on a third, fresh state dir, run until idle. Produced earlier, the
closing order of a partition with fewer orders left would be re-keyed before the last orders of
another, an hour ahead of them in the re-keying topic: those would be late, and dropped, by design
(the grace covers the interleaving of partitions that keep pace, not a backlog).

The output topic must hold exactly ``expected_spend(orders)``, each window once and nothing else;
the re-keying topic each re-keyed value once, from its own order, plus the closing orders; no DLQ
entry, no late entry dropped (a worker logs the first one at once), nothing pending. After each
kill no window is in the output twice, no order in the re-keying topic twice, and that topic holds
no more than the backups committed.

Some lives end in the outbox relay instead (``tests.crash.apps_outbox.RelayCrashHooks``): the
worker SIGKILLs itself when a step claimed its rows, after the first of a step's publishing calls,
or after the last one (every row in its topic, none marked published): the next owner must
publish the rest, and none again.

``PSPF_TEST_DATAFLOW_ORDERS`` and ``PSPF_TEST_DATAFLOW_KILLS`` resize it; ``PSPF_TEST_SEED``
repeats the orders and the kill times.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import codec
from pspf.keys import StreamId, dlq_key, partition_for, stream_key, topic_key
from pspf.outbox.emit import SOURCE_APP_HEADER, SOURCE_TOPIC_HEADER
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import WorkerProcess, backup_checkpoint, held_by, no_leases
from tests.crash.test_outbox_crash import Output, outputs
from tests.integration.test_dataflow import MINUTE, closing_orders, expected_spend, make_orders
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.dataflow_apps:spend"
PARTITIONS, OUT_PARTITIONS = 3, 2
ORDERS = int(os.environ.get("PSPF_TEST_DATAFLOW_ORDERS", "5000"))
KILLS = int(os.environ.get("PSPF_TEST_DATAFLOW_KILLS", "12"))
LEASE_TTL_MS = 1000
#: Busy work per order (in the filter): the kills land mid-stream.
WORK_US = 600
#: Small batches: re-keying interleaves the source partitions by publish time, and a batch of a
#: thousand orders of one partition ahead of the others would be more than the grace.
OPTIONS = ["--batch-size", "20", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
MACHINES = ["host-a", "host-b"]
#: Where the workers of some lives kill themselves in their outbox relay (``dataflow_apps``).
RELAY_POINTS = ("sent-last", "sent-first", "claimed")
LATE = "late entries dropped"


class Spend:
    """The pipeline's topics, its app, the orders and where they went."""

    def __init__(
        self,
        spawn: Spawner,
        client: Any,
        tmp_path: Path,
        make_topic: Callable[[int], str],
        produce: Callable[..., int],
        names: Names,
        seed: int,
    ) -> None:
        self.spawn, self.client, self.tmp_path = spawn, client, tmp_path
        self.orders_topic, self.out = make_topic(PARTITIONS), make_topic(OUT_PARTITIONS)
        self.rekey = f"{self.orders_topic}-by-customer"
        self.app = names.app()
        assert client.hget(topic_key(self.rekey), "partitions") is None  # the app creates it
        self.orders = make_orders(ORDERS, seed)
        self.closing = closing_orders(self.orders)
        self.expected = expected_spend(self.orders)
        self.produce = produce
        assert produce(self.orders_topic, [(o["oid"], o) for o in self.orders]) == ORDERS
        self.ids = self.entry_ids()
        self.workers: list[WorkerProcess] = []

    def entry_ids(self) -> dict[int, list[StreamId]]:
        """Each orders partition's entry ids, in stream order; which of them are re-keyed."""
        found: dict[int, list[StreamId]] = {}
        self.kept: dict[int, list[int]] = {}  # per partition: orders re-keyed up to each entry
        for p in range(PARTITIONS):
            entries = self.client.xrange(stream_key(self.orders_topic, p))
            found[p] = [StreamId.parse(i) for i, _ in entries]
            positive = [int(json.loads(fields[codec.VALUE])["qty"] > 0) for _, fields in entries]
            self.kept[p] = list(itertools.accumulate(positive, initial=0))
        return found

    def produce_closing(self) -> None:
        assert self.produce(self.orders_topic, [(o["oid"], o) for o in self.closing]) == len(self.closing)
        self.ids = self.entry_ids()

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
            env={
                "PSPF_TEST_REKEY": self.rekey,
                "PSPF_TEST_TARGET": self.out,
                "PSPF_TEST_WORK_US": str(WORK_US),
                **(env or {}),
            },
            cli_settings=False,
            target=TARGET,
        )
        self.workers.append(worker)
        return worker

    def in_backups(self) -> int:
        """Orders at or below the checkpoints of the state backups (what a new owner starts from)."""
        done = 0
        for p, ids in self.ids.items():
            checkpoint = backup_checkpoint(self.client, self.orders_topic, self.app, p)
            done += 0 if checkpoint is None else bisect.bisect_right(ids, checkpoint)
        return done

    def all_rekeyed(self) -> bool:
        """Every order is in the backups, and every re-keyed value in the re-keying topic."""
        if self.in_backups() < ORDERS:
            return False
        published = sum(self.client.xlen(stream_key(self.rekey, p)) for p in range(PARTITIONS))
        return bool(published == sum(1 for o in self.orders if o["qty"] > 0))

    def committed_rekeys(self) -> int:
        """Re-keyed values of the orders at or below the backups' checkpoints: committed, to publish."""
        done = 0
        for p, ids in self.ids.items():
            checkpoint = backup_checkpoint(self.client, self.orders_topic, self.app, p)
            done += 0 if checkpoint is None else self.kept[p][bisect.bisect_right(ids, checkpoint)]
        return done

    def results(self) -> list[Output]:
        return outputs(self.client, self.out, OUT_PARTITIONS)

    def rekeyed(self) -> list[Output]:
        return outputs(self.client, self.rekey, PARTITIONS)

    def assert_once(self) -> tuple[int, int]:
        """No window result in the output twice, no order re-keyed twice (also while they come);
        how many of each there are."""
        results = self.results()
        seen = Counter((out.value["key"], out.value["start"]) for out in results)
        twice = sorted(window for window, n in seen.items() if n > 1)
        assert not twice, f"{len(twice)} of {len(seen)} windows emitted more than once: {twice[:5]}"
        rekeyed = self.rekeyed()
        sources = Counter(out.source for out in rekeyed)
        again = sorted(source for source, n in sources.items() if n > 1)
        assert not again, f"{len(again)} of {len(sources)} orders re-keyed more than once: {again[:5]}"
        return len(results), len(rekeyed)

    def assert_results(self) -> None:
        """The output holds each window's result once, equal to ``expected_spend``, and nothing else."""
        results = self.results()
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

    def assert_rekeyed(self) -> None:
        """The re-keying topic holds each order with a positive quantity once, as its map made it,
        from that order's entry, under its customer; and nothing else."""
        by_source: dict[tuple[int, str], dict[str, Any]] = {}
        for p in range(PARTITIONS):
            for entry_id, fields in self.client.xrange(stream_key(self.orders_topic, p)):
                by_source[(p, entry_id.decode())] = json.loads(fields[codec.VALUE])
        assert self.client.hget(topic_key(self.rekey), "partitions") == str(PARTITIONS).encode()
        rekeyed = self.rekeyed()
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
        assert len(rekeyed) == sum(1 for o in self.orders if o["qty"] > 0) + len(self.closing)
        for out in rekeyed:
            order = by_source[out.source]
            amount = order["qty"] * order["price"]
            assert out.value == {"customer": order["customer"], "amount": amount, "ts": order["ts"]}, out
            assert out.key == order["customer"], out
            assert out.partition == partition_for(out.key.encode(), PARTITIONS), out
            assert out.headers[SOURCE_TOPIC_HEADER] == self.orders_topic, out

    def assert_clean(self) -> None:
        """No DLQ entry, nothing pending in either topic, no worker logged a late entry or a traceback."""
        for topic in (self.orders_topic, self.rekey):
            for p in range(PARTITIONS):
                assert self.client.xlen(dlq_key(topic, p)) == 0, f"DLQ entries in {topic} partition {p}"
                pending = self.client.xpending(stream_key(topic, p), self.app)["pending"]
                assert pending == 0, f"{pending} entries still pending in {topic} partition {p}"
        for worker in self.workers:
            text = worker.log.read_text(errors="replace")
            assert LATE not in text, worker.tail()
            assert "Traceback" not in text, worker.tail()


def takeovers(spend: Spend, machine: str) -> Counter[str]:
    """How the workers of ``machine`` took their partitions, from their logs."""
    found: Counter[str] = Counter()
    for log in spend.tmp_path.glob(f"{machine}-*.log"):
        found.update(re.findall(r"state backup (\w+(?: up| sync)?) app=", log.read_text()))
    return found


def until(worker: WorkerProcess, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Wait for ``done``, or for the worker to die (the caller tells which)."""
    wait_until(lambda: done() or not worker.alive(), timeout, what, interval=0.05)


def live_and_die(spend: Spend, life: int, rng: random.Random) -> str | None:
    """Run a worker, on each machine in turn, and SIGKILL it; where its relay killed it, if there.

    Every fourth life from the second, the worker kills itself at a step of its outbox relay (a
    step picked at random); the last waits for every order to be re-keyed; every fourth from the
    fourth is killed right after it took the partitions (restoring them, barely started); the
    others once the backups reached a share of the orders (up to four fifths), a little after.
    """
    machine = MACHINES[life % 2]
    crash: dict[str, str] = {}
    if life % 4 == 1 and life < KILLS - 1:
        where = RELAY_POINTS[(life // 4) % len(RELAY_POINTS)]
        marker = spend.tmp_path / f"relay-{life}.json"
        crash = {"PSPF_TEST_CRASH": f"{where}:{rng.randint(2, 30)}", "PSPF_TEST_MARKER": str(marker)}
    worker = spend.run(machine, f"{machine}-{life}", env=crash)
    client, topic, app = spend.client, spend.orders_topic, spend.app
    until(
        worker,
        lambda: held_by(client, topic, app, PARTITIONS, worker.pid),
        "the worker to take every partition",
    )
    if crash:
        until(
            worker, lambda: spend.in_backups() >= ORDERS, f"the worker to die at {crash['PSPF_TEST_CRASH']}"
        )
        if not worker.alive():
            assert worker.wait(10) == -9, worker.tail()
            report = json.loads(Path(crash["PSPF_TEST_MARKER"]).read_text())
            print(f"life {life} died at {crash['PSPF_TEST_CRASH']}: {report}")
            return str(report["where"])
    elif life == KILLS - 1:  # every order re-keyed: the closing orders come after them all
        until(worker, spend.all_rekeyed, "every order to be re-keyed")
        time.sleep(rng.uniform(0.0, 0.3))  # while the re-keyed orders fill and close windows
    elif life % 4 == 3:
        time.sleep(rng.uniform(0.0, 0.1))
    else:
        target = (life + 1) * ORDERS * 4 // (5 * KILLS)
        until(worker, lambda: spend.in_backups() >= target, f"the backups to reach {target} orders")
        time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a cycle: handling, commit, ack, relay
    assert worker.alive(), f"the worker exited by itself\n{worker.tail()}"
    assert worker.kill9() == -9
    return None


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {value} (set PSPF_TEST_SEED to repeat)")
    return value


def test_the_spend_pipeline_under_kill9_on_two_machines_emits_each_window_once_exactly(
    spawn: Spawner,
    tmp_path: Path,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    seed: int,
) -> None:
    started = time.monotonic()
    rng = random.Random(seed)
    spend = Spend(spawn, rclient, tmp_path, make_topic, produce, names, seed)
    assert spend.expected and all(n > 0 for _, n in spend.expected.values())

    progress, published, unpublished = [0], [(0, 0)], []
    relay_deaths: list[str] = []
    for life in range(KILLS):
        where = live_and_die(spend, life, rng)
        if where is not None:
            relay_deaths.append(where)
        progress.append(spend.in_backups())
        assert progress[-1] >= progress[-2], f"the state backup went backwards: {progress}"
        published.append(spend.assert_once())
        # A re-keyed value is published only after the acknowledgement that carries its commit
        # to the backup: the topic never holds more than the backups committed.
        waiting = spend.committed_rekeys() - published[-1][1]
        assert waiting >= 0, f"{-waiting} re-keyed values published beyond the backups' checkpoints"
        unpublished.append(waiting)
        wait_until(
            lambda: no_leases(rclient, spend.orders_topic, spend.app, PARTITIONS),
            10,
            "the killed worker's leases to expire",
        )
    print(f"orders in the backups after each kill: {progress[1:]}")
    print(f"(results, re-keyed) after each kill: {published[1:]}")
    print(f"re-keyed values committed, not published, at each kill: {unpublished}")
    print(f"deaths in the relay: {relay_deaths}")
    assert 0 < progress[-2] < ORDERS == progress[-1], "the kills should land mid-stream"
    assert "sent-last" in relay_deaths, f"no worker died with its relay's rows sent, unmarked: {relay_deaths}"
    results = [r for r, _ in published]
    assert any(0 < r < len(spend.expected) for r in results[:-1]), "no kill landed while results came"
    for machine in MACHINES:
        taken = takeovers(spend, machine)
        print(f"{machine} took partitions: {dict(taken)}")
        assert taken["restored"], f"{machine} never restored a partition from its backup: {dict(taken)}"

    spend.produce_closing()
    final = spend.run("host-c", "host-c-final", "--until-idle")
    assert final.wait(timeout=120) == 0, final.tail()
    assert takeovers(spend, "host-c")["restored"] == PARTITIONS, final.tail()
    handled, skipped, failures = final.summary()
    assert failures == 0, final.tail()

    spend.assert_results()
    spend.assert_rekeyed()
    spend.assert_clean()
    took = time.monotonic() - started
    print(f"{ORDERS} orders, {KILLS} kills, the last worker handled {handled} ({skipped} done): {took:.1f}s")
