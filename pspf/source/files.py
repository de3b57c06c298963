"""The files source: every row of the JSON Lines, CSV or Parquet objects under a URL into a topic, once.

``URL`` is a local folder (or one file) or ``s3://bucket/prefix``, through fsspec like the files
sink (s3fs for S3, credentials and endpoint from the standard ``AWS_*`` variables); the objects
are every file under it, recursively, whose name ends with the format's extension (hidden names
left out), read in path order. Each row becomes one entry: its value the row as a JSON object,
its key the row's key field as text, its partition the key's.

Exactly once: each object is a producer of its own (``source/NAME/LAYOUT/PATH``) whose rows are
numbered (the line number for JSON Lines, the row number otherwise), and ``pspf.source.appending``
appends them through the publishing script, which records the last number per partition in the
same call as the rows it adds. A run started again after a kill reads an unfinished object from
its start and sends only rows above the records. An object added whole joins the source's done
set (``keys.source_done_key``) and is not read again, even when it changes afterwards.

A row the source cannot add (not JSON, not an object, no key field) stops the run with the
object's path and the row's number; the rows before it are added, none after. Fixed, the object
is read again and goes on from that row.
"""

from __future__ import annotations

import logging
import signal
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from pspf import codec, keys
from pspf.broker import Broker, TopicCount, partition_count
from pspf.errors import ConfigError, PSPFError
from pspf.settings import Settings
from pspf.source.appending import Appender, Row
from pspf.source.formats import EXTENSIONS, Format, RowProblem, read_records, record_key

log = logging.getLogger("pspf.source")

#: Rows read before they are sent: one pipelined round of publishing calls.
CHUNK_ROWS = 1000


class SourceSummary(msgspec.Struct, kw_only=True):
    """What a run of a source did."""

    source: str
    topic: str
    #: objects read to their end in this run
    objects: int = 0
    #: objects skipped because an earlier run had added them whole
    objects_done_before: int = 0
    #: rows this run added, and rows it found in the topic already (added by an earlier run)
    rows_added: int = 0
    rows_already: int = 0


