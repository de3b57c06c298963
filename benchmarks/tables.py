"""Tables benchmark: lookups per entry against the same app without them, and a global table's bootstrap.

Usage::

    python benchmarks/tables.py                        # 200,000 entries, 3 runs, 1,000,000-row bootstrap
    python benchmarks/tables.py --entries 50000 --runs 1 --global-rows 100000
    python benchmarks/tables.py --store rocksdb

Throughput: each run pre-loads the same orders (~100-byte JSON, 1,000 keys) into ONE partition
of two fresh topics, a ``customers`` table topic (a row per key) and a ``products`` global table
topic (1,000 rows). A worker (a child process, ``run(until_idle=True)``) runs the order-totals
app over the first topic, and the same app with one ``ctx.table("customers")`` and one
``ctx.table("products", key=...)`` per entry over the second, alternating which goes first; the
ratio is lookups / none (the target: >= 0.75). Each reports its CPU seconds and the server's.
Every run checks the totals.

Bootstrap: ``--global-rows N`` rows (~100-byte JSON) in a 4-partition topic; a worker of an app
with that global table starts on an empty state dir: the time from ``Worker.run`` to its first
entry handled (one entry waits in its input topic), and the worker's peak RSS (VmHWM).

Without ``--broker``, a server of its own is started (see ``benchmarks/throughput.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from benchmarks.baseline import (  # noqa: E402
    Costs,
    cpu_per_million,
    expected_totals,
    forget_run,
    make_orders,
    max_rss_mb,
    own_redis_server,
    preload,
)
from pspf import App, Context, Settings, Worker  # noqa: E402
from pspf.keys import partition_for, stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402


def lookup_app(name: str, topic: str, customers: str | None, products: str | None) -> App:
    """Order totals; with tables, each entry also looks its customer and a product up."""
    app = App(name)
    if customers is not None and products is not None:
        app.table(customers)
        app.global_table(products)

        @app.handler(topic)
        def enrich(order: dict, ctx: Context) -> None:  # type: ignore[type-arg] # as throughput.py
            customer = ctx.table(customers)
            product = ctx.table(products, key=f"p{order['amount'] % 1000}")
            state = ctx.state
            state["total"] = state.get("total", 0) + order["amount"]
            state["count"] = state.get("count", 0) + 1
            if customer is None or product is None:
                state["missing"] = state.get("missing", 0) + 1

        return app

    @app.handler(topic)
    def add(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        state = ctx.state
        state["total"] = state.get("total", 0) + order["amount"]
        state["count"] = state.get("count", 0) + 1

    return app


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker until idle; print {"seconds", "first_entry_s", "rss", "cpu", "server_cpu", ...}."""
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
    app = lookup_app(args.app, args.topic, args.customers or None, args.products or None)
    first: list[float] = []
    costs, start = Costs(args.broker), time.perf_counter()

    class FirstEntry:
        def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
            if handled and not first:
                first.append(time.perf_counter() - start)

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    summary = Worker(app, settings, hooks=FirstEntry()).run(until_idle=True)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    totals = {"total": 0, "count": 0, "missing": 0}
    from pspf.state_stores import open_store

    with open_store(args.store, args.state_dir, args.app, 0, readonly=True) as store:
        for _, raw in store.items("state"):
            state = msgspec.msgpack.decode(raw)
            for name in totals:
                totals[name] += state.get(name, 0)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "first_entry_s": first[0] if first else None,
                "rss": max_rss_mb(),
                **costs.spent(),
                "handled": summary.handled,
                **totals,
            }
        )
    )


def run_child(
    args: argparse.Namespace, url: str, app: str, topic: str, tables: tuple[str, str] | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--broker",
            url,
            "--app",
            app,
            "--topic",
            topic,
            "--state-dir",
            state_dir,
            "--batch-size",
            str(args.batch_size),
            "--store",
            args.store,
        ]
        if tables is not None:
            command += ["--customers", tables[0], "--products", tables[1]]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker child failed ({done.returncode}):\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def add_rows(url: str, topic: str, partitions: int, rows: int, size: int = 100) -> None:
    """``rows`` keyed rows of about ``size`` bytes into a new topic, pipelined."""
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(topic, partitions)
    service.close()
    client = redis.Redis.from_url(url)
    encoder = msgspec.json.Encoder()
    for start in range(0, rows, 5000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(rows, start + 5000)):
            key = f"p{i}"
            row = {"name": f"product {i}", "price": i % 1000}
            row["note"] = "x" * max(0, size - len(encoder.encode(row)) - 10)
            pipe.xadd(
                stream_key(topic, partition_for(key.encode(), partitions)),
                {b"key": key.encode(), b"value": encoder.encode(row)},
            )
        pipe.execute()
    client.close()


