"""Window benchmark: a tumbling one-minute count per key against the order-totals app, in the same run.

Usage::

    python benchmarks/windows.py                     # 100,000 entries, 100 keys, 3 runs
    python benchmarks/windows.py --entries 50000 --runs 5 --store rocksdb
    python benchmarks/windows.py --open 100000       # also: peak RSS with 100,000 open windows

Throughput: each run pre-loads the same entries (order values with an event time ``ts`` spread
in order over 60 minutes, each up to 5 s early or late) into ONE partition of two fresh topics
and a plain stream. A worker (a child process, ``run(until_idle=True)``) runs the order-totals
app of ``benchmarks/throughput.py`` over the first topic, and the windowed count (tumbling one
minute, grace 10 s, results emitted to a topic) over the second, alternating which goes first;
each reports its CPU seconds and the server's. The plain redis-py loop of
``benchmarks/throughput.py`` runs in this process over the copy. Every run checks the results:
the count of every window closed is the count of its entries.

Open windows: ``--open N`` puts N entries of N distinct keys in one minute (N open windows, none
closed) and reports the windowed worker's peak RSS, next to the order-totals app's on the same
entries (N keys of state).

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
from collections import Counter
from datetime import timedelta
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
    max_rss_mb,
    order_totals_app,
    own_redis_server,
    preload,
    run_plain,
)
from pspf import App, Settings, Worker, windows  # noqa: E402
from pspf.keys import stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402

MINUTE_MS = 60_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % MINUTE_MS


def window_app(name: str, topic: str, out: str) -> App:
    app = App(name)

    @app.window(
        topic,
        windows.tumbling(timedelta(minutes=1), grace=timedelta(seconds=10)),
        timestamp="ts",
        emit_to=out,
    )
    def count(total: int | None, order: dict) -> int:  # type: ignore[type-arg] # as the order app
        return (total or 0) + 1

    return app


def make_timed_orders(entries: int, keys: int, span_ms: int, seed: int = 23) -> list[tuple[str, bytes]]:
    """(key, JSON value) of about 100 bytes with an event time ``ts``, in order over ``span_ms``."""
    rng = random.Random(seed)
    encoder = msgspec.json.Encoder()
    out = []
    for i in range(entries):
        user = f"u{rng.randrange(keys)}" if keys < entries else f"u{i}"
        ts = T0 + int(i * span_ms / entries) + rng.randint(-5000, 5000)
        order = {"user": user, "amount": rng.randrange(1, 1000), "ts": ts, "note": ""}
        room = 100 - len(encoder.encode(order))
        order["note"] = "".ljust(room, ".")[: max(room, 0)]
        out.append((user, encoder.encode(order)))
    return out


def worker_child(args: argparse.Namespace) -> None:
    """Run one worker until idle; print {"seconds", "rss_mb", "cpu", "server_cpu"}."""
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
    app = window_app(args.app, args.topic, args.out) if args.out else order_totals_app(args.app, args.topic)
    costs, start = Costs(args.broker), time.perf_counter()
    Worker(app, settings).run(until_idle=True)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rss_mb": max_rss_mb(), **costs.spent()}))


def run_child(
    args: argparse.Namespace, url: str, app: str, topic: str, out: str, state_dir: str
) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        *("--broker", url, "--app", app, "--topic", topic, "--out", out, "--state-dir", state_dir),
        *("--batch-size", str(args.batch_size), "--store", args.store),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker child failed ({done.returncode}):\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def closed_counts(orders: list[tuple[str, bytes]]) -> Counter[tuple[str, int]]:
    """The counts of the windows a single partition closes (stream time passes end + 10 s)."""
    decode = msgspec.json.Decoder().decode
    counts: Counter[tuple[str, int]] = Counter()
    now = 0
    for user, value in orders:
        ts = decode(value)["ts"]
        now = max(now, ts)
        start = ts - ts % MINUTE_MS
        if start + MINUTE_MS + 10_000 > now:
            counts[(user, start)] += 1
    return Counter({w: n for w, n in counts.items() if w[1] + MINUTE_MS + 10_000 <= now})


def run_both(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], copy: str | None, order: int = 0
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The order-totals and the windowed worker over the same entries (the windowed one first when
    ``order`` is odd); their reports, and the windowed app's output topic (``copy``: a plain
    stream that gets the entries too)."""
    run = uuid.uuid4().hex[:8]
    totals_topic, window_topic, out = f"bench-{run}-a", f"bench-{run}-b", f"bench-{run}-out"
    preload(url, totals_topic, copy, orders)
    preload(url, window_topic, None, orders)
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    service.create_topic(out, 1)
    service.close()
    found = {}
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        for name in ("totals", "windowed") if order % 2 == 0 else ("windowed", "totals"):
            topic, output = (totals_topic, "") if name == "totals" else (window_topic, out)
            found[name] = run_child(args, url, f"app-{run}-{name}", topic, output, state_dir)
    return found["totals"], found["windowed"], out


