"""The three pipelines of the dataflow API in one app under SIGKILL: every output once, exact.

One app (``tests.crash.dataflow_apps:pipelines``) reads orders, payments and a versioned table of
the customers' tiers, all keyed by customer on 3-partition topics, and runs three chains over the
orders: the spend pipeline (filtered, mapped, re-keyed by customer through the managed topic,
summed and counted in tumbling one-minute windows with a grace of ten minutes, each closed
window's result to a topic); an interval join with the payments within five minutes (each pair
``{"oid", "pid"}`` to a second topic); and an as-of join with the table (each order's
``{"oid", "tier"}`` to a third). Orders, payments and tier updates are written by one ordered
producer (``Producer(ordered=True)``) in one interleaved sequence, so the id order across the
topics is the send order: event times grow with the sequence, a few seconds of jitter for orders
and payments (none is late for the join: the jitter is far below its five minutes), two minutes
either way for the tier updates (a lookup as of an order's time must pick by event time among
the updates sent before it, not the last one sent).

Real ``pspf run`` workers, one at a time on two machines in turn (a state dir and a consumer name
of each), are SIGKILLed at random moments: some right after taking the partitions (restoring
them), some inside the outbox relay (``tests.crash.apps_outbox.RelayCrashHooks``: when a step
claimed its rows, after its first publishing call, after its last), the others once the backups
reached a share of the work; the last once every input entry is in the backups and every
re-keyed value in the re-keying topic. Only then come the closing orders (one per customer an
hour after the last order: they close every window; see ``tests.crash.test_dataflow_crash`` for
why not earlier), and a last worker on a third, fresh state dir, run until idle.

Then, exactly: the window results are ``expected_spend`` (each window once); the pairs are the
brute-force pairs of an order and a payment of one customer at most five minutes apart, each once,
each from the later of its two entries in id order; the as-of outputs are one per order (closing
orders too) with ``expected_tiers``; the re-keying topic holds each re-keyed value once; nothing
else in any of those topics, no DLQ entry, nothing pending, no late entry dropped. After each
kill no output is in its topic twice.

``PSPF_TEST_PIPELINES_EVENTS`` resizes it; ``PSPF_TEST_SEED`` repeats the inputs and the kills.
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

import pytest
import redis

from pspf import Producer, Settings, codec
from pspf.keys import StreamId, backup_meta_key, dlq_key, partition_for, stream_key, topic_key
from pspf.outbox.emit import SOURCE_APP_HEADER, SOURCE_TOPIC_HEADER
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import WorkerProcess, held_by, leases, no_leases
from tests.crash.test_dataflow_crash import LATE, MACHINES, RELAY_POINTS, until
from tests.crash.test_outbox_crash import Output, outputs
from tests.integration.test_dataflow import MINUTE, T0, expected_spend, expected_tiers
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.dataflow_apps:pipelines"
PARTITIONS, OUT_PARTITIONS = 3, 2
EVENTS = int(os.environ.get("PSPF_TEST_PIPELINES_EVENTS", "6000"))
CUSTOMERS = 12
TIERS = ("bronze", "silver", "gold")
#: Event time between two events of the sequence, and the jitter of orders and payments
SPACING_MS, JITTER_MS = 3_000, 5_000
#: How far a tier update's event time is from its place in the sequence, either way
TIER_JITTER_MS = 120_000
WITHIN_MS = 5 * MINUTE
LEASE_TTL_MS = 1000
#: Busy work per order (in the spend pipeline's filter): the kills land mid-stream.
WORK_US = 600
OPTIONS = ["--batch-size", "20", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
#: How each worker's life ends: killed at a share of the work, right after it took the partitions,
#: by itself in its outbox relay, or (the last) once every input is handled and re-keyed.
PLAN = (
    "share",
    "relay",
    "share",
    "restoring",
    "relay",
    "share",
    "restoring",
    "share",
    "relay",
    "share",
    "restoring",
    "last",
)

Event = tuple[str, dict[str, Any]]  # ("order" | "payment" | "customer", value)


def make_events(count: int, seed: int) -> list[Event]:
    """Orders, payments and tier updates of ``CUSTOMERS`` customers in one sequence (send order)."""
    rng = random.Random(seed)
    events: list[Event] = []
    for i in range(count):
        customer = f"c{rng.randrange(CUSTOMERS)}"
        at = T0 + i * SPACING_MS
        kind = rng.choices(("order", "payment", "customer"), weights=(70, 10, 20))[0]
        if kind == "order":
            qty, price = rng.randrange(-1, 4), rng.randrange(1, 50)
            value = {"oid": f"o{i}", "customer": customer, "qty": qty, "price": price}
            events.append((kind, {**value, "ts": at + rng.randrange(JITTER_MS)}))
        elif kind == "payment":
            events.append((kind, {"pid": f"p{i}", "customer": customer, "ts": at + rng.randrange(JITTER_MS)}))
        else:
            ts = at + rng.randrange(-TIER_JITTER_MS, TIER_JITTER_MS)
            events.append((kind, {"customer": customer, "tier": rng.choice(TIERS), "ts": ts}))
    return events


def closing_orders_after(orders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One order per customer an hour after the last order: its stream time closes every window."""
    customers = sorted({o["customer"] for o in orders})
    at = max(o["ts"] for o in orders) + 60 * MINUTE
    return [{"oid": f"close-{c}", "customer": c, "qty": 1, "price": 1, "ts": at} for c in customers]


