"""Producer benchmark: ``Producer.send_raw`` against a plain pipelined XADD loop.

Usage::

    python benchmarks/produce.py                   # 500,000 entries, 4 partitions, 5 runs
    python benchmarks/produce.py --entries 100000 --partitions 8 --runs 3

Each run writes the same keyed entries (~100-byte JSON values, 1,000 keys) twice, in this process:

- the plain loop, the baseline: redis-py with hiredis, each entry's partition by the same CRC32
  rule, ``XADD`` per entry into a pipeline of 1,000 (transaction off), replies left as they come;
- the ``Producer`` (batch 1,000): the same routing, with the layout guard that keeps a producer out
  of a topic being repartitioned (``lua/add.lua``: one script call per partition and batch).

Both are checked to have written every entry. The report gives entries/s and the ratio
Producer/plain per run, and their medians. A server of its own as ``benchmarks/throughput.py``
starts one, unless ``--broker``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from benchmarks.baseline import make_orders, own_redis_server  # noqa: E402
from pspf import Producer, Settings  # noqa: E402
from pspf.keys import stream_key  # noqa: E402
from pspf.service import Service  # noqa: E402

BATCH = 1000


def run_plain(url: str, prefix: str, partitions: int, orders: list[tuple[str, bytes]]) -> float:
    """Entries/s of the plain loop, into streams ``prefix:N``."""
    client = redis.Redis.from_url(url)
    streams = [f"{prefix}:{p}" for p in range(partitions)]
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for n, (user, value) in enumerate(orders, 1):
        key = user.encode()
        pipe.xadd(streams[zlib.crc32(key) % partitions], {b"key": key, b"value": value})
        if n % BATCH == 0:
            pipe.execute()
    pipe.execute()
    seconds = time.perf_counter() - started
    written = sum(client.xlen(s) for s in streams)
    assert written == len(orders), f"plain loop wrote {written} of {len(orders)}"
    client.delete(*streams)
    client.close()
    return len(orders) / seconds


def run_producer(url: str, topic: str, partitions: int, orders: list[tuple[str, bytes]]) -> float:
    """Entries/s of the Producer into a new topic."""
    service = Service(Settings.load({"PSPF_BROKER": url}, environ={}))
    try:
        service.create_topic(topic, partitions)
        started = time.perf_counter()
        with Producer(service.broker, batch_size=BATCH) as producer:
            for user, value in orders:
                producer.send_raw(topic, value, key=user)
        seconds = time.perf_counter() - started
        client = redis.Redis.from_url(url)
        written = sum(client.xlen(stream_key(topic, p)) for p in range(partitions))
        assert written == len(orders), f"the Producer wrote {written} of {len(orders)}"
        service.retire.delete_topic(topic)
        client.close()
    finally:
        service.close()
    return len(orders) / seconds


def one_run(url: str, partitions: int, orders: list[tuple[str, bytes]]) -> dict[str, Any]:
    name = uuid.uuid4().hex[:8]
    plain = run_plain(url, f"bench-plain-{name}", partitions, orders)
    produced = run_producer(url, f"bench-produce-{name}", partitions, orders)
    return {"plain": plain, "producer": produced, "ratio": produced / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=500_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--broker", help="an existing server's URL (default: one of its own)")
    args = parser.parse_args()
    orders = make_orders(args.entries, 1000)
    if args.broker:
        report(args, args.broker, "given server", orders)
        return
    with own_redis_server() as (url, where):
        report(args, url, where, orders)


def report(args: argparse.Namespace, url: str, where: str, orders: list[tuple[str, bytes]]) -> None:
    print(f"{args.entries} entries into {args.partitions} partitions; Redis: {where}")
    results = []
    for run in range(args.runs):
        result = one_run(url, args.partitions, orders)
        results.append(result)
        print(
            f"run {run + 1}: plain {result['plain']:,.0f}/s, Producer {result['producer']:,.0f}/s, "
            f"ratio {result['ratio']:.2f}"
        )
    medians = {name: statistics.median(r[name] for r in results) for name in ("plain", "producer", "ratio")}
    print(
        f"median: plain {medians['plain']:,.0f}/s, Producer {medians['producer']:,.0f}/s, "
        f"ratio Producer/plain {medians['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
