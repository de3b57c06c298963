"""Repartition benchmark: the time and peak memory of moving a topic and an app's state.

Usage::

    python benchmarks/repartition.py                          # 1,000,000 entries, 100,000 keys, 4 -> 8
    python benchmarks/repartition.py --entries 200000 --keys 20000 --to 3

A topic of ``--from`` partitions gets the entries (~100-byte JSON values); an app that sums
them per key runs over all but the last 10% (so it has 100,000 keys of state and a backlog to
move), then stops. The repartition runs in a child process of its own (``Repartition.run``), so
its peak RSS (``VmHWM``) is its own; the report gives its wall time and peak RSS, the dry run's
time, and entries and keys per second. A server of its own as ``benchmarks/throughput.py`` starts
one, unless ``--broker``.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.baseline import max_rss_mb, own_redis_server  # noqa: E402
from pspf import App, Context, Producer, Settings, Worker  # noqa: E402
from pspf.broker import Broker  # noqa: E402
from pspf.repartition.run import Repartition, dry_run, make_plan  # noqa: E402
from pspf.service import Service  # noqa: E402


def summing_app(name: str, topic: str) -> App:
    app = App(name)

    @app.handler(topic)
    def add(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + value["amount"]

    return app


def child(args: argparse.Namespace) -> None:
    """Run the repartition here; print its figures as JSON."""
    broker = Broker(Settings.load({"PSPF_BROKER": args.broker}, environ={}).redis)
    plan = make_plan(broker, args.topic, args.to)
    started = time.perf_counter()
    summary = dry_run(broker, plan)
    dry_s = time.perf_counter() - started
    started = time.perf_counter()
    Repartition(broker, plan).run()
    seconds = time.perf_counter() - started
    keys = sum(sum(per) for per in summary.state_keys.values())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "dry_s": dry_s,
                "rss_mb": max_rss_mb(),
                "entries": summary.entries,
                "keys": keys,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--from", dest="source", type=int, default=4)
    parser.add_argument("--to", type=int, default=8)
    parser.add_argument("--broker")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.broker:
        run(args, args.broker)
        return
    with own_redis_server() as (url, where):
        print(f"server: {where}")
        run(args, url)


def run(args: argparse.Namespace, url: str) -> None:
    tag = uuid.uuid4().hex[:6]
    topic, app = f"bench-rp-{tag}", f"bench-rp-app-{tag}"
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    service.create_topic(topic, args.source)
    handled_share = args.entries * 9 // 10
    with Producer(service.broker) as producer:
        for n in range(handled_share):
            producer.send(topic, {"amount": n % 1000, "note": "x" * 60}, key=f"k{n % args.keys}")
    with tempfile.TemporaryDirectory(prefix="pspf-bench-rp-") as state_dir:
        worker_settings = Settings.load(
            {"PSPF_BROKER": url, "PSPF_STATE_DIR": state_dir, "PSPF_BLOCK_MS": 100}, environ={}
        )
        Worker(summing_app(app, topic), worker_settings).run(until_idle=True)
    with Producer(service.broker) as producer:
        for n in range(handled_share, args.entries):
            producer.send(topic, {"amount": n % 1000, "note": "x" * 60}, key=f"k{n % args.keys}")
    command = [sys.executable, __file__, "--child", "--broker", url, "--topic", topic, "--to", str(args.to)]
    found = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    print(
        f"{found['entries']:,} entries and {found['keys']:,} state keys, "
        f"{args.source} -> {args.to} partitions: "
        f"{found['seconds']:.1f} s ({found['entries'] / found['seconds']:,.0f} entries/s), "
        f"dry run {found['dry_s']:.1f} s, peak RSS {found['rss_mb']:.0f} MB"
    )


if __name__ == "__main__":
    main()