class FilesSource:
    """Add every row of the objects under ``url`` to ``topic``, each once, also across kills.

    Example:
        ```python
        from pspf import Settings
        from pspf.source.files import FilesSource

        source = FilesSource("s3://lake/orders", "orders", "parquet", key_field="user")
        summary = source.run(Settings.load())
        print(summary.rows_added)
        ```
    """

    def __init__(
        self,
        url: str,
        topic: str,
        format: Format = "jsonl",
        key_field: str | None = None,
        name: str | None = None,
    ) -> None:
        """Check the arguments and the URL; nothing is read yet.

        Raises:
            ConfigError: a format other than jsonl, csv or parquet, an invalid topic or source
                name, a URL fsspec cannot use, or the files extra missing.
        """
        if format not in EXTENSIONS:
            raise ConfigError(f"source files: format must be jsonl, csv or parquet, got {format!r}")
        try:
            import fsspec
            import pyarrow  # noqa: F401  # Parquet, and s3fs's needs, checked up front
        except ImportError as exc:
            raise ConfigError(
                f"source files needs the files extra: pip install 'pspf[files]' ({exc})"
            ) from None
        self.url = url.rstrip("/") or url
        self.topic = keys.check_name("topic", topic)
        self.format: Format = format
        self.key_field = key_field
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError, TypeError) as exc:
            raise ConfigError(f"source files: cannot use {url!r}: {_one_line(exc)}") from None
        self.root = self.root.rstrip("/") or self.root
        self.name = keys.check_name("source", name or default_name(self.root, topic))

    def objects(self) -> list[tuple[str, str]]:
        """The objects to read, (path, path under the URL), in path order.

        Raises:
            ConfigError: the URL names nothing, or cannot be listed (a missing bucket, no access).
        """
        try:
            self.fs.invalidate_cache()
            if self.fs.isfile(self.root):
                found = [self.root]
            elif "file" in _protocols(self.fs) and not self.fs.isdir(self.root):
                raise ConfigError(f"source files: no folder or file at {self.url!r}")
            else:
                found = self.fs.find(self.root, withdirs=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"source files: cannot list {self.url!r}: {_one_line(exc)}") from None
        objects = []
        for path in sorted(found):
            base = path.rpartition("/")[2]
            if base.startswith(".") or not base.endswith(EXTENSIONS[self.format]):
                continue
            relative = path[len(self.root) :].lstrip("/") or base
            objects.append((path, relative))
        return objects

    def run(
        self,
        settings: Settings | None = None,
        follow: bool = False,
        interval_s: float = 2.0,
        stop: threading.Event | None = None,
    ) -> SourceSummary:
        """Add the objects not added yet; with ``follow``, look for new ones every ``interval_s``.

        A followed run ends when ``stop`` is set, or on SIGTERM or SIGINT (Ctrl-C) when it runs in
        the main thread; a stop between two chunks leaves the object to the next run.

        Raises:
            NotFound: the topic does not exist.
            ConfigError: the URL cannot be listed, or a row cannot be added (its object and
                number named; the rows before it are added).
            BrokerError: Redis is unreachable or refused a write; a run again goes on.
        """
        stop = stop or threading.Event()
        broker = Broker((settings or Settings.load()).redis)
        summary = SourceSummary(source=self.name, topic=self.topic)
        try:
            count = partition_count(broker.topics, self.topic, wait_s=broker.conn.repartition_wait_s)
            seen: set[str] = set()
            with _stopped_by_signals(stop, follow):
                while True:
                    count = self._pass(broker, count, summary, stop, seen)
                    if not follow or stop.wait(interval_s):
                        break
        finally:
            broker.close()
        return summary

    def _pass(
        self, broker: Broker, count: TopicCount, summary: SourceSummary, stop: threading.Event, seen: set[str]
    ) -> TopicCount:
        """Read every object not done yet; the topic's count as last known.

        ``seen``: the objects this run counted already (read, or found done), across passes.
        """
        record = _SourceRecord(broker, self.name, self.topic)
        done = record.done()
        for path, relative in self.objects():
            if stop.is_set():
                break
            if relative in seen:
                continue
            if relative in done:
                summary.objects_done_before += 1
                seen.add(relative)
                continue
            count, finished = self._add_object(broker, record, count, path, relative, summary, stop)
            if finished:
                seen.add(relative)
        return count

    def _add_object(
        self,
        broker: Broker,
        record: _SourceRecord,
        count: TopicCount,
        path: str,
        relative: str,
        summary: SourceSummary,
        stop: threading.Event,
    ) -> tuple[TopicCount, bool]:
        """Add one object's rows not in the topic yet; mark it done when it is read to its end.

        Returns the topic's count as last known, and whether the object was read to its end.
        """
        history = record.layouts(relative)
        appender = Appender(
            broker,
            self.topic,
            producer=lambda layout: f"source/{self.name}/{layout}/{relative}",
            count=count,
            before_layout=lambda new: record.remember(relative, history, new),
        )
        if history:
            appender.earlier(history)
        finished = False
        try:
            finished = self._read_into(appender, path, stop)
        except RowProblem as exc:
            where = "line" if self.format == "jsonl" else "row"
            raise ConfigError(
                f"{relative} {where} {exc.number}: {exc} ({appender.added + appender.already} rows before it "
                "are in the topic, none after it); fix the object and run again: nothing is added twice"
            ) from None
        finally:
            summary.rows_added += appender.added
            summary.rows_already += appender.already
        if finished:
            record.finish(relative)
            summary.objects += 1
            log.info("source %s: %s added (%s rows new)", self.name, relative, appender.added)
        return appender.count, finished

    def _read_into(self, appender: Appender, path: str, stop: threading.Event) -> bool:
        """Send an object's rows a chunk at a time; False when ``stop`` ended it early."""
        chunk: list[Row] = []
        try:
            for row in self._rows(path):
                chunk.append(row)
                if len(chunk) >= CHUNK_ROWS:
                    appender.append(chunk)
                    chunk = []
                    if stop.is_set():
                        return False
        except RowProblem:
            appender.append(chunk)  # the rows before a bad one go in, none after it
            raise
        appender.append(chunk)
        return True

    def _rows(self, path: str) -> Iterator[Row]:
        """The object's rows as entries: the row as the value, its key field as the key."""
        try:
            with self.fs.open(path, "rb") as handle:
                for number, raw, value in read_records(handle, self.format):
                    try:
                        key = record_key(value, self.key_field)
                        encoded = raw if raw is not None else codec.encode_value(value)
                    except ConfigError as exc:
                        raise RowProblem(number, str(exc)) from None
                    fields = codec.entry_fields(encoded, key)
                    yield Row(number, fields.get(codec.KEY), fields)
        except OSError as exc:
            raise PSPFError(f"source files: cannot read {path!r}: {_one_line(exc)}") from None


