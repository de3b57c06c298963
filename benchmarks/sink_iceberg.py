"""Iceberg sink benchmark: ``IcebergSink`` (a SQL catalog on SQLite, a local warehouse) against a plain loop.

Usage::

    python benchmarks/sink_iceberg.py                     # 200,000 entries, 3 runs
    python benchmarks/sink_iceberg.py --entries 50000 --runs 5

Each run loads the same entries (~100-byte JSON values, 1,000 keys) into one partition of a fresh
topic and a plain stream beside it (``benchmarks.baseline.preload``). Then, in this process, with
one pyiceberg SQL catalog (SQLite) whose warehouse is a temporary folder:

- the plain loop: redis-py with hiredis, ``XREADGROUP COUNT <batch>`` with the reply left raw,
  each batch appended to an Iceberg table of the same columns as ONE pyarrow table
  (``table.append``: one snapshot; the value left as the JSON text it was read as), then the XACK
  pipelined with the next read;
- the same loop appending as the sink does (``append_trimmed``: from a copy of the metadata with
  the current snapshot only; pyiceberg's own ``append`` copies the whole metadata many times, a
  cost that grows with every snapshot): the strongest loop, the baseline;
- the sink: ``IcebergSink(table).run(topic, settings, until_idle=True)``: the same snapshots,
  plus what exactly once costs (leases, the processor's bookkeeping, the position in each
  snapshot's summary and the owner check before it, a claim snapshot, decoding each value and
  encoding it again as JSON).

Every table is checked to hold every entry once. The report gives entries/s and the ratios of the
sink to each loop per run, and their medians (target: sink / strongest loop >= 0.7). A server of
its own is started as ``benchmarks/throughput.py`` starts one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run the checkout's code even when it is not installed
    sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import redis  # noqa: E402
from pyiceberg.catalog import load_catalog  # noqa: E402
from pyiceberg.io.pyarrow import schema_to_pyarrow  # noqa: E402

from benchmarks.baseline import make_orders, own_redis_server, preload  # noqa: E402
from pspf import Settings  # noqa: E402
from pspf.keys import StreamId  # noqa: E402
from pspf.sink.iceberg import IcebergSink, append_trimmed, table_schema  # noqa: E402

BATCH = 1000


def run_plain(
    url: str, stream: str, properties: dict[str, str], table_name: str, trimmed: bool
) -> tuple[int, float]:
    """The baseline loop; (entries written, seconds). ``trimmed``: appends as the sink makes them."""
    catalog = load_catalog("bench", **properties)
    catalog.create_namespace_if_not_exists("bench")
    table = catalog.create_table(table_name, schema=table_schema())
    schema = schema_to_pyarrow(table.schema())
    client = redis.Redis.from_url(url, protocol=2)
    client.response_callbacks.pop("XREADGROUP", None)  # the reply left raw
    client.response_callbacks.pop("XACK", None)
    group = "trimmed" if trimmed else "plain"  # each loop reads the stream whole in its own group
    client.xgroup_create(stream, group, id="0")
    read = ("XREADGROUP", "GROUP", group, "c", "COUNT", BATCH, "STREAMS", stream, ">")
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
        count = len(ids)
        columns = {
            "topic": [stream] * count,
            "partition": [0] * count,
            "id": ids,
            "key": keys,
            "value": values,
            "encoding": ["json"] * count,
            "headers": [[]] * count,
            "timestamp": [StreamId.parse(i).ms for i in ids],
        }
        if trimmed:
            table = append_trimmed(table, pa.table(columns, schema=schema), {})
        else:
            table.append(pa.table(columns, schema=schema))
        written += count
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("XACK", stream, group, *(entry_id for entry_id, _ in entries))  # type: ignore[no-untyped-call]
        pipe.execute_command(*read)  # type: ignore[no-untyped-call]
        reply = pipe.execute()[1]
    return written, time.perf_counter() - started


def run_sink(url: str, topic: str, properties: dict[str, str], table_name: str) -> tuple[int, float]:
    settings = Settings.load({"PSPF_BROKER": url, "PSPF_BLOCK_MS": 100, "PSPF_BATCH_SIZE": BATCH}, environ={})
    started = time.perf_counter()
    summary = IcebergSink(table_name, catalog="bench", properties=properties).run(
        topic, settings, until_idle=True
    )
    return summary.handled, time.perf_counter() - started


def delivered(properties: dict[str, str], table_name: str) -> list[str]:
    table = load_catalog("bench", **properties).load_table(table_name)
    ids: list[str] = table.scan(selected_fields=("id",)).to_arrow().column("id").to_pylist()
    return ids


def one_run(url: str, orders: list[tuple[str, bytes]]) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topic, plain = f"bench-iceberg-{tag}", f"bench-iceberg-plain-{tag}"
    preload(url, topic, plain, orders)
    with tempfile.TemporaryDirectory(prefix="pspf-bench-iceberg-") as root:
        (Path(root) / "warehouse").mkdir()
        properties = {
            "type": "sql",
            "uri": f"sqlite:///{root}/catalog.db",
            "warehouse": f"file://{root}/warehouse",
        }
        plain_n, plain_s = run_plain(url, plain, properties, f"bench.plain_{tag}", trimmed=False)
        strong_n, strong_s = run_plain(url, plain, properties, f"bench.strong_{tag}", trimmed=True)
        sink_n, sink_s = run_sink(url, topic, properties, f"bench.sink_{tag}")
        written = (
            (f"bench.plain_{tag}", plain_n),
            (f"bench.strong_{tag}", strong_n),
            (f"bench.sink_{tag}", sink_n),
        )
        for name, written_n in written:
            ids = delivered(properties, name)
            if len(ids) != len(orders) or len(set(ids)) != len(orders) or written_n != len(orders):
                raise SystemExit(f"{name}: {len(ids)} rows ({len(set(ids))} distinct), {written_n} written")
    plain_rate, strong_rate, sink_rate = plain_n / plain_s, strong_n / strong_s, sink_n / sink_s
    return {
        "plain": plain_rate,
        "strong": strong_rate,
        "sink": sink_rate,
        "ratio": sink_rate / plain_rate,
        "strong ratio": sink_rate / strong_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    orders = make_orders(args.entries, 1000)
    with own_redis_server() as (url, where):
        print(f"{args.entries} entries; Redis: {where}; batches of {BATCH}")
        results = []
        for run in range(args.runs):
            result = one_run(url, orders)
            results.append(result)
            print(
                f"run {run + 1}: plain {result['plain']:,.0f} entries/s, trimmed {result['strong']:,.0f}, "
                f"sink {result['sink']:,.0f}; sink/plain {result['ratio']:.2f}, "
                f"sink/trimmed {result['strong ratio']:.2f}"
            )
        medians = {name: statistics.median(r[name] for r in results) for name in results[0]}
        print(
            f"median: plain {medians['plain']:,.0f} entries/s, trimmed {medians['strong']:,.0f}, "
            f"sink {medians['sink']:,.0f}; sink/plain {medians['ratio']:.2f}, "
            f"sink/trimmed {medians['strong ratio']:.2f} (the strongest loop; target >= 0.7)"
        )


if __name__ == "__main__":
    main()
