"""What ``benchmarks/scale.py`` runs: its entries, its worker children and what it reads from Redis.

- ``sized_orders``: entries of a chosen size over a chosen number of keys, generated as they are
  written (10^7 of them never sit in memory at once); the first ``keys`` entries write every key;
- ``preload``: entries into a new topic of P partitions, with the totals its state must reach;
- ``run_workers``: worker children (``Worker(app, settings).run(until_idle=True)``, each with its
  own state dir), run at the same time, one per (app, worker); their times, CPU seconds and peak
  RSS, and the server's CPU seconds meanwhile;
- ``check_app``: an app's state as its state backup in Redis holds it (the truth, also when a
  partition moved between workers) against the expected totals, and nothing left pending;
- ``redis_memory``: ``MEMORY USAGE`` of every key a point left, summed by kind of key.

Run as a script, this module is the worker child (internal: ``scale.py`` starts it).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from benchmarks.baseline import (  # noqa: E402
    Order,
    cpu_seconds,
    max_rss_mb,
    order_totals_app,
    server_cpu_seconds,
)
from pspf import Producer, Settings, Worker  # noqa: E402
from pspf.keys import (  # noqa: E402
    APPS_KEY,
    BACKUP_BUCKETS,
    STATE_NAMESPACE,
    STORE_NAMESPACES,
    TOPICS_KEY,
    backup_keys,
    bucket_keys,
    stream_key,
)
from pspf.service import Service  # noqa: E402

#: (keys, sum of amounts, entries) an app's state must add up to.
Expected = tuple[int, int, int]


class Loaded(NamedTuple):
    """What a preload wrote: the totals an app's state must reach, and the values' bytes."""

    expected: Expected
    value_bytes: int


#: A prime: ``i * STEP % keys`` visits every key once over ``keys`` steps when it does not divide keys.
STEP = 7919
#: What one pipelined round trip of the preload carries at most.
PRELOAD_BYTES = 4_000_000
#: How long a point's children may take before the benchmark gives up.
CHILD_TIMEOUT_S = 3600


# -- the entries --------------------------------------------------------------------------------


def sized_orders(entries: int, keys: int, size: int = 100, seed: int = 17) -> Iterator[tuple[str, bytes]]:
    """(key, JSON ``Order``) pairs of about ``size`` bytes; the first ``keys`` write every key once."""
    rng = random.Random(seed)
    step = STEP if math.gcd(STEP, keys) == 1 else 1
    for i in range(entries):
        k = i * step % keys if i < keys else rng.randrange(keys)
        head = f'{{"user":"u{k}","amount":{rng.randrange(1, 1000)},"note":"'
        yield f"u{k}", (head + "." * max(0, size - len(head) - 2) + '"}').encode()


def preload(url: str, topic: str, partitions: int, orders: Iterable[tuple[str, bytes]], keys: int) -> Loaded:
    """The entries into a new topic of ``partitions`` partitions (keyed); the totals they make.

    Keys are ``u<n>`` with n < ``keys`` (``make_orders`` and ``sized_orders`` both).
    """
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    decode = msgspec.json.Decoder(Order).decode
    seen = bytearray(keys)
    total = count = value_bytes = 0
    try:
        service.create_topic(topic, partitions)
        with Producer(service.broker, batch_size=5_000) as producer:
            for user, value in orders:
                producer.batch_size = max(1, min(5_000, PRELOAD_BYTES // len(value)))
                producer.send_raw(topic, value, key=user)
                seen[int(user[1:])] = 1
                total += decode(value).amount
                count += 1
                value_bytes += len(value)
    finally:
        service.close()
    return Loaded((seen.count(1), total, count), value_bytes)


# -- the worker child ---------------------------------------------------------------------------


def worker_child(args: argparse.Namespace) -> dict[str, Any]:
    """One worker until idle: wall-clock moments, counts, CPU seconds, peak RSS, what its stores hold."""
    # The own server persists nothing by design; the worker's warning about it is expected.
    logging.getLogger("pspf").setLevel(logging.ERROR)
    env = {
        "PSPF_BROKER": args.broker,
        "PSPF_STATE_DIR": args.state_dir,
        "PSPF_CONSUMER": args.consumer,
        "PSPF_BLOCK_MS": 100,
        "PSPF_BATCH_SIZE": args.batch_size,
        "PSPF_STORE": args.store,
        "PSPF_STATE_BACKUP_BUCKETS": args.backup_buckets,
    }
    if args.lease_ttl_ms:
        env["PSPF_LEASE_TTL_MS"] = args.lease_ttl_ms
    worker = Worker(order_totals_app(args.app, args.topic, typed=True), Settings.load(env, environ={}))
    # Wall-clock (time.time) moments, so that children's times can be put on one line.
    first_cycle: list[float] = []
    last_read: list[float] = []
    run_once = worker.processor.run_once

    def timed_run_once(**options: Any) -> Any:
        if not first_cycle:
            first_cycle.append(time.time())
        result = run_once(**options)
        if result.read:
            last_read[:] = [time.time()]
        return result

    worker.processor.run_once = timed_run_once  # type: ignore[method-assign, assignment]
    cpu = cpu_seconds()
    start = time.time()
    summary = worker.run(until_idle=True)
    end = time.time()
    result: dict[str, Any] = {
        "start": start,
        "first_cycle": first_cycle[0] if first_cycle else end,
        "last_read": last_read[0] if last_read else None,
        "end": end,
        "cpu_seconds": cpu_seconds() - cpu,
        "rss_peak_mb": max_rss_mb(),
        "handled": summary.handled,
        "failed": summary.failed,
    }
    if args.sizes:
        result.update(store_sizes(Path(args.state_dir), args.app, args.store))
    return result


def store_sizes(state_dir: Path, app: str, engine: str) -> dict[str, int]:
    """What the app's stores under ``state_dir`` hold: values and sum of len(key) + len(value), files."""
    from pspf.state_stores import open_store, stored_partitions

    sizes = {"store_values": 0, "store_bytes": 0, "state_keys": 0, "state_bytes": 0}
    for partition in stored_partitions(engine, state_dir, app):
        with open_store(engine, state_dir, app, partition, readonly=True) as store:
            for namespace in STORE_NAMESPACES:
                for key, value in store.items(namespace):
                    size = len(key.encode()) + len(value)
                    sizes["store_values"] += 1
                    sizes["store_bytes"] += size
                    if namespace == STATE_NAMESPACE:
                        sizes["state_keys"] += 1
                        sizes["state_bytes"] += size
    sizes["disk_bytes"] = sum(p.stat().st_size for p in state_dir.rglob("*") if p.is_file())
    return sizes


