"""The files sink: a topic's entries as JSON Lines or Parquet objects in a folder or an S3 bucket.

The idempotent tier (``pspf.sink.idempotent``): each batch of one partition is ONE object,
``URL/TOPIC/PARTITION/FIRST_LAST.jsonl`` or ``.parquet``, FIRST and LAST the ids of its first
and last entries (``ms-seq``), so a listing shows what is delivered. An object is written whole:
a local file under a hidden temporary name, then renamed; an S3 object by one PUT. It carries the
partition's position (checkpoints and bookkeeping): the first line of a JSON Lines object, the
key ``pspf.position`` of a Parquet file's metadata. A new owner reads the position of the object
with the highest last id and goes on after it, so no entry is in two objects: one read again
after a crash either lands in an object of the same name, which replaces it, or is at or below
that position and skipped.

How big an object gets: at most ``roll_entries`` entries (the batch a read takes); with
``roll_seconds``, a read that filled no object is followed by a pause that long, so the next
object gathers what arrives meanwhile. Objects are never held open across batches: each is
written before its entries are acknowledged.

Each record holds the columns of PSPF's Spark source: ``topic, partition, id, key, value`` (the
value as JSON text), ``encoding`` ("json"), ``headers`` (a map of strings), ``timestamp`` (the
id's milliseconds).

``URL`` is a local folder or ``s3://bucket/prefix``, through fsspec (s3fs for S3), with
credentials, region and endpoint from the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``): AWS, MinIO or any S3
API. It needs the ``files`` extra (fsspec, s3fs, pyarrow), imported when the sink is made.
"""

from __future__ import annotations

import base64
import io
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from pspf.errors import ConfigError
from pspf.keys import StreamId, check_name
from pspf.sink.base import SinkRecord
from pspf.sink.idempotent import BatchName, IdempotentPartition, IdempotentSink

if TYPE_CHECKING:
    from pspf.settings import Settings
    from pspf.worker import Worker

Format = Literal["jsonl", "parquet"]
#: The Parquet metadata key that holds a batch's position (base64 of its msgpack)
POSITION_KEY = b"pspf.position"

_json = msgspec.json.Encoder()


def record_columns(records: Sequence[SinkRecord]) -> dict[str, list[Any]]:
    """The records as the Spark source's columns."""
    return {
        "topic": [r.topic for r in records],
        "partition": [r.partition for r in records],
        "id": [r.entry_id for r in records],
        "key": [r.key for r in records],
        "value": [_json.encode(r.value).decode() for r in records],
        "encoding": ["json"] * len(records),
        "headers": [list(r.headers.items()) for r in records],
        "timestamp": [StreamId.parse(r.entry_id).ms for r in records],
    }


def encode_jsonl(records: Sequence[SinkRecord], position: bytes) -> bytes:
    """A JSON Lines object: its position first, then one record a line."""
    columns = record_columns(records)
    lines = [_json.encode({"position": base64.b64encode(position).decode()})]
    names = list(columns)
    for row in zip(*columns.values(), strict=True):
        record = dict(zip(names, row, strict=True))
        record["headers"] = dict(record["headers"])
        lines.append(_json.encode(record))
    return b"\n".join(lines) + b"\n"