def expected_pairs(orders: list[dict[str, Any]], payments: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """Every (order, payment) of one customer at most ``WITHIN_MS`` apart, by brute force."""
    by_customer: dict[str, list[dict[str, Any]]] = {}
    for p in payments:
        by_customer.setdefault(p["customer"], []).append(p)
    return {
        (o["oid"], p["pid"])
        for o in orders
        for p in by_customer.get(o["customer"], [])
        if abs(o["ts"] - p["ts"]) <= WITHIN_MS
    }


class Pipelines:
    """The app's topics, the inputs, their entry ids, and what the outputs must be."""

    def __init__(
        self,
        spawn: Spawner,
        client: Any,
        tmp_path: Path,
        make_topic: Callable[[int], str],
        names: Names,
        seed: int,
    ) -> None:
        self.spawn, self.client, self.tmp_path = spawn, client, tmp_path
        self.orders_topic, self.payments_topic, self.customers_topic = (make_topic(PARTITIONS) for _ in "opc")
        self.rekey = f"{self.orders_topic}-by-customer"
        self.windows_out, self.pairs_out, self.tiers_out = (make_topic(OUT_PARTITIONS) for _ in "wpt")
        self.app = names.app()
        assert client.hget(topic_key(self.rekey), "partitions") is None  # the app creates it
        self.events = make_events(EVENTS, seed)
        self.orders = [v for kind, v in self.events if kind == "order"]
        self.payments = [v for kind, v in self.events if kind == "payment"]
        self.updates = [v for kind, v in self.events if kind == "customer"]
        self.closing = closing_orders_after(self.orders)
        self.inputs = (self.orders_topic, self.payments_topic, self.customers_topic)
        self.topic_of = dict(zip(("order", "payment", "customer"), self.inputs, strict=True))
        assert self.send(self.events) == EVENTS
        self.assert_sent_in_order()
        #: entry ids of each (topic, partition) known so far, in stream order
        self.ids: dict[tuple[str, int], list[StreamId]] = {}
        self.total_inputs = EVENTS
        self.positive = sum(1 for o in self.orders if o["qty"] > 0)
        self.workers: list[WorkerProcess] = []

    def send(self, events: list[Event]) -> int:
        """Write ``events`` in one sequence of ids across the topics, in this order."""
        settings = Settings.load({"PSPF_BROKER": self.spawn.redis_url}, environ={})
        with Producer(settings=settings, ordered=True, batch_size=2000) as producer:
            for kind, value in events:
                producer.send(self.topic_of[kind], value, key=value["customer"])
        return producer.sent

    def assert_sent_in_order(self) -> None:
        """The premise of the expected outputs: id order across the topics is the send order."""
        found = [
            (StreamId.parse(entry_id), json.loads(fields[codec.VALUE]))
            for topic in self.inputs
            for p in range(PARTITIONS)
            for entry_id, fields in self.client.xrange(stream_key(topic, p))
        ]
        written = sorted(found, key=lambda entry: entry[0])
        assert len({entry_id for entry_id, _ in written}) == EVENTS
        assert [value for _, value in written] == [value for _, value in self.events]

    def produce_closing(self) -> None:
        assert self.send([("order", o) for o in self.closing]) == len(self.closing)
        self.total_inputs += len(self.closing)

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
                "PSPF_TEST_PAYMENTS": self.payments_topic,
                "PSPF_TEST_CUSTOMERS": self.customers_topic,
                "PSPF_TEST_REKEY": self.rekey,
                "PSPF_TEST_TARGET": self.windows_out,
                "PSPF_TEST_PAIRS": self.pairs_out,
                "PSPF_TEST_TIERS": self.tiers_out,
                "PSPF_TEST_WORK_US": str(WORK_US),
                **(env or {}),
            },
            cli_settings=False,
            target=TARGET,
        )
        self.workers.append(worker)
        return worker

    # -- progress, from the state backups ---------------------------------------------------------

    def _in_backup(self, topic: str, partition: int) -> int:
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
        return sum(self._in_backup(t, p) for t in self.inputs for p in range(PARTITIONS))

    def progress(self) -> int:
        """Entries of the inputs and the re-keying topic in the backups (the work done, of ``work``)."""
        rekeyed = sum(self._in_backup(self.rekey, p) for p in range(PARTITIONS))
        return self.inputs_in_backups() + rekeyed

    @property
    def work(self) -> int:
        return EVENTS + self.positive

    def all_rekeyed(self) -> bool:
        """Every input entry is in the backups, and every re-keyed value in the re-keying topic."""
        if self.inputs_in_backups() < self.total_inputs:
            return False
        published = sum(self.client.xlen(stream_key(self.rekey, p)) for p in range(PARTITIONS))
        return bool(published == self.positive)

    # -- the outputs --------------------------------------------------------------------------------

    def outputs(self) -> dict[str, list[Output]]:
        return {
            "windows": outputs(self.client, self.windows_out, OUT_PARTITIONS),
            "pairs": outputs(self.client, self.pairs_out, OUT_PARTITIONS),
            "tiers": outputs(self.client, self.tiers_out, OUT_PARTITIONS),
            "rekeyed": outputs(self.client, self.rekey, PARTITIONS),
        }

    @staticmethod
    def identity(kind: str, out: Output) -> Any:
        """What names an output: each is in its topic once."""
        if kind == "windows":
            return out.value["key"], out.value["start"]
        if kind == "pairs":
            return out.value["oid"], out.value["pid"]
        if kind == "tiers":
            return out.value["oid"]
        return out.source  # a re-keyed value: its order's entry

    def assert_once(self) -> dict[str, int]:
        """No output in its topic twice (also while they come); how many of each there are."""
        found = self.outputs()
        for kind, outs in found.items():
            seen = Counter(self.identity(kind, out) for out in outs)
            twice = sorted(name for name, n in seen.items() if n > 1)
            assert not twice, f"{len(twice)} of {len(seen)} {kind} emitted more than once: {twice[:5]}"
        return {kind: len(outs) for kind, outs in found.items()}

    def entry_ids(self, topic: str, field: str) -> dict[str, tuple[int, StreamId]]:
        """Each entry of an input topic by its value's ``field``: (partition, entry id)."""
        found = {}
        for p in range(PARTITIONS):
            for entry_id, fields in self.client.xrange(stream_key(topic, p)):
                found[json.loads(fields[codec.VALUE])[field]] = (p, StreamId.parse(entry_id))
        return found

    def assert_windows(self, results: list[Output]) -> None:
        """Each window's result once, equal to ``expected_spend``, and nothing else."""
        seen = Counter((out.value["key"], out.value["start"]) for out in results)
        twice = sorted(window for window, n in seen.items() if n > 1)
        got = {(o.value["key"], o.value["start"]): (o.value["total"], o.value["n"]) for o in results}
        want = expected_spend(self.orders)
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

    def assert_pairs(self, pairs: list[Output]) -> None:
        """Each pair of the brute force once, from the later of its two entries; nothing else."""
        orders = [*self.orders, *self.closing]
        want = expected_pairs(orders, self.payments)
        seen = Counter((out.value["oid"], out.value["pid"]) for out in pairs)
        twice = sorted(pair for pair, n in seen.items() if n > 1)
        missing = sorted(want - seen.keys())
        extra = sorted(seen.keys() - want)
        order_ts = {o["oid"]: o["ts"] for o in orders}
        payment_ts = {p["pid"]: p["ts"] for p in self.payments}
        outside = [
            pair
            for pair in extra
            if pair[0] in order_ts
            and pair[1] in payment_ts
            and abs(order_ts[pair[0]] - payment_ts[pair[1]]) > WITHIN_MS
        ]
        assert not (twice or missing or extra), (
            f"{len(pairs)} pairs for {len(want)}: {len(twice)} emitted more than once {twice[:5]}, "
            f"{len(missing)} never {missing[:5]}, {len(extra)} unknown {extra[:5]} "
            f"(of them {len(outside)} more than {WITHIN_MS} ms apart {outside[:5]})"
        )
        assert len(pairs) == len(want)
        order_ids = self.entry_ids(self.orders_topic, "oid")
        payment_ids = self.entry_ids(self.payments_topic, "pid")
        customer = {o["oid"]: o["customer"] for o in orders}
        for out in pairs:
            assert set(out.value) == {"oid", "pid"}, out
            (op, oid), (pp, pid) = order_ids[out.value["oid"]], payment_ids[out.value["pid"]]
            assert op == pp, out  # one customer: one partition
            later = (self.orders_topic, oid) if oid > pid else (self.payments_topic, pid)
            assert out.source == (op, str(later[1])), f"{out}: not from the later entry {later}"
            assert out.headers[SOURCE_TOPIC_HEADER] == later[0], out
            assert out.key == customer[out.value["oid"]], out
            assert out.partition == partition_for(out.key.encode(), OUT_PARTITIONS), out

    def assert_tiers(self, tiers: list[Output]) -> None:
        """One output per order (closing orders too), with the tier current at its event time."""
        written = [e for e in self.events if e[0] != "payment"] + [("order", o) for o in self.closing]
        want = expected_tiers(written)
        seen = Counter(out.value["oid"] for out in tiers)
        twice = sorted(oid for oid, n in seen.items() if n > 1)
        got = {out.value["oid"]: out.value["tier"] for out in tiers}
        missing = sorted(want.keys() - got.keys())
        extra = sorted(got.keys() - want.keys())
        wrong = {oid: (got[oid], want[oid]) for oid in want.keys() & got.keys() if got[oid] != want[oid]}
        assert not (twice or missing or extra or wrong), (
            f"{len(tiers)} as-of outputs for {len(want)} orders: {len(twice)} emitted more than once "
            f"{twice[:5]}, {len(missing)} never {missing[:5]}, {len(extra)} unknown {extra[:5]}, "
            f"{len(wrong)} wrong ((got, want) tier) {dict(list(wrong.items())[:5])}"
        )
        assert len(tiers) == len(want)
        order_ids = self.entry_ids(self.orders_topic, "oid")
        customer = {o["oid"]: o["customer"] for o in [*self.orders, *self.closing]}
        for out in tiers:
            assert set(out.value) == {"oid", "tier"}, out
            p, entry_id = order_ids[out.value["oid"]]
            assert out.source == (p, str(entry_id)), out
            assert out.key == customer[out.value["oid"]], out
        # The as-of lookups are not trivial: rows found, none found, and rows that a later update
        # sent before the order (by event time after it) did not replace.
        assert 0 < sum(1 for tier in want.values() if tier is None) < len(want) / 4

    def assert_rekeyed(self, rekeyed: list[Output]) -> None:
        """The re-keying topic holds each order with a positive quantity once, from its entry."""
        order_ids = self.entry_ids(self.orders_topic, "oid")
        by_source = {(p, str(i)): oid for oid, (p, i) in order_ids.items()}
        orders = {o["oid"]: o for o in [*self.orders, *self.closing]}
        assert self.client.hget(topic_key(self.rekey), "partitions") == str(PARTITIONS).encode()
        sources = Counter(out.source for out in rekeyed)
        want = {(p, str(i)) for oid, (p, i) in order_ids.items() if orders[oid]["qty"] > 0}
        again = sorted(s for s, n in sources.items() if n > 1)
        missing = sorted(want - sources.keys())
        foreign = sorted(sources.keys() - want)
        assert not (again or missing or foreign), (
            f"{len(rekeyed)} entries in the re-keying topic for {len(want)} orders to re-key: "
            f"{len(again)} more than once {again[:5]}, {len(missing)} never {missing[:5]}, "
            f"{len(foreign)} unknown {foreign[:5]}"
        )
        assert len(rekeyed) == self.positive + len(self.closing)
        for out in rekeyed:
            order = orders[by_source[out.source]]
            amount = order["qty"] * order["price"]
            assert out.value == {"customer": order["customer"], "amount": amount, "ts": order["ts"]}, out
            assert out.key == order["customer"], out
            assert out.headers[SOURCE_TOPIC_HEADER] == self.orders_topic, out

    def assert_clean(self) -> None:
        """No DLQ entry, nothing pending, no worker logged a late entry or a traceback."""
        for topic in (*self.inputs, self.rekey):
            for p in range(PARTITIONS):
                assert self.client.xlen(dlq_key(topic, p)) == 0, f"DLQ entries in {topic} partition {p}"
                pending = self.client.xpending(stream_key(topic, p), self.app)["pending"]
                assert pending == 0, f"{pending} entries still pending in {topic} partition {p}"
        for worker in self.workers:
            text = worker.log.read_text(errors="replace")
            assert LATE not in text, worker.tail()
            assert "Traceback" not in text, worker.tail()


