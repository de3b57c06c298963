"""Stream apps (``app.stream``) against a real server: re-keying topics, windows, exact outputs."""

from __future__ import annotations

import json
import random
import subprocess
import textwrap
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from pspf import App, ConfigError, NotFound, Producer, Settings, Worker, agg, windows
from pspf.cli import cli
from pspf.keys import stream_key
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.test_emit import outputs

pytestmark = pytest.mark.integration

MINUTE = 60_000
T0 = 1_700_000_040_000 - 1_700_000_040_000 % MINUTE


def spend_app(name: str, orders: str, by_customer: str, out: str) -> App:
    """The first pipeline of the dataflow how-to.

    Re-keying interleaves the source partitions' entries in the re-keying topic by when each
    was published, not by event time: the grace period covers that.
    """
    app = App(name)
    (
        app.stream(orders)
        .filter(lambda o: o["qty"] > 0)
        .map(lambda o: {"customer": o["customer"], "amount": o["qty"] * o["price"], "ts": o["ts"]})
        .group_by(lambda v: v["customer"], topic=by_customer)
        .window(windows.tumbling(timedelta(minutes=1)), timestamp="ts", grace=timedelta(minutes=10))
        .agg(total=agg.Sum("amount"), n=agg.Count())
        .to(out)
    )
    return app


def make_orders(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "oid": f"o{i}",
            "customer": f"c{rng.randrange(12)}",
            "qty": rng.randrange(-1, 4),
            "price": rng.randrange(1, 50),
            "ts": T0 + i * 500 + rng.randrange(400),  # in order per producer: none late
        }
        for i in range(count)
    ]


def expected_spend(orders: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int]]:
    """(customer, window start) -> (total, n) of every window of ``orders``."""
    found: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for o in orders:
        if o["qty"] > 0:
            window = found[(o["customer"], o["ts"] - o["ts"] % MINUTE)]
            window[0] += o["qty"] * o["price"]
            window[1] += 1
    return {k: (v[0], v[1]) for k, v in found.items()}


