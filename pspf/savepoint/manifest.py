"""A savepoint on disk: a directory of one state file per partition and ``manifest.json``, written last.

The directory is a local path or ``s3://bucket/prefix/NAME`` (fsspec, as the files sink uses). A
partition's file holds its state backup's fields and values (``namespace NUL key`` -> value, as the
backup keeps them) in frames: a 4-byte big-endian length, then a msgpack list of ``[field, value]``
pairs. The manifest names every file with its SHA-256 and counts; a directory without one is a
savepoint that was never finished, and nothing restores from it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from pspf.errors import ConfigError, NotFound, StateError

#: The manifest's format; a reader refuses a later one.
FORMAT = 1
MANIFEST = "manifest.json"
#: Pairs per frame.
FRAME = 5_000

_LENGTH = struct.Struct(">I")
_pairs_encoder = msgspec.msgpack.Encoder()
_pairs_decoder = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]])


class TopicCut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where one partition's stream of one topic stood at the cut."""

    #: the last entry whose effects the state holds (None: none yet)
    checkpoint: str | None = None
    #: where the app's group began in the stream (entries before it were never meant for it)
    start: str | None = None
    #: the group's last delivered id when the cut was taken (shown, not restored)
    delivered: str | None = None
    #: the first entry after the checkpoint then (None: there was none): a restore needs it still
    next_entry: str | None = None
    #: the stream's last id then, and the entries ever added to it (Redis 7+): entries added since
    #: that a restore needs, and whether retention trimmed any of them
    last: str | None = None
    added: int | None = None
    #: entries the cut's bookkeeping says still need a handler (a parked retry, a dead entry on its
    #: way to the DLQ, one a foreign consumer took): delivered again after a restore
    waiting: list[str] = []


class PartitionCut(msgspec.Struct, kw_only=True):
    """One partition of the app at the cut, and its file."""

    partition: int
    file: str
    topics: dict[str, TopicCut]
    #: values of every kind (state, windows, timers, outbox rows, bookkeeping)
    values: int
    #: keys of ``ctx.state``
    keys: int
    #: the outbox's unpublished pages
    outbox_pages: int
    sha256: str
    size: int


class TopicLayout(msgspec.Struct, kw_only=True):
    partitions: int
    #: the layout generation (one more after each repartition)
    layout: str


class Manifest(msgspec.Struct, kw_only=True):
    """What a savepoint holds (``manifest.json``)."""

    format: int = FORMAT
    app: str
    name: str
    taken_ms: int
    #: taken from a stopped app (nothing in flight) rather than while it ran
    stopped: bool
    partitions: int
    #: the app's topics, in its order (the first one's partitions carry its state backup)
    topics: list[str]
    layouts: dict[str, TopicLayout]
    #: the app's record as the server kept it (tables, global tables, state schemas, ...)
    record: dict[str, str]
    parts: list[PartitionCut]
    seconds: float = 0.0

    @property
    def keys(self) -> int:
        return sum(part.keys for part in self.parts)


class Location:
    """A savepoint directory, local or in an object store."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/") or url
        try:
            self.fs: Any
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except ImportError as exc:
            raise ConfigError(
                f"savepoints at {url!r} need the files extra: pip install 'pspf[files]' ({exc})"
            ) from None
        except (ValueError, OSError) as exc:
            raise ConfigError(f"cannot use {url!r} for savepoints: {exc}") from None

    def child(self, name: str) -> Location:
        return Location(f"{self.url}/{name}")

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def make(self) -> None:
        if "file" in _protocols(self.fs):
            self.fs.makedirs(self.root, exist_ok=True)

    def write_pairs(self, name: str, pairs: Iterable[tuple[bytes, bytes]]) -> tuple[str, int]:
        """Write ``pairs`` as the file ``name``; its SHA-256 and size."""
        digest = hashlib.sha256()
        size = 0
        with self.fs.open(self.path(name), "wb") as out:
            for frame in _frames(pairs):
                body = _pairs_encoder.encode(frame)
                chunk = _LENGTH.pack(len(body)) + body
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        return digest.hexdigest(), size

    def read_pairs(self, part: PartitionCut) -> Iterator[list[tuple[bytes, bytes]]]:
        """A partition's file, frame by frame; ``StateError`` at the end when its checksum is wrong."""
        digest = hashlib.sha256()
        try:
            source = self.fs.open(self.path(part.file), "rb")
        except FileNotFoundError:
            raise StateError(f"savepoint {self.url}: the file {part.file} is missing") from None
        with source:
            while head := source.read(_LENGTH.size):
                body = source.read(_LENGTH.unpack(head)[0]) if len(head) == _LENGTH.size else b""
                digest.update(head + body)
                try:
                    frame = _pairs_decoder.decode(body)
                except msgspec.DecodeError:
                    break  # cut short: the checksum below says so
                yield frame
        if digest.hexdigest() != part.sha256:
            raise StateError(
                f"savepoint {self.url}: the file {part.file} is damaged (its SHA-256 is not the one "
                "the manifest holds): nothing was restored from it"
            )

    def write_manifest(self, manifest: Manifest) -> None:
        with self.fs.open(self.path(MANIFEST), "wb") as out:
            out.write(msgspec.json.format(msgspec.json.encode(manifest)))

    def read_manifest(self) -> Manifest:
        try:
            with self.fs.open(self.path(MANIFEST), "rb") as source:
                raw = source.read()
        except FileNotFoundError:
            raise NotFound(
                f"{self.url} holds no savepoint ({MANIFEST} is missing: none was taken there, or "
                "it was never finished)"
            ) from None
        except (OSError, ValueError) as exc:  # not a directory, a name too long, a NUL in it
            raise ConfigError(f"cannot read a savepoint at {self.url!r}: {exc}") from None
        try:
            manifest = msgspec.json.decode(raw, type=Manifest)
        except msgspec.DecodeError as exc:
            raise StateError(f"savepoint {self.url}: {MANIFEST} is not a savepoint manifest: {exc}") from None
        if manifest.format > FORMAT:
            raise StateError(
                f"savepoint {self.url} has format {manifest.format}; this PSPF reads up to {FORMAT}: "
                "upgrade it"
            )
        return manifest

    def remove(self) -> None:
        """Delete the directory and what it holds (gone already: nothing to do)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)


def _frames(pairs: Iterable[tuple[bytes, bytes]]) -> Iterator[list[tuple[bytes, bytes]]]:
    frame: list[tuple[bytes, bytes]] = []
    for pair in pairs:
        frame.append(pair)
        if len(frame) >= FRAME:
            yield frame
            frame = []
    if frame:
        yield frame


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


class SavepointEntry(msgspec.Struct, kw_only=True):
    """An app's savepoint as the server lists it (``keys.savepoints_key``)."""

    name: str
    #: the savepoint's directory: what ``pspf app restore --from`` takes
    path: str
    taken_ms: int
    #: "taking" until its manifest is written, then "complete"
    state: str
    partitions: int = 0
    keys: int = 0
    stopped: bool = False