def takeovers(tmp_path: Path, machine: str) -> Counter[str]:
    """How the workers of ``machine`` took their partitions, from their logs."""
    found: Counter[str] = Counter()
    for log in tmp_path.glob(f"{machine}-*.log"):
        found.update(re.findall(r"state backup (\w+(?: up| sync)?) app=", log.read_text()))
    return found


def live_and_die(flow: Pipelines, life: int, rng: random.Random) -> str:
    """Run a worker, on each machine in turn, and SIGKILL it as ``PLAN`` says; how it ended."""
    machine, how = MACHINES[life % 2], PLAN[life]
    crash: dict[str, str] = {}
    if how == "relay":
        where = RELAY_POINTS[PLAN[:life].count("relay") % len(RELAY_POINTS)]
        marker = flow.tmp_path / f"relay-{life}.json"
        crash = {"PSPF_TEST_CRASH": f"{where}:{rng.randint(2, 30)}", "PSPF_TEST_MARKER": str(marker)}
    worker = flow.run(machine, f"{machine}-{life}", env=crash)
    client, topic, app = flow.client, flow.orders_topic, flow.app
    if how == "restoring":  # killed while it takes the partitions: between leases and restores
        wait_until(
            lambda: (
                any(
                    lease and lease.pid == worker.pid
                    for lease in leases(client, topic, app, PARTITIONS).values()
                )
                or not worker.alive()
            ),
            60,
            "the worker to take a partition",
            interval=0.002,
        )
        time.sleep(rng.uniform(0.0, 0.03))
        settled = len(re.findall(r"state backup \w+ app=", worker.log.read_text(errors="replace")))
        assert worker.alive(), f"the worker exited by itself\n{worker.tail()}"
        assert worker.kill9() == -9
        return f"restoring ({settled} of {PARTITIONS} partitions settled)"
    until(
        worker,
        lambda: held_by(client, topic, app, PARTITIONS, worker.pid),
        "the worker to take every partition",
    )
    if how == "relay":
        point = crash["PSPF_TEST_CRASH"]
        until(worker, lambda: flow.progress() >= flow.work, f"the worker to die at {point}")
        if not worker.alive():
            assert worker.wait(10) == -9, worker.tail()
            report = json.loads(Path(crash["PSPF_TEST_MARKER"]).read_text())
            print(f"life {life} died at {point}: {report}")
            return f"relay {report['where']}"
        how = f"after the work, its relay short of {point}"  # killed from outside below
    elif how == "last":  # every input handled and re-keyed: the closing orders come after them all
        until(worker, flow.all_rekeyed, "every input to be handled and re-keyed")
        time.sleep(rng.uniform(0.0, 0.3))
    else:
        target = (life + 1) * EVENTS * 19 // (20 * len(PLAN))
        until(worker, lambda: flow.inputs_in_backups() >= target, f"the backups to reach {target} inputs")
        time.sleep(rng.uniform(0.0, 0.3))  # anywhere in a cycle: handling, commit, ack, relay
        how = f"at {target} of {EVENTS} inputs"
    assert worker.alive(), f"the worker exited by itself\n{worker.tail()}"
    assert worker.kill9() == -9
    return how


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {value} (set PSPF_TEST_SEED to repeat)")
    return value


