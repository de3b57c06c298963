"""Dataflow benchmark: the spend pipeline written as a stream against the same pipeline by hand.

Usage::

    python benchmarks/dataflow.py                    # 100,000 orders, 200 customers, 3 runs
    python benchmarks/dataflow.py --entries 50000 --runs 5 --store rocksdb

Each run pre-loads the same orders (quantity, price, customer and an event time ``ts`` spread in
order over 60 minutes, each up to 5 s early or late; one in ten with no quantity) into ONE
partition of two fresh topics. A worker (a child process, ``run(until_idle=True)``, which
returns once every emitted entry is published and read back) runs, over one topic:

- **stream**: ``app.stream(orders).filter(qty > 0).map(amount).group_by(customer, topic=...)
  .window(tumbling 1 minute, timestamp="ts", grace 10 s).agg(total=Sum, n=Count).to(out)``;
- **by hand**: an app whose ``@app.handler`` filters, computes the amount and ``ctx.emit``s it
  under the customer's key to a topic, then a second app whose ``@app.window`` (the same window)
  sums and counts that topic into a dict accumulator, results emitted to ``out``; one worker of
  each, one after the other (their seconds added). By hand it takes two apps: in one, the
  handler's entries (at the time Redis appended them) would move the partition's stream time
  that the window's event times are judged by, and every window would be late. A stream's window
  keeps its own stream time.

Both re-key through a topic and close the same windows: every run checks that the two outputs
hold the same totals and counts. The ratio stream / by hand is the acceptance figure (>= 0.9).

Without ``--broker``, a server of its own is started (see ``benchmarks/throughput.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from benchmarks.baseline import own_redis_server, preload  # noqa: E402
from pspf import App, Context, Settings, Worker, agg, windows  # noqa: E402
from pspf.keys import stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402

MINUTE_MS = 60_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % MINUTE_MS
WINDOW = windows.tumbling(timedelta(minutes=1))
GRACE = timedelta(seconds=10)


def stream_app(name: str, orders: str, by_customer: str, out: str) -> App:
    app = App(name)
    (
        app.stream(orders)
        .filter(lambda o: o["qty"] > 0)
        .map(lambda o: {"customer": o["customer"], "amount": o["qty"] * o["price"], "ts": o["ts"]})
        .group_by(lambda v: v["customer"], topic=by_customer)
        .window(WINDOW, timestamp="ts", grace=GRACE)
        .agg(total=agg.Sum("amount"), n=agg.Count())
        .to(out)
    )
    return app


def route_app(name: str, orders: str, by_customer: str, out: str) -> App:
    app = App(name)

    @app.handler(orders)
    def route(order: dict[str, Any], ctx: Context) -> None:
        if order["qty"] > 0:
            amount = order["qty"] * order["price"]
            ctx.emit(
                by_customer,
                {"customer": order["customer"], "amount": amount, "ts": order["ts"]},
                key=order["customer"],
            )

    return app


def window_app(name: str, orders: str, by_customer: str, out: str) -> App:
    app = App(name)

    @app.window(
        by_customer,
        windows.tumbling(timedelta(minutes=1), grace=GRACE),
        timestamp="ts",
        emit_to=out,
    )
    def spend(acc: dict[str, Any] | None, value: dict[str, Any]) -> dict[str, Any]:
        if acc is None:
            return {"total": value["amount"], "n": 1}
        acc["total"] += value["amount"]
        acc["n"] += 1
        return acc

    return app


def make_orders(entries: int, customers: int, seed: int = 29) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    span = 60 * MINUTE_MS
    found = []
    for n in range(entries):
        order = {
            "oid": f"o{n}",
            "customer": f"c{rng.randrange(customers)}",
            "qty": 0 if rng.random() < 0.1 else rng.randrange(1, 5),
            "price": rng.randrange(1, 100),
            "ts": T0 + n * span // entries + rng.randrange(-5_000, 5_000),
        }
        found.append((order["oid"], json.dumps(order).encode()))
    return found


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker until idle; print {"seconds"}."""
    import logging

    logging.getLogger("pspf").setLevel(logging.ERROR)
    settings = Settings.load(
        {
            "PSPF_BROKER": args.broker,
            "PSPF_STATE_DIR": args.state_dir,
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": args.batch_size,
            "PSPF_STORE": args.store,
        },
        environ={},
    )
    make = {"stream": stream_app, "route": route_app, "window": window_app}[args.kind]
    start = time.perf_counter()
    Worker(make(args.app, args.topic, args.rekey, args.out), settings).run(until_idle=True)
    print(json.dumps({"seconds": time.perf_counter() - start}))


