"""What the source tests share: objects written in each format, and a topic read back whole."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import redis

from pspf.keys import partition_for, stream_key


def encode_rows(rows: list[dict[str, Any]], fmt: str) -> bytes:
    """``rows`` as one object's bytes in ``fmt``."""
    if fmt == "jsonl":
        return b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue().encode()
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=max(1, len(rows) // 3))
    return sink.getvalue()


def topic_entries(client: redis.Redis, topic: str, partitions: int) -> list[tuple[int, str | None, Any]]:
    """Every entry as (partition, key, value); asserts each keyed one sits in its key's partition."""
    found = []
    for partition in range(partitions):
        for _id, fields in client.xrange(stream_key(topic, partition)):
            raw_key = fields.get(b"key")
            if raw_key is not None:
                assert partition_for(raw_key, partitions) == partition, (raw_key, partition)
            value = json.loads(fields[b"value"])
            found.append((partition, None if raw_key is None else raw_key.decode(), value))
    return found