class _SourceRecord:
    """A source's own keys: the objects it added whole, the layouts of those it is adding."""

    def __init__(self, broker: Broker, name: str, topic: str) -> None:
        self.conn = broker.conn
        self.done_key = keys.source_done_key(name, topic)
        self.layouts_key = keys.source_layouts_key(name, topic)

    def done(self) -> set[str]:
        with self.conn.translate_errors(self.done_key):
            return {member.decode() for member in self.conn.client.smembers(self.done_key)}

    def layouts(self, relative: str) -> list[TopicCount]:
        """The layouts an unfinished object's rows were sent in, oldest first."""
        with self.conn.translate_errors(self.layouts_key):
            raw = self.conn.client.hget(self.layouts_key, relative)
        found = []
        for item in (raw or b"").decode().split(","):
            if item:
                layout, _, partitions = item.rpartition(":")
                found.append(TopicCount(int(partitions), layout))
        return found

    def remember(self, relative: str, history: list[TopicCount], new: TopicCount) -> None:
        """Record a layout before the object's first row goes out in it."""
        history.append(new)
        text = ",".join(f"{count.layout}:{count.partitions}" for count in history)
        with self.conn.translate_errors(self.layouts_key):
            self.conn.client.hset(self.layouts_key, relative, text)

    def finish(self, relative: str) -> None:
        """Mark the object done and forget its layouts, in one transaction (one hash tag)."""
        with self.conn.translate_errors(self.done_key):
            pipe = self.conn.client.pipeline(transaction=True)
            pipe.sadd(self.done_key, relative)
            pipe.hdel(self.layouts_key, relative)
            pipe.execute()


class _stopped_by_signals:
    """While a followed run lasts in the main thread, SIGTERM and SIGINT set ``stop``."""

    def __init__(self, stop: threading.Event, follow: bool) -> None:
        self.stop = stop
        self.active = follow and threading.current_thread() is threading.main_thread()
        self.before: dict[int, Callable[..., Any] | int | None] = {}

    def __enter__(self) -> None:
        if self.active:
            for number in (signal.SIGTERM, signal.SIGINT):
                self.before[number] = signal.signal(number, lambda _n, _f: self.stop.set())

    def __exit__(self, *_exc: object) -> None:
        for number, handler in self.before.items():
            signal.signal(number, handler)


def default_name(root: str, topic: str) -> str:
    """A source's name from its folder or bucket path and topic (a valid name, at most 200 characters)."""
    slug = "".join(c if (c.isalnum() and c.isascii()) or c in "._-" else "-" for c in root.strip("/"))
    name = f"{topic}-{slug[-60:].strip('-._') or 'root'}"
    if len(name) > 180:
        name = f"{name[:170]}-{zlib.crc32(root.encode()):08x}"
    return name


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
