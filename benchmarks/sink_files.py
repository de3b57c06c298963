"""Files sink benchmark: ``FilesSink`` (Parquet, a local folder) against a plain pyarrow loop.

Usage::

    python benchmarks/sink_files.py                     # 200,000 entries, 3 runs
    python benchmarks/sink_files.py --entries 50000 --runs 5 --format jsonl

Each run loads the same entries (~100-byte JSON values, 1,000 keys) into one partition of a fresh
topic and a plain stream beside it (``benchmarks.baseline.preload``). Then, in this process:

- the plain loop, the baseline: redis-py with hiredis, ``XREADGROUP COUNT <batch>`` with the reply
  left raw, each batch written as ONE Parquet file of the same columns (pyarrow; the value left as
  the JSON text it was read as) under a temporary name, fsynced and renamed, then the XACK
  pipelined with the next read;
- the sink: ``FilesSink(folder, "parquet").run(topic, settings, until_idle=True)``: the same
  objects, plus what exactly once costs (leases, the processor's bookkeeping and the position in
  each object's metadata, decoding each value and encoding it again as JSON).

Both folders are checked to hold every entry once. The report gives entries/s and the ratio
sink/plain per run, and their medians (target >= 0.7). A server of its own is started as
``benchmarks/throughput.py`` starts one.
"""

from __future__ import annotations

import argparse
import os
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
import pyarrow.parquet as pq  # noqa: E402
import redis  # noqa: E402

from benchmarks.baseline import make_orders, own_redis_server, preload  # noqa: E402
from pspf import Settings  # noqa: E402
from pspf.keys import StreamId  # noqa: E402
from pspf.sink.files import FilesSink  # noqa: E402
from tests.sinks.files_read import files_delivered  # noqa: E402

BATCH = 1000


def run_plain(url: str, stream: str, folder: Path) -> tuple[int, float]:
    """The baseline loop; (entries written, seconds)."""
    client = redis.Redis.from_url(url, protocol=2)
    client.response_callbacks.pop("XREADGROUP", None)  # the reply left raw
    client.response_callbacks.pop("XACK", None)
    client.xgroup_create(stream, "plain", id="0")
    folder.mkdir(parents=True)
    read = ("XREADGROUP", "GROUP", "plain", "c", "COUNT", BATCH, "STREAMS", stream, ">")
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
        table = pa.table(
            {
                "topic": [stream] * count,
                "partition": pa.array([0] * count, pa.int32()),
                "id": ids,
                "key": keys,
                "value": values,
                "encoding": ["json"] * count,
                "headers": pa.array([[]] * count, pa.map_(pa.string(), pa.string())),
                "timestamp": [StreamId.parse(i).ms for i in ids],
            }
        )
        final = folder / f"{ids[0]}_{ids[-1]}.parquet"
        temporary = folder / f".{final.name}.tmp"
        with temporary.open("wb") as out:
            pq.write_table(table, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
        written += count
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("XACK", stream, "plain", *(entry_id for entry_id, _ in entries))  # type: ignore[no-untyped-call]
        pipe.execute_command(*read)  # type: ignore[no-untyped-call]
        reply = pipe.execute()[1]
    return written, time.perf_counter() - started


def run_sink(url: str, topic: str, folder: Path, fmt: str) -> tuple[int, float]:
    settings = Settings.load({"PSPF_BROKER": url, "PSPF_BLOCK_MS": 100, "PSPF_BATCH_SIZE": BATCH}, environ={})
    started = time.perf_counter()
    summary = FilesSink(str(folder), "parquet" if fmt == "parquet" else "jsonl").run(
        topic, settings, until_idle=True
    )
    return summary.handled, time.perf_counter() - started


def one_run(url: str, orders: list[tuple[str, bytes]], fmt: str) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    topic, plain = f"bench-files-{tag}", f"bench-files-plain-{tag}"
    preload(url, topic, plain, orders)
    with tempfile.TemporaryDirectory(prefix="pspf-bench-files-") as root:
        plain_n, plain_s = run_plain(url, plain, Path(root) / "plain")
        sink_n, sink_s = run_sink(url, topic, Path(root) / "sink", fmt)
        delivered = [r["id"] for r in files_delivered(str(Path(root) / "sink"))]
        if len(delivered) != len(orders) or len(set(delivered)) != len(orders) or plain_n != len(orders):
            raise SystemExit(f"delivered {len(delivered)} ({len(set(delivered))} distinct), plain {plain_n}")
    plain_rate, sink_rate = plain_n / plain_s, sink_n / sink_s
    return {"plain": plain_rate, "sink": sink_rate, "ratio": sink_rate / plain_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--format", choices=("parquet", "jsonl"), default="parquet", help="the sink's (parquet)"
    )
    args = parser.parse_args()
    orders = make_orders(args.entries, 1000)
    with own_redis_server() as (url, where):
        print(f"{args.entries} entries; Redis: {where}; sink format {args.format}")
        results = []
        for run in range(args.runs):
            result = one_run(url, orders, args.format)
            results.append(result)
            print(
                f"run {run + 1}: plain {result['plain']:,.0f} entries/s, "
                f"sink {result['sink']:,.0f} entries/s, ratio {result['ratio']:.2f}"
            )
        medians = {name: statistics.median(r[name] for r in results) for name in ("plain", "sink", "ratio")}
        print(
            f"median: plain {medians['plain']:,.0f} entries/s, sink {medians['sink']:,.0f} entries/s, "
            f"ratio sink/plain {medians['ratio']:.2f} (target >= 0.7)"
        )


if __name__ == "__main__":
    main()