def closing_orders(orders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One order per customer an hour on: its stream time closes every window of ``orders``."""
    customers = sorted({o["customer"] for o in orders})
    return [
        {"oid": f"close-{c}", "customer": c, "qty": 1, "price": 1, "ts": T0 + 3_600_000} for c in customers
    ]


def test_the_spend_pipeline_creates_its_re_keying_topic_and_emits_every_closed_window_once(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    rclient: redis.Redis,
    service: Service,
    names: Names,
    redis_url: str,
) -> None:
    orders_topic, out = make_topic(3), make_topic(2)
    by_customer = f"{orders_topic}-by-customer"
    orders = make_orders(600, seed=7)
    produce(orders_topic, [(o["oid"], o) for o in orders])
    app_name = names.app()
    summary = Worker(spend_app(app_name, orders_topic, by_customer, out), make_settings()).run(
        until_idle=True
    )
    assert outputs(rclient, out, 2) == []  # every window is in its grace period still
    produce(orders_topic, [(o["oid"], o) for o in closing_orders(orders)])
    again = Worker(spend_app(app_name, orders_topic, by_customer, out), make_settings()).run(until_idle=True)
    assert summary.dead_lettered == again.dead_lettered == again.late == 0
    assert len(service.topics.describe_topic(by_customer).partitions) == 3
    assert by_customer in [t.name for t in service.topics.list_topics()]
    rekeyed = outputs(rclient, by_customer, 3)
    assert len(rekeyed) == sum(1 for o in orders if o["qty"] > 0) + len(closing_orders(orders))
    results = [o["value"] for o in outputs(rclient, out, 2)]
    got = {(r["key"], r["start"]): (r["total"], r["n"]) for r in results}
    assert len(got) == len(results)  # each window once
    assert got == expected_spend(orders)
    assert all(r["end"] == r["start"] + MINUTE for r in results)

    removed = CliRunner().invoke(cli, ["app", "delete", app_name, "--yes", "--broker", redis_url])
    assert removed.exit_code == 0, removed.output
    assert f"topic {by_customer}" in removed.output
    assert by_customer not in [t.name for t in service.topics.list_topics()]
    assert rclient.exists(stream_key(by_customer, 0)) == 0


def test_a_re_keying_topic_with_another_partition_count_is_refused_in_one_line(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    orders_topic, out, by_customer = make_topic(2), make_topic(1), make_topic(3)
    with pytest.raises(ConfigError, match=rf"re-keying topic '{by_customer}' \(group_by\) has 3 partitions"):
        Worker(spend_app(names.app(), orders_topic, by_customer, out), make_settings()).start()
    module = tmp_path / "rekey_app.py"
    module.write_text(
        textwrap.dedent(
            f"""
            from tests.integration.test_dataflow import spend_app
            main = spend_app("{names.app()}", "{orders_topic}", "{by_customer}", "{out}")
            """
        )
    )
    state = str(tmp_path / "s")
    done = subprocess.run(
        [*pspf_command("run", "rekey_app:main", "--broker", redis_url), "--until-idle", "--state-dir", state],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=f"{tmp_path}:{Path(__file__).resolve().parents[2]}"),
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "has 3 partitions, the app's topics 2" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_output_topic_stops_the_worker_at_start_with_a_clear_error(
    make_settings: Callable[..., Settings], make_topic: Callable[[int], str], names: Names
) -> None:
    orders_topic = make_topic(1)
    app = spend_app(names.app(), orders_topic, f"{orders_topic}-by", "nowhere")
    missing = r"publishes to a missing topic \(to\): topic 'nowhere' does not exist"
    with pytest.raises(NotFound, match=missing):
        Worker(app, make_settings()).start()


def payment_join_app(name: str, orders: str, payments: str, out: str) -> App:
    """The second pipeline of the dataflow how-to: orders joined with payments within 5 minutes."""
    app = App(name)
    (
        app.stream(orders)
        .join_interval(
            app.stream(payments),
            within=timedelta(minutes=5),
            timestamp="ts",
            merge=lambda order, payment: {"oid": order["oid"], "pid": payment["pid"]},
        )
        .to(out)
    )
    return app


def test_an_interval_join_through_a_worker_emits_each_pair_once_in_id_order_across_topics(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    rclient: redis.Redis,
    names: Names,
) -> None:
    orders_topic, payments_topic, out = make_topic(2), make_topic(2), make_topic(1)
    rng = random.Random(11)
    orders: list[dict[str, Any]] = []
    payments: list[dict[str, Any]] = []
    for n in range(800):  # written in event time order, one topic or the other
        record = {"customer": f"c{rng.randrange(6)}", "ts": T0 + n * 3_000}
        if rng.random() < 0.5:
            orders.append({**record, "oid": f"o{n}"})
            produce(orders_topic, [(record["customer"], orders[-1])])
        else:
            payments.append({**record, "pid": f"p{n}"})
            produce(payments_topic, [(record["customer"], payments[-1])])
    summary = Worker(
        payment_join_app(names.app(), orders_topic, payments_topic, out), make_settings(PSPF_BATCH_SIZE=37)
    ).run(until_idle=True)
    assert summary.late == 0 and summary.dead_lettered == 0
    got = [(o["value"]["oid"], o["value"]["pid"]) for o in outputs(rclient, out, 1)]
    want = {
        (o["oid"], p["pid"])
        for o in orders
        for p in payments
        if o["customer"] == p["customer"] and abs(o["ts"] - p["ts"]) <= 300_000
    }
    assert len(got) == len(set(got)) and set(got) == want
    # each pair came from the later of its two entries (in id order across the topics)
    ids = {}
    for topic, field in ((orders_topic, "oid"), (payments_topic, "pid")):
        for partition in range(2):
            for entry_id, fields in rclient.xrange(stream_key(topic, partition)):
                ids[json.loads(fields[b"value"])[field]] = entry_id.decode()
    for output in outputs(rclient, out, 1):
        oid, pid = output["value"]["oid"], output["value"]["pid"]
        later = max(ids[oid], ids[pid], key=lambda i: tuple(map(int, i.split("-"))))
        assert output["headers"]["pspf-source-id"] == later


@pytest.mark.parametrize("mode", ["ordered", "deferred"])
def test_an_entry_retried_in_an_interleaved_batch_holds_the_later_entries_of_every_topic_back(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    rclient: redis.Redis,
    names: Names,
    mode: str,
) -> None:
    """A payment fails twice; the orders after it in id order wait for it, so every pair is exact.

    Deferred, it is parked and tried again after later entries (the grace keeps it on time): it
    meets what came before it then, and its pairs are still each emitted once.
    """
    orders_topic, payments_topic, out = make_topic(1), make_topic(1), make_topic(1)
    failures = {"p31": 2, "p77": 1}
    seen: list[str] = []

    def flaky(payment: dict[str, Any]) -> bool:
        seen.append(payment["pid"])
        if failures.get(payment["pid"], 0):
            failures[payment["pid"]] -= 1
            raise RuntimeError(f"flaky {payment['pid']}")
        return True

    app = App(names.app())
    (
        app.stream(orders_topic)
        .join_interval(
            app.stream(payments_topic).filter(flaky),
            within=timedelta(seconds=10),
            timestamp="ts",
            merge=lambda order, payment: [order["oid"], payment["pid"]],
            grace=timedelta(minutes=5),
        )
        .to(out)
    )
    orders, payments = [], []
    for n in range(120):
        if n % 2:
            payments.append({"pid": f"p{n}", "ts": T0 + n * 1_000})
            produce(payments_topic, [("k", payments[-1])])
        else:
            orders.append({"oid": f"o{n}", "ts": T0 + n * 1_000})
            produce(orders_topic, [("k", orders[-1])])
    settings = make_settings(PSPF_BATCH_SIZE=25, PSPF_RETRY_BASE_MS=1, PSPF_RETRY_MODE=mode)
    summary = Worker(app, settings).run(until_idle=True)
    assert summary.retried + summary.parked == 3 and summary.dead_lettered == 0 and summary.late == 0
    got = [tuple(o["value"]) for o in outputs(rclient, out, 1)]
    want = {(o["oid"], p["pid"]) for o in orders for p in payments if abs(o["ts"] - p["ts"]) <= 10_000}
    assert len(got) == len(set(got)) and set(got) == want
    assert seen.count("p31") == 3 and seen.count("p33") == 1  # retried, and the rest once each


def tier_app(name: str, orders: str, customers: str, out: str) -> App:
    """The third pipeline of the dataflow how-to: orders with the customer's tier as of their time."""
    app = App(name)
    table = app.table(customers, versioned=timedelta(days=7), timestamp="ts")
    (
        app.stream(orders)
        .join_asof(
            table,
            timestamp="ts",
            merge=lambda order, customer: {"oid": order["oid"], "tier": customer and customer["tier"]},
        )
        .to(out)
    )
    return app


def expected_tiers(written: list[tuple[str, dict[str, Any]]]) -> dict[str, str | None]:
    """Each order's tier: the update of its customer before it (in write order) latest at its time."""
    found: dict[str, str | None] = {}
    updates: list[dict[str, Any]] = []
    for kind, value in written:
        if kind == "customer":
            updates.append(value)
            continue
        mine = [u for u in updates if u["customer"] == value["customer"] and u["ts"] <= value["ts"]]
        found[value["oid"]] = max(mine, key=lambda u: u["ts"])["tier"] if mine else None
    return found


def test_an_as_of_join_through_a_worker_sees_the_row_current_at_each_orders_time(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    rclient: redis.Redis,
    names: Names,
) -> None:
    orders_topic, customers_topic, out = make_topic(2), make_topic(2), make_topic(1)
    rng = random.Random(3)
    written: list[tuple[str, dict[str, Any]]] = []
    for n in range(600):
        customer = f"c{rng.randrange(5)}"
        ts = T0 + n * 60_000 + rng.randrange(-600_000, 600_000)  # updates and orders a little out of order
        if rng.random() < 0.3:
            value = {"customer": customer, "tier": rng.choice(["bronze", "silver", "gold"]), "ts": ts}
            written.append(("customer", value))
            produce(customers_topic, [(customer, value)])
        else:
            value = {"customer": customer, "oid": f"o{n}", "ts": ts}
            written.append(("order", value))
            produce(orders_topic, [(customer, value)])
    app = tier_app(names.app(), orders_topic, customers_topic, out)
    summary = Worker(app, make_settings(PSPF_BATCH_SIZE=29)).run(until_idle=True)
    assert summary.dead_lettered == 0
    got = {o["value"]["oid"]: o["value"]["tier"] for o in outputs(rclient, out, 1)}
    assert len(outputs(rclient, out, 1)) == len(got)
    assert got == expected_tiers(written)
    assert sum(1 for tier in got.values() if tier is None) < len(got) / 2


def test_an_ordered_producer_gives_ids_in_send_order_across_topics_and_partitions(
    redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    a, b = make_topic(3), make_topic(2)
    settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
    with Producer(settings=settings, ordered=True) as producer:
        for n in range(300):  # many in one millisecond: one sequence, not one per stream
            producer.send(a if n % 3 else b, {"n": n}, key=f"k{n % 7}")
    assert producer.sent == 300
    found = []
    for topic, count in ((a, 3), (b, 2)):
        for partition in range(count):
            for entry_id, fields in rclient.xrange(stream_key(topic, partition)):
                ms, seq = entry_id.decode().split("-")
                found.append(((int(ms), int(seq)), json.loads(fields[b"value"])["n"]))
    assert [n for _, n in sorted(found)] == list(range(300))
    assert len({entry_id for entry_id, _ in found}) == 300
    c, d = make_topic(1), make_topic(1)
    with Producer(settings=settings) as unordered:  # one call per topic at a flush: not in send order
        for n in range(50):
            unordered.send(c if n % 2 else d, {"n": n}, key="k1")
    ids = {
        json.loads(fields[b"value"])["n"]: tuple(map(int, entry_id.decode().split("-")))
        for topic in (c, d)
        for entry_id, fields in rclient.xrange(stream_key(topic, 0))
    }
    assert sorted(ids, key=lambda n: ids[n]) != list(range(50))
