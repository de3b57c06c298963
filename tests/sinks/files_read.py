"""What the files sink delivered, read back: JSON Lines line by line, Parquet with pyarrow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow.parquet as pq


def files_delivered(url: str) -> Iterator[dict[str, Any]]:
    """Every record of every object under ``url`` (a record written twice comes twice)."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        return
    fs.invalidate_cache()
    for path in sorted(fs.find(root)):
        name = path.rpartition("/")[2]
        if name.startswith("."):
            continue
        if name.endswith(".jsonl"):
            lines = fs.cat_file(path).splitlines()
            yield from (json.loads(line) for line in lines[1:])
        elif name.endswith(".parquet"):
            with fs.open(path, "rb") as source:
                yield from pq.read_table(source).to_pylist()