def throughput_run(
    url: str, args: argparse.Namespace, orders: list[tuple[str, bytes]], order: int
) -> dict[str, Any]:
    copy = f"bench-{uuid.uuid4().hex[:8]}-copy"
    totals, windowed, out = run_both(url, args, orders, copy, order)
    plain = run_plain(url, copy, f"plain-{copy}", args.batch_size, raw=True)
    client = redis.Redis.from_url(url)
    results = Counter(
        {
            (r["key"], r["start"]): r["value"]
            for r in (json.loads(fields[b"value"]) for _, fields in client.xrange(stream_key(out, 0)))
        }
    )
    client.close()
    if results != closed_counts(orders):
        raise RuntimeError("the window results differ from the counts of their entries")
    n = len(orders)
    return {
        "totals": n / totals["seconds"],
        "windows": n / windowed["seconds"],
        "plain": n / plain["seconds"],
        "children": {"totals": totals, "windows": windowed},
    }


def open_windows_rss(url: str, args: argparse.Namespace) -> tuple[float, float]:
    """Peak RSS (MiB) of the windowed worker holding ``args.open`` open windows, and of order totals."""
    orders = make_timed_orders(args.open, args.open, span_ms=1)  # one minute, N keys: N open windows
    totals, windowed, _ = run_both(url, args, orders, None)
    return windowed["rss_mb"], totals["rss_mb"]


def report(url: str, description: str, args: argparse.Namespace) -> None:
    orders = make_timed_orders(args.entries, args.keys, span_ms=60 * MINUTE_MS)
    runs = [throughput_run(url, args, orders, i) for i in range(args.runs)]
    med = {name: statistics.median(r[name] for r in runs) for name in ("totals", "windows", "plain")}
    apps = ("totals", "windows")
    cpu = {name: cpu_per_million([r["children"][name] for r in runs], args.entries) for name in apps}
    ratios = [r["windows"] / r["totals"] for r in runs]
    print(
        f"{description}; store {args.store}; {args.entries:,} entries, {args.keys:,} keys, "
        f"{os.cpu_count()} cores"
    )
    print(f"Throughput, entries/s, median of {args.runs} run(s); CPU seconds per million entries")
    print(f"  order totals                         {med['totals']:>10,.0f}   {cpu['totals']}")
    print(
        f"  tumbling 1-minute count per key      {med['windows']:>10,.0f}   {cpu['windows']}; "
        "results emitted and published"
    )
    print(f"  plain redis-py loop                  {med['plain']:>10,.0f}")
    print(
        f"  ratio windows / order totals         {statistics.median(ratios):>10.2f}   "
        f"(per run: {', '.join(f'{x:.2f}' for x in ratios)}; target >= 0.85)"
    )
    versus_plain = statistics.median(r["windows"] / r["plain"] for r in runs)
    print(f"  ratio windows / plain loop           {versus_plain:>10.2f}")
    if args.open:
        windowed, totals = open_windows_rss(url, args)
        print(
            f"Peak RSS with {args.open:,} open windows: {windowed:.0f} MiB "
            f"(order totals, {args.open:,} keys: {totals:.0f} MiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000, help="entries per throughput run (100000)")
    parser.add_argument("--keys", type=int, default=100, help="distinct keys (100)")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs; medians are reported (3)")
    parser.add_argument(
        "--open", type=int, default=0, help="also measure the peak RSS with this many open windows"
    )
    parser.add_argument("--batch-size", type=int, default=1000, help="PSPF_BATCH_SIZE and COUNT (1000)")
    parser.add_argument("--store", choices=("sqlite", "rocksdb"), default="sqlite")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
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


if __name__ == "__main__":
    main()