def encode_parquet(records: Sequence[SinkRecord], position: bytes) -> bytes:
    """A Parquet object whose metadata holds the position."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            pa.field("topic", pa.string(), False),
            pa.field("partition", pa.int32(), False),
            pa.field("id", pa.string(), False),
            pa.field("key", pa.string(), True),
            pa.field("value", pa.string(), True),
            pa.field("encoding", pa.string(), False),
            pa.field("headers", pa.map_(pa.string(), pa.string()), True),
            pa.field("timestamp", pa.int64(), False),
        ],
        metadata={POSITION_KEY: base64.b64encode(position)},
    )
    table = pa.table(record_columns(records), schema=schema)
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


class FilesPartition(IdempotentPartition):
    """One topic partition's objects under ``folder`` (a path of ``fs``)."""

    def __init__(self, fs: Any, folder: str, fmt: Format) -> None:
        self.fs = fs
        self.folder = folder
        self.format = fmt
        self.local = "file" in _protocols(fs)
        if self.local:
            fs.makedirs(folder, exist_ok=True)

    def write(self, name: BatchName, records: Sequence[SinkRecord], position: bytes) -> None:
        data = (
            encode_parquet(records, position) if self.format == "parquet" else encode_jsonl(records, position)
        )
        final = f"{self.folder}/{name}.{self.format}"
        if not self.local:  # one PUT: the object is there whole or not at all
            self.fs.pipe_file(final, data)
            return
        temporary = f"{self.folder}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)

    def last(self) -> bytes | None:
        found = (
            [
                path
                for path in self.fs.ls(self.folder, detail=False, refresh=True)
                if path.endswith(f".{self.format}") and not path.rpartition("/")[2].startswith(".")
            ]
            if self.fs.exists(self.folder)
            else []
        )
        if not found:
            return None
        latest = max(
            found, key=lambda p: StreamId.parse(p.rpartition("/")[2].split(".")[0].partition("_")[2])
        )
        if self.format == "parquet":
            import pyarrow.parquet as pq

            with self.fs.open(latest, "rb") as source:
                metadata = pq.read_schema(source).metadata or {}
            return base64.b64decode(metadata[POSITION_KEY])
        with self.fs.open(latest, "rb") as source:
            header = msgspec.json.decode(source.readline())
        return base64.b64decode(header["position"])


class FilesSink(IdempotentSink):
    """Deliver a topic into JSON Lines or Parquet objects under a folder or ``s3://bucket/prefix``."""

    def __init__(
        self,
        url: str,
        format: Format = "jsonl",
        name: str | None = None,
        roll_entries: int | None = None,
        roll_seconds: float | None = None,
    ) -> None:
        """Deliver into ``url``; objects of at most ``roll_entries``, or what ``roll_seconds`` gathers.

        ``roll_entries`` is the read's batch size; ``roll_seconds``: after an object that filled
        less, the next read waits this long (``PSPF_LINGER_MS``). Each object is still written
        before its entries are acknowledged: nothing waits in memory across a crash.
        """
        if format not in ("jsonl", "parquet"):
            raise ConfigError(f"sink files: format must be jsonl or parquet, got {format!r}")
        if roll_entries is not None and not 1 <= roll_entries <= 100_000:
            raise ConfigError(f"sink files: roll entries must be 1-100,000, got {roll_entries}")
        if roll_seconds is not None and not 0 <= roll_seconds <= 600:
            raise ConfigError(f"sink files: roll seconds must be 0-600, got {roll_seconds}")
        self.roll_entries = roll_entries
        self.roll_seconds = roll_seconds
        try:
            import fsspec
            import pyarrow  # noqa: F401  # the Parquet writer, and s3fs's needs, checked up front
        except ImportError as exc:
            raise ConfigError(
                f"sink files needs the files extra: pip install 'pspf[files]' ({exc})"
            ) from None
        self.url = url.rstrip("/")
        self.format: Format = format
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"sink files: cannot use {url!r}: {exc}") from None
        self.name = check_name("sink", name or f"sink-files-{_slug(self.root)}")

        #: the topic delivered (``worker``): the objects' folder under the URL
        self.topic = ""

    def worker(self, topic: str, settings: Settings) -> Worker:
        self.topic = topic
        rolled: dict[str, int] = {}
        if self.roll_entries is not None:
            rolled["batch_size"] = self.roll_entries
        if self.roll_seconds is not None:
            rolled["linger_ms"] = round(self.roll_seconds * 1000)
        if rolled:
            consumer = msgspec.structs.replace(settings.consumer, **rolled)
            settings = msgspec.structs.replace(settings, consumer=consumer)
        return super().worker(topic, settings)

    def prepare(self) -> None:
        if "file" in _protocols(self.fs):
            self.fs.makedirs(self.root, exist_ok=True)

    def target(self, partition: int) -> IdempotentPartition:
        assert self.topic, "a files sink's partitions are opened by its worker"
        return FilesPartition(self.fs, f"{self.root}/{self.topic}/{partition}", self.format)

    def describe(self) -> str:
        return f"{self.format} objects under {self.url}"


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _slug(root: str) -> str:
    """A consumer group name from a folder or bucket path."""
    kept = "".join(c if c.isalnum() or c in "._-" else "-" for c in root.strip("/"))
    return kept[-60:] or "root"
