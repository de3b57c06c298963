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
What it shares with ``test_dataflow_crash`` (the workers, the backups' progress, the checks of the
windows, the re-keying topic and the logs) is in ``tests.crash.dataflow_support``.
"""

from __future__ import annotations

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
from pspf.keys import StreamId, partition_for, stream_key
from pspf.outbox.emit import SOURCE_TOPIC_HEADER
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.dataflow_support import OUT_PARTITIONS, PARTITIONS, Flow, Order, kill9, pick_seed, until
from tests.crash.support import leases
from tests.crash.test_outbox_crash import Output
from tests.integration.test_dataflow import MINUTE, T0, expected_tiers
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.dataflow_apps:pipelines"
EVENTS = int(os.environ.get("PSPF_TEST_PIPELINES_EVENTS", "6000"))
CUSTOMERS = 12
TIERS = ("bronze", "silver", "gold")
#: Event time between two events of the sequence, and the jitter of orders and payments
SPACING_MS, JITTER_MS = 3_000, 5_000
#: How far a tier update's event time is from its place in the sequence, either way
TIER_JITTER_MS = 120_000
WITHIN_MS = 5 * MINUTE
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


class Pipelines(Flow):
    """The app's other inputs and outputs, the events, and what the joins' outputs must be."""

    target = TARGET

    def __init__(
        self,
        spawn: Spawner,
        client: Any,
        tmp_path: Path,
        make_topic: Callable[[int], str],
        names: Names,
        seed: int,
    ) -> None:
        inputs = tuple(make_topic(PARTITIONS) for _ in "opc")
        windows_out, self.pairs_out, self.tiers_out = (make_topic(OUT_PARTITIONS) for _ in "wpt")
        self.events = make_events(EVENTS, seed)
        orders = [v for kind, v in self.events if kind == "order"]
        closing = closing_orders_after(orders)
        super().__init__(spawn, client, tmp_path, names, inputs, windows_out, orders, closing)
        self.payments_topic, self.customers_topic = inputs[1:]
        self.payments = [v for kind, v in self.events if kind == "payment"]
        self.updates = [v for kind, v in self.events if kind == "customer"]
        self.topic_of = dict(zip(("order", "payment", "customer"), self.inputs, strict=True))
        assert self.send(self.events) == EVENTS
        self.assert_sent_in_order()
        self.total_inputs = EVENTS
        #: the progress: entries of the inputs and the re-keying topic in the backups
        self.work = EVENTS + self.positive
        self.kinds["pairs"] = (self.pairs_out, OUT_PARTITIONS, lambda o: (o.value["oid"], o.value["pid"]))
        self.kinds["tiers"] = (self.tiers_out, OUT_PARTITIONS, lambda o: o.value["oid"])

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            "PSPF_TEST_PAYMENTS": self.payments_topic,
            "PSPF_TEST_CUSTOMERS": self.customers_topic,
            "PSPF_TEST_PAIRS": self.pairs_out,
            "PSPF_TEST_TIERS": self.tiers_out,
        }

    def send(self, events: list[Event]) -> int:
        """Write ``events`` in one sequence of ids across the topics, in this order."""
        settings = Settings.load({"PSPF_BROKER": self.spawn.redis_url}, environ={})
        with Producer(settings=settings, ordered=True, batch_size=2000) as producer:
            for kind, value in events:
                producer.send(self.topic_of[kind], value, key=value["customer"])
        return producer.sent

    def send_orders(self, orders: list[Order]) -> int:
        return self.send([("order", o) for o in orders])

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

    def progress(self) -> int:
        """Entries of the inputs and the re-keying topic in the backups (the work done, of ``work``)."""
        rekeyed = sum(self.in_backup(self.rekey, p) for p in range(PARTITIONS))
        return self.inputs_in_backups() + rekeyed

    # -- the outputs --------------------------------------------------------------------------------

    def entry_ids(self, topic: str, field: str) -> dict[str, tuple[int, StreamId]]:
        """Each entry of an input topic by its value's ``field``: (partition, entry id)."""
        found = {}
        for p in range(PARTITIONS):
            for entry_id, fields in self.client.xrange(stream_key(topic, p)):
                found[json.loads(fields[codec.VALUE])[field]] = (p, StreamId.parse(entry_id))
        return found

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


def live_and_die(flow: Pipelines, life: int, rng: random.Random) -> str:
    """Run a worker, on each machine in turn, and SIGKILL it as ``PLAN`` says; how it ended."""
    how = PLAN[life]
    relay = PLAN[:life].count("relay") if how == "relay" else None
    worker, crash = flow.start(life, relay, rng)
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
        kill9(worker)
        return f"restoring ({settled} of {PARTITIONS} partitions settled)"
    flow.until_holds_all(worker)
    if how == "relay":
        where = flow.died_in_relay(worker, crash, life)
        if where is not None:
            return f"relay {where}"
        how = f"after the work, its relay short of {crash['PSPF_TEST_CRASH']}"  # killed from outside below
    elif how == "last":  # every input handled and re-keyed: the closing orders come after them all
        until(worker, flow.all_rekeyed, "every input to be handled and re-keyed")
        time.sleep(rng.uniform(0.0, 0.3))
    else:
        target = (life + 1) * EVENTS * 19 // (20 * len(PLAN))
        flow.until_share(worker, target, rng)
        how = f"at {target} of {EVENTS} inputs"
    kill9(worker)
    return how


def test_the_three_pipelines_under_kill9_on_two_machines_emit_every_result_once_exactly(
    spawn: Spawner,
    tmp_path: Path,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    names: Names,
) -> None:
    started = time.monotonic()
    seed = pick_seed()
    rng = random.Random(seed)
    flow = Pipelines(spawn, rclient, tmp_path, make_topic, names, seed)
    produced = time.monotonic() - started

    progress, counts, deaths = [0], [], []
    for life in range(len(PLAN)):
        deaths.append(live_and_die(flow, life, rng))
        counts.append(flow.after_kill(progress))
        flow.leases_expired()
    orders, payments, updates = len(flow.orders), len(flow.payments), len(flow.updates)
    print(f"inputs: {orders} orders, {payments} payments, {updates} tier updates")
    print(f"how each life ended: {deaths}")
    print(f"entries in the backups after each kill (of {flow.work}): {progress[1:]}")
    print(f"outputs after each kill: {counts}")
    assert len(deaths) >= 6
    assert 0 < progress[-2] < flow.work, "the kills should land mid-stream"
    assert flow.inputs_in_backups() == EVENTS
    assert any(how.startswith("relay") for how in deaths), f"no worker died in its relay: {deaths}"
    flow.assert_restored_on_each_machine()

    handled, skipped = flow.run_final()
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
