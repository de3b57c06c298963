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
repeats the orders and the kill times. What it shares with ``test_dataflow_pipelines_crash`` (the
workers, the backups' progress, the checks of the windows, the re-keying topic and the logs) is in
``tests.crash.dataflow_support``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import codec
from pspf.keys import stream_key
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.dataflow_support import OUT_PARTITIONS, PARTITIONS, Flow, Order, kill9, pick_seed, until
from tests.integration.test_dataflow import closing_orders, make_orders

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.dataflow_apps:spend"
ORDERS = int(os.environ.get("PSPF_TEST_DATAFLOW_ORDERS", "5000"))
KILLS = int(os.environ.get("PSPF_TEST_DATAFLOW_KILLS", "12"))


class Spend(Flow):
    """The spend pipeline's app: its one input, the orders (from the ``produce`` fixture), and how
    many of them the backups committed to re-key."""

    target = TARGET

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
        orders = make_orders(ORDERS, seed)
        inputs, windows_out = (make_topic(PARTITIONS),), make_topic(OUT_PARTITIONS)
        super().__init__(spawn, client, tmp_path, names, inputs, windows_out, orders, closing_orders(orders))
        self.produce = produce
        self.work = ORDERS  # the progress: orders in the backups
        assert self.send_orders(orders) == ORDERS
        self.total_inputs = ORDERS
        self.kept = self.rekeys_up_to()

    def send_orders(self, orders: list[Order]) -> int:
        return self.produce(self.orders_topic, [(o["oid"], o) for o in orders])

    def rekeys_up_to(self) -> dict[int, list[int]]:
        """Per orders partition: how many of its orders up to each entry are re-keyed (0 before the first)."""
        kept: dict[int, list[int]] = {}
        for p in range(PARTITIONS):
            entries = self.client.xrange(stream_key(self.orders_topic, p))
            positive = [int(json.loads(fields[codec.VALUE])["qty"] > 0) for _, fields in entries]
            kept[p] = list(itertools.accumulate(positive, initial=0))
        return kept

    def committed_rekeys(self) -> int:
        """Re-keyed values of the orders at or below the backups' checkpoints: committed, to publish."""
        return sum(self.kept[p][self.in_backup(self.orders_topic, p)] for p in range(PARTITIONS))


def live_and_die(spend: Spend, life: int, rng: random.Random) -> str | None:
    """Run a worker, on each machine in turn, and SIGKILL it; where its relay killed it, if there.

    Every fourth life from the second, the worker kills itself at a step of its outbox relay (a
    step picked at random); the last waits for every order to be re-keyed; every fourth from the
    fourth is killed right after it took the partitions (restoring them, barely started); the
    others once the backups reached a share of the orders (up to four fifths), a little after.
    """
    relay = life // 4 if life % 4 == 1 and life < KILLS - 1 else None
    worker, crash = spend.start(life, relay, rng)
    spend.until_holds_all(worker)
    if crash:
        where = spend.died_in_relay(worker, crash, life)
        if where is not None:
            return where
    elif life == KILLS - 1:  # every order re-keyed: the closing orders come after them all
        until(worker, spend.all_rekeyed, "every order to be re-keyed")
        time.sleep(rng.uniform(0.0, 0.3))  # while the re-keyed orders fill and close windows
    elif life % 4 == 3:
        time.sleep(rng.uniform(0.0, 0.1))
    else:
        spend.until_share(worker, (life + 1) * ORDERS * 4 // (5 * KILLS), rng)
    kill9(worker)
    return None


def test_the_spend_pipeline_under_kill9_on_two_machines_emits_each_window_once_exactly(
    spawn: Spawner,
    tmp_path: Path,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
) -> None:
    started = time.monotonic()
    seed = pick_seed()
    rng = random.Random(seed)
    spend = Spend(spawn, rclient, tmp_path, make_topic, produce, names, seed)
    assert spend.expected and all(n > 0 for _, n in spend.expected.values())

    progress, published, unpublished = [0], [(0, 0)], []
    relay_deaths: list[str] = []
    for life in range(KILLS):
        where = live_and_die(spend, life, rng)
        if where is not None:
            relay_deaths.append(where)
        counts = spend.after_kill(progress)
        published.append((counts["windows"], counts["rekeyed"]))
        # A re-keyed value is published only after the acknowledgement that carries its commit
        # to the backup: the topic never holds more than the backups committed.
        waiting = spend.committed_rekeys() - published[-1][1]
        assert waiting >= 0, f"{-waiting} re-keyed values published beyond the backups' checkpoints"
        unpublished.append(waiting)
        spend.leases_expired()
    print(f"orders in the backups after each kill: {progress[1:]}")
    print(f"(results, re-keyed) after each kill: {published[1:]}")
    print(f"re-keyed values committed, not published, at each kill: {unpublished}")
    print(f"deaths in the relay: {relay_deaths}")
    assert 0 < progress[-2] < ORDERS == progress[-1], "the kills should land mid-stream"
    assert "sent-last" in relay_deaths, f"no worker died with its relay's rows sent, unmarked: {relay_deaths}"
    results = [r for r, _ in published]
    assert any(0 < r < len(spend.expected) for r in results[:-1]), "no kill landed while results came"
    spend.assert_restored_on_each_machine()

    handled, skipped = spend.run_final()
    found = spend.outputs()
    spend.assert_windows(found["windows"])
    spend.assert_rekeyed(found["rekeyed"])
    spend.assert_clean()
    took = time.monotonic() - started
    print(f"{ORDERS} orders, {KILLS} kills, the last worker handled {handled} ({skipped} done): {took:.1f}s")