# -- running children ---------------------------------------------------------------------------


def run_workers(
    url: str,
    topic: str,
    apps: list[str],
    workers: int,
    batch_size: int,
    lease_ttl_ms: int | None = None,
    sizes: bool = False,
    store: str = "sqlite",
    buckets: int = 1,
) -> dict[str, Any]:
    """``workers`` children per app, all at once, each with a state dir of its own; their figures together.

    ``seconds`` runs from the first child's ``Worker.run`` call to the last one's return;
    ``steady_seconds`` from the first cycle of any to the last cycle that read entries;
    ``startup_seconds`` is the longest time from ``run`` to a child's first cycle, ``tail_seconds``
    from the last cycle that read entries to the last return (the idle check, the shutdown).
    """
    with tempfile.TemporaryDirectory(prefix="pspf-bench-scale-") as folder:
        base = [sys.executable, str(Path(__file__).resolve()), "--broker", url, "--topic", topic]
        base += ["--batch-size", str(batch_size), "--lease-ttl-ms", str(lease_ttl_ms or 0)]
        base += ["--sizes"] if sizes else []
        base += ["--store", store, "--backup-buckets", str(buckets)]
        children = []
        server_cpu = server_cpu_seconds(url)
        for app in apps:
            for i in range(workers):
                out = Path(folder) / f"{app}-{i}.out"
                command = [*base, "--app", app, "--consumer", f"scale-{i}"]
                command += ["--state-dir", str(Path(folder) / f"state-{app}-{i}")]
                with out.open("wb") as sink:
                    children.append((out, subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)))
        results = [_child_result(out, process) for out, process in children]
        server_cpu = server_cpu_seconds(url) - server_cpu
    return _together(results, server_cpu)


def _child_result(out: Path, process: subprocess.Popen[bytes]) -> dict[str, Any]:
    try:
        code = process.wait(CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    text = out.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"a worker child failed ({code}):\n{text[-4000:]}")
    return dict(json.loads(text.strip().splitlines()[-1]))


def _together(results: list[dict[str, Any]], server_cpu: float) -> dict[str, Any]:
    start = min(r["start"] for r in results)
    reads = [r["last_read"] for r in results if r["last_read"] is not None]
    first = min(r["first_cycle"] for r in results)
    together: dict[str, Any] = {
        "seconds": max(r["end"] for r in results) - start,
        "steady_seconds": (max(reads) - first) if reads else None,
        "startup_seconds": max(r["first_cycle"] - r["start"] for r in results),
        "tail_seconds": (max(r["end"] for r in results) - max(reads)) if reads else None,
        "cpu_seconds": sum(r["cpu_seconds"] for r in results),
        "server_cpu_seconds": server_cpu,
        "rss_peak_mb": max(r["rss_peak_mb"] for r in results),
        "rss_sum_mb": sum(r["rss_peak_mb"] for r in results),
        "handled": sum(r["handled"] for r in results),
        "failed": sum(r["failed"] for r in results),
        "children": len(results),
    }
    for name in ("store_values", "store_bytes", "state_keys", "state_bytes", "disk_bytes"):
        if name in results[0]:
            together[name] = sum(r[name] for r in results)
    return together


