"""A test sink of the idempotent tier: each batch one JSON-lines file in a directory.

``ROOT/<partition>/<first id>_<last id>.jsonl``: a header line holding the position (base64),
then one line per record. Written to a hidden temporary file, flushed, and renamed into place,
so a file is there whole or not at all, and the same batch written again replaces its file.
The whole sink is this file plus its line in the conformance suite's ``SINKS``.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pspf.keys import StreamId
from pspf.sink import BatchName, IdempotentPartition, IdempotentSink, SinkRecord


class DirPartition(IdempotentPartition):
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: BatchName, records: Sequence[SinkRecord], position: bytes) -> None:
        final = self.folder / f"{name}.jsonl"
        temporary = self.folder / f".{name}.{os.getpid()}.tmp"
        with temporary.open("wb") as out:
            out.write(msgspec.json.encode({"position": base64.b64encode(position).decode()}) + b"\n")
            for record in records:
                out.write(msgspec.json.encode(record) + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)

    def last(self) -> bytes | None:
        names = [p for p in self.folder.glob("*.jsonl") if not p.name.startswith(".")]
        if not names:
            return None
        latest = max(names, key=lambda p: StreamId.parse(p.stem.partition("_")[2]))
        with latest.open("rb") as found:
            header = json.loads(found.readline())
        return base64.b64decode(header["position"])


class DirSink(IdempotentSink):
    def __init__(self, root: str | Path, name: str = "sink-dir") -> None:
        self.root = Path(root)
        self.name = name

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def target(self, partition: int) -> IdempotentPartition:
        return DirPartition(self.root / str(partition))

    def describe(self) -> str:
        return f"files in {self.root}"


def delivered(root: Path) -> Iterator[dict[str, Any]]:
    """Every record the sink's files hold (a record written twice comes twice)."""
    for path in sorted(root.glob("*/*.jsonl")):
        lines = path.read_bytes().splitlines()
        yield from (json.loads(line) for line in lines[1:])
