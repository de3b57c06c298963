"""PostgreSQL sink benchmark: ``PostgresSink`` (rows mode) against a plain psycopg loop.

Usage::

    python benchmarks/sink_postgres.py                     # 200,000 entries, 3 runs
    python benchmarks/sink_postgres.py --entries 50000 --runs 5
    python benchmarks/sink_postgres.py --dsn postgresql://me@127.0.0.1/bench

Each run loads the same entries (~100-byte JSON values, 1,000 keys) into one partition of a fresh
topic and a plain stream beside it (``benchmarks.baseline.preload``). Then, in this process:

- the plain loop, the baseline: redis-py with hiredis, ``XREADGROUP COUNT <batch>`` with the reply
  left raw, each entry's row built from its flat field list, one transaction per batch with the
  rows (ONE ``INSERT ... SELECT * FROM unnest(<a list per column>) ON CONFLICT DO NOTHING``, as
  the sink writes them) and an update of a checkpoint row, then the XACK pipelined with the next
  read;
- the sink: ``PostgresSink(dsn, table).run(topic, settings, until_idle=True)``: the same rows,
  plus what exactly once costs (leases, fencing, the processor's bookkeeping, decoding the value
  and encoding it again as JSON).

Both tables are checked to hold every entry once. The report gives rows/s and the ratio
sink/plain per run, and their medians. Without ``--dsn`` a PostgreSQL of its own (Debian's
``postgresql`` package, ``fsync=off``) is started in a temporary directory, and a Redis-protocol
server as ``benchmarks/throughput.py`` starts one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402

from benchmarks.baseline import make_orders, own_redis_server, preload  # noqa: E402
from pspf import Settings  # noqa: E402
from pspf.keys import stream_key  # noqa: E402
from pspf.sink_postgres import PostgresSink  # noqa: E402

BATCH = 1000


@contextmanager
def own_postgres() -> Iterator[str]:
    """A throw-away PostgreSQL; yields its DSN."""
    import shutil
    import tempfile

    from tests.support.postgres import PostgresServer

    root = Path(tempfile.mkdtemp(prefix="pspf-bench-postgres-"))
    try:
        server = PostgresServer(root)
        try:
            yield server.dsn()
        finally:
            server.stop("immediate")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_plain(url: str, dsn: str, stream: str, table: str) -> tuple[int, float]:
    """The baseline loop; (rows written, seconds)."""
    client = redis.Redis.from_url(url, protocol=2)
    client.response_callbacks.pop("XREADGROUP", None)  # the reply left raw
    client.response_callbacks.pop("XACK", None)
    client.xgroup_create(stream, "plain", id="0")
    read = ("XREADGROUP", "GROUP", "plain", "c", "COUNT", BATCH, "STREAMS", stream, ">")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"CREATE TABLE {table} (partition integer, entry_id text, key text, value jsonb, "
            "headers jsonb, PRIMARY KEY (partition, entry_id))"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS plain_checkpoints (stream text PRIMARY KEY, entry_id text)")
        conn.commit()
        insert = (
            f"INSERT INTO {table} SELECT * FROM unnest(%s::integer[], %s::text[], %s::text[], "
            "%s::jsonb[], %s::jsonb[]) ON CONFLICT (partition, entry_id) DO NOTHING"
        )
        checkpoint = (
            "INSERT INTO plain_checkpoints VALUES (%s, %s) "
            "ON CONFLICT (stream) DO UPDATE SET entry_id = EXCLUDED.entry_id"
        )
        written, started = 0, time.perf_counter()
        reply = client.execute_command(*read)  # type: ignore[no-untyped-call]
        while reply:
            entries = reply[0][1]
            ids, keys, values = [], [], []
            for entry_id, flat in entries:
                key = value = b""
                for i in range(0, len(flat), 2):
                    if flat[i] == b"value":
                        value = flat[i + 1]
                    elif flat[i] == b"key":
                        key = flat[i + 1]
                ids.append(entry_id.decode())
                keys.append(key.decode())
                values.append(value.decode())
            with conn.transaction(), conn.cursor() as cur:
                cur.execute(insert, ([0] * len(ids), ids, keys, values, ["{}"] * len(ids)))
                cur.execute(checkpoint, (stream, ids[-1]))
            written += len(ids)
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("XACK", stream, "plain", *(entry_id for entry_id, _ in entries))  # type: ignore[no-untyped-call]
            pipe.execute_command(*read)  # type: ignore[no-untyped-call]
            reply = pipe.execute()[1]
        return written, time.perf_counter() - started


def run_sink(url: str, dsn: str, topic: str, table: str) -> tuple[int, float]:
    settings = Settings.load({"PSPF_BROKER": url, "PSPF_BLOCK_MS": 100, "PSPF_BATCH_SIZE": BATCH}, environ={})
    started = time.perf_counter()
    summary = PostgresSink(dsn, table).run(topic, settings, until_idle=True)
    return summary.handled, time.perf_counter() - started


def check(dsn: str, table: str, entries: int) -> None:
    with psycopg.connect(dsn) as conn:
        found = conn.execute(f"SELECT count(*), count(DISTINCT entry_id) FROM {table}").fetchone()
    if found != (entries, entries):
        raise SystemExit(f"{table}: {found} rows (all, distinct), expected {entries}")


def one_run(url: str, dsn: str, orders: list[tuple[str, bytes]]) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topic, plain = f"bench-sink-{tag}", f"bench-sink-plain-{tag}"
    preload(url, topic, plain, orders)
    plain_rows, plain_s = run_plain(url, dsn, plain, f"plain_{tag}")
    sink_rows, sink_s = run_sink(url, dsn, topic, f"sink_{tag}")
    check(dsn, f"plain_{tag}", len(orders))
    check(dsn, f"sink_{tag}", len(orders))
    client = redis.Redis.from_url(url)
    client.delete(plain, stream_key(topic, 0))
    plain_rate, sink_rate = plain_rows / plain_s, sink_rows / sink_s
    return {"plain": plain_rate, "sink": sink_rate, "ratio": sink_rate / plain_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dsn", help="an existing PostgreSQL (tables are created in it)")
    args = parser.parse_args()
    orders = make_orders(args.entries, 1000)
    with own_redis_server() as (url, where), own_postgres() if args.dsn is None else _given(args.dsn) as dsn:
        print(f"{args.entries} entries; Redis: {where}; PostgreSQL: {'own' if args.dsn is None else 'given'}")
        results = []
        for run in range(args.runs):
            result = one_run(url, dsn, orders)
            results.append(result)
            print(
                f"run {run + 1}: plain {result['plain']:,.0f} rows/s, sink {result['sink']:,.0f} rows/s, "
                f"ratio {result['ratio']:.2f}"
            )
        medians = {name: statistics.median(r[name] for r in results) for name in ("plain", "sink", "ratio")}
        print(
            f"median: plain {medians['plain']:,.0f} rows/s, sink {medians['sink']:,.0f} rows/s, "
            f"ratio sink/plain {medians['ratio']:.2f}"
        )


@contextmanager
def _given(dsn: str) -> Iterator[str]:
    yield dsn


if __name__ == "__main__":
    main()