def run_child(args: argparse.Namespace, url: str, kind: str, topic: str, state_dir: str) -> dict[str, Any]:
    """The ``kind`` pipeline over ``topic``: its seconds and the window results it emitted."""
    rekey, out = f"{topic}-by-customer", f"{topic}-out"
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(out, 1)
    if kind == "hand":
        service.create_topic(rekey, 1)
    service.close()
    seconds = 0.0
    for step in ["stream"] if kind == "stream" else ["route", "window"]:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            *("--kind", step, "--broker", url, "--app", f"app-{uuid.uuid4().hex[:8]}", "--topic", topic),
            *("--rekey", rekey, "--out", out, "--state-dir", state_dir),
            *("--batch-size", str(args.batch_size), "--store", args.store),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the worker child failed ({done.returncode}):\n{done.stderr}")
        seconds += json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    report: dict[str, Any] = {"seconds": seconds}
    client = redis.Redis.from_url(url)
    values = [json.loads(fields[b"value"]) for _, fields in client.xrange(stream_key(out, 0))]
    client.close()
    report["results"] = {
        (v["key"], v["start"]): (v["total"], v["n"]) if "n" in v else (v["value"]["total"], v["value"]["n"])
        for v in values
    }
    return report


def one_run(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], order: int
) -> dict[str, float]:
    run = uuid.uuid4().hex[:8]
    topics = {"stream": f"bench-{run}-s", "hand": f"bench-{run}-h"}
    for topic in topics.values():
        preload(url, topic, None, orders)
    found = {}
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        kinds = ["stream", "hand"] if order % 2 == 0 else ["hand", "stream"]  # alternate who goes first
        for kind in kinds:
            found[kind] = run_child(args, url, kind, topics[kind], state_dir)
    if found["stream"]["results"] != found["hand"]["results"] or not found["stream"]["results"]:
        raise RuntimeError("the stream and the hand-written pipeline emitted different window results")
    n = len(orders)
    return {kind: n / report["seconds"] for kind, report in found.items()}


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_orders(args.entries, args.customers)
    runs = [one_run(url, args, orders, i) for i in range(args.runs)]
    ratios = [r["stream"] / r["hand"] for r in runs]
    print(
        f"{description}; store {args.store}; {args.entries:,} orders, {args.customers:,} customers, "
        f"{os.cpu_count()} cores"
    )
    print(f"Throughput, orders/s, median of {args.runs} run(s)")
    print(f"  stream (app.stream ... .agg ... .to)    {statistics.median(r['stream'] for r in runs):>10,.0f}")
    print(f"  by hand (handler + ctx.emit, window)    {statistics.median(r['hand'] for r in runs):>10,.0f}")
    print(
        f"  ratio stream / by hand                  {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.9)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="orders per run (100000)")
    parser.add_argument("--customers", type=int, default=200, help="distinct customers (200)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (3)")
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--store", choices=("sqlite", "rocksdb"), default="sqlite")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--kind", "--app", "--topic", "--rekey", "--out", "--state-dir"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        worker_child(args)
        return
    if args.broker:
        report(args.broker, f"Redis at {args.broker}", args)
        return
    with own_redis_server() as (url, description):
        report(url, description, args)


if __name__ == "__main__":
    main()