# -- what Redis holds ---------------------------------------------------------------------------


def check_app(url: str, topic: str, app: str, partitions: int, expected: Expected) -> None:
    """The app's state backup adds up to ``expected``, and no entry is left pending in its group."""
    client = redis.Redis.from_url(url)
    decode = msgspec.msgpack.Decoder(dict[str, Any]).decode
    prefix = STATE_NAMESPACE.encode() + b"\x00"
    keys = total = count = 0
    try:
        for partition in range(partitions):
            backup = backup_keys(topic, partition, app)
            buckets = int(client.hget(backup.meta, BACKUP_BUCKETS) or 1)
            for bucket in bucket_keys(backup.values, buckets):
                for name, raw in client.hscan_iter(bucket, count=10_000):
                    if name.startswith(prefix):
                        state = decode(raw)
                        keys, total, count = keys + 1, total + state["total"], count + state["count"]
        pipe = client.pipeline(transaction=False)
        for partition in range(partitions):
            pipe.xlen(stream_key(topic, partition))
            pipe.xpending(stream_key(topic, partition), app)
        replies = pipe.execute(raise_on_error=False)
    finally:
        client.close()
    pending = 0
    for length, summary in zip(replies[::2], replies[1::2], strict=True):
        if isinstance(summary, Exception):  # no group: right only where there was nothing to read
            pending += length
        else:
            pending += summary["pending"]
    if (keys, total, count) != expected or pending:
        raise SystemExit(
            f"app {app}: backup state (keys, total, count) is {(keys, total, count)}, expected {expected}; "
            f"{pending} entries left pending"
        )


def used_memory(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def redis_memory(url: str, topic: str, apps: list[str]) -> dict[str, list[int]]:
    """Every key named after the topic or an app: [keys, bytes] by kind, e.g. ``pspf:{T:P}:lease:APP``."""
    client = redis.Redis.from_url(url)
    try:
        names = [k.decode() for k in client.scan_iter(match=f"*{topic}*", count=1_000)]
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.memory_usage(name, samples=0)
        sizes = pipe.execute()
    finally:
        client.close()
    tag = re.compile(r"\{" + re.escape(topic) + r":\d+\}")
    bucket = re.compile(r"(:backup:APP):\d+$")  # a backup's buckets are one kind with it
    kinds: dict[str, list[int]] = {}
    for name, size in zip(names, sizes, strict=True):
        kind = name
        for app in sorted(apps, key=len, reverse=True):
            kind = kind.replace(app, "APP")
        kind = bucket.sub(r"\1", tag.sub("{T:P}", kind).replace(topic, "T"))
        found = kinds.setdefault(kind, [0, 0])
        found[0] += 1
        found[1] += int(size or 0)
    return dict(sorted(kinds.items()))


def cleanup(url: str, names: list[str]) -> None:
    """Delete every key named after one of ``names`` (topics and apps) and their registrations."""
    client = redis.Redis.from_url(url)
    try:
        for name in names:
            found = list(client.scan_iter(match=f"*{name}*", count=1_000))
            for start in range(0, len(found), 1_000):
                client.delete(*found[start : start + 1_000])
        client.srem(TOPICS_KEY, *names)
        client.srem(APPS_KEY, *names)
        # Valkey frees deleted keys in the background by default (lazyfree-lazy-user-del): the
        # next point's "before" must not still hold this one's keys.
        deadline = time.monotonic() + 60
        while int(client.info("memory").get("lazyfree_pending_objects", 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()


def timed(what: str, since: float) -> None:
    """A progress line on stderr, so that the tables on stdout stay clean."""
    print(f"  ({what}: {time.perf_counter() - since:.1f} s)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a worker child of benchmarks/scale.py (internal)")
    for name in ("--broker", "--topic", "--app", "--consumer", "--state-dir"):
        parser.add_argument(name, required=True)
    parser.add_argument("--batch-size", type=int, default=1_000)
    parser.add_argument("--lease-ttl-ms", type=int, default=0, help="0: PSPF's default")
    parser.add_argument("--sizes", action="store_true", help="also report what the stores hold")
    parser.add_argument("--store", default="sqlite", help="PSPF_STORE (sqlite)")
    parser.add_argument("--backup-buckets", type=int, default=1, help="PSPF_STATE_BACKUP_BUCKETS (1)")
    print(json.dumps(worker_child(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