def throughput_run(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], order: int
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    plain_topic, lookup_topic = f"bench-{run}-a", f"bench-{run}-b"
    customers, products = f"bench-{run}-customers", f"bench-{run}-products"
    client = redis.Redis.from_url(url)
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(customers, 1)
    service.close()
    pipe = client.pipeline(transaction=False)
    for user in sorted({user for user, _ in orders}):
        pipe.xadd(stream_key(customers, 0), {b"key": user.encode(), b"value": b'{"tier":"gold"}'})
    pipe.execute()
    client.close()
    add_rows(url, products, 1, 1000)
    preload(url, plain_topic, None, orders)
    preload(url, lookup_topic, None, orders)
    found = {}
    for name in ("without", "with") if order % 2 == 0 else ("with", "without"):
        if name == "without":
            found[name] = run_child(args, url, f"app-{run}-a", plain_topic, None)
        else:
            found[name] = run_child(args, url, f"app-{run}-b", lookup_topic, (customers, products))
    without, with_lookups = found["without"], found["with"]
    _, total, count = expected_totals(orders)
    for result in (without, with_lookups):
        if (result["total"], result["count"], result["missing"]) != (total, count, 0):
            raise RuntimeError(f"wrong totals: {result} (expected {total}, {count}, 0 missing)")
    forget_run(url, run)
    n = len(orders)
    return {
        "without": n / without["seconds"],
        "with": n / with_lookups["seconds"],
        "rss": with_lookups["rss"],
        "children": found,
    }


def bootstrap_run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    topic, customers, products = f"boot-{run}-in", f"boot-{run}-customers", f"boot-{run}-products"
    started = time.perf_counter()
    add_rows(url, products, 4, args.global_rows)
    loaded_s = time.perf_counter() - started
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(customers, 1)
    service.close()
    preload(url, topic, None, make_orders(1, 1))
    result = run_child(args, url, f"boot-{run}", topic, (customers, products))
    return {**result, "produce_s": loaded_s}


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_orders(args.entries, args.keys)
    runs = [throughput_run(url, args, orders, i) for i in range(args.runs)]
    cpu = {
        name: cpu_per_million([r["children"][name] for r in runs], args.entries)
        for name in ("without", "with")
    }
    ratios = [r["with"] / r["without"] for r in runs]
    print(
        f"{description}; store {args.store}; {args.entries:,} entries, {args.keys:,} keys, "
        f"{os.cpu_count()} cores"
    )
    print(f"Throughput, entries/s, median of {args.runs} run(s); CPU seconds per million entries")
    print(
        f"  order totals                               "
        f"{statistics.median(r['without'] for r in runs):>10,.0f}   {cpu['without']}"
    )
    print(
        f"  + ctx.table lookup and global lookup/entry "
        f"{statistics.median(r['with'] for r in runs):>10,.0f}   {cpu['with']}"
    )
    print(
        f"  ratio lookups / none                       {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.75)"
    )
    print(f"  peak RSS with lookups, MB                  {statistics.median(r['rss'] for r in runs):>10.1f}")
    if args.global_rows:
        boot = bootstrap_run(url, args)
        print(
            f"Global table bootstrap: {args.global_rows:,} rows (~100 bytes) in 4 partitions, empty state dir"
        )
        print(f"  start -> first entry handled                {boot['first_entry_s']:>9.2f} s")
        print(
            f"  rows/s                                      {args.global_rows / boot['first_entry_s']:>9,.0f}"
        )
        print(f"  worker peak RSS, MB                         {boot['rss']:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200_000, help="entries per throughput run (200000)")
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs; medians are reported (3)")
    parser.add_argument("--global-rows", type=int, default=1_000_000, help="rows of the bootstrap (0: skip)")
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--store", choices=("sqlite", "rocksdb"), default="sqlite")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--customers", default="", help=argparse.SUPPRESS)
    parser.add_argument("--products", default="", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
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