def test_the_three_pipelines_under_kill9_on_two_machines_emit_every_result_once_exactly(
    spawn: Spawner,
    tmp_path: Path,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    names: Names,
    seed: int,
) -> None:
    started = time.monotonic()
    rng = random.Random(seed)
    flow = Pipelines(spawn, rclient, tmp_path, make_topic, names, seed)
    produced = time.monotonic() - started

    progress, counts, deaths = [0], [], []
    for life in range(len(PLAN)):
        deaths.append(live_and_die(flow, life, rng))
        progress.append(flow.progress())
        assert progress[-1] >= progress[-2], f"the state backup went backwards: {progress}"
        counts.append(flow.assert_once())
        wait_until(
            lambda: no_leases(rclient, flow.orders_topic, flow.app, PARTITIONS),
            10,
            "the killed worker's leases to expire",
        )
    orders, payments, updates = len(flow.orders), len(flow.payments), len(flow.updates)
    print(f"inputs: {orders} orders, {payments} payments, {updates} tier updates")
    print(f"how each life ended: {deaths}")
    print(f"entries in the backups after each kill (of {flow.work}): {progress[1:]}")
    print(f"outputs after each kill: {counts}")
    assert len(deaths) >= 6
    assert 0 < progress[-2] < flow.work, "the kills should land mid-stream"
    assert flow.inputs_in_backups() == EVENTS
    assert any(how.startswith("relay") for how in deaths), f"no worker died in its relay: {deaths}"
    for machine in MACHINES:
        taken = takeovers(tmp_path, machine)
        print(f"{machine} took partitions: {dict(taken)}")
        assert taken["restored"], f"{machine} never restored a partition from its backup: {dict(taken)}"

    flow.produce_closing()
    final = flow.run("host-c", "host-c-final", "--until-idle")
    assert final.wait(timeout=120) == 0, final.tail()
    assert takeovers(tmp_path, "host-c")["restored"] == PARTITIONS, final.tail()
    handled, skipped, failures = final.summary()
    assert failures == 0, final.tail()

    found = flow.outputs()
    flow.assert_windows(found["windows"])
    flow.assert_pairs(found["pairs"])
    flow.assert_tiers(found["tiers"])
    flow.assert_rekeyed(found["rekeyed"])
    flow.assert_clean()
    took = time.monotonic() - started
    print(
        f"{EVENTS} events ({produced:.1f}s to produce), {len(PLAN)} kills; outputs "
        f"{ {kind: len(outs) for kind, outs in found.items()} }; the last worker handled {handled} "
        f"({skipped} done): {took:.1f}s"
    )
