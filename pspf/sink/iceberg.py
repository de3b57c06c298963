"""The Apache Iceberg sink: a topic into an Iceberg table, each entry's row once (pyiceberg).

The transactional tier: a commit is ONE Iceberg snapshot (an append) holding the batch's rows
AND, in its summary, the partition's position (its checkpoints and the processor's bookkeeping,
the blob the idempotent tier keeps: ``Position``) under ``pspf.position/SINK/TOPIC/PARTITION``
(base64 of its msgpack). Iceberg commits a snapshot all or nothing, so the rows and the
checkpoint that covers them land together, as in a PostgreSQL transaction; Flink's Iceberg sink
keeps its checkpoint id the same way. A worker taking a partition over walks the snapshots from
the current one back to the first that carries the partition's keys and goes on after that
position, so a retry after a crash finds its own snapshot and writes nothing twice.

Fencing: each snapshot also carries ``pspf.owner/SINK/TOPIC/PARTITION``, the token of the
worker that wrote it. ``claim`` commits a snapshot without rows carrying its own new token (and
the position it found). Iceberg commits are compare-and-swap on the table's current snapshot:
before each append the partition walks the snapshots committed since it last looked, and a
token other than its own means it was taken over (``SinkUnavailable``, nothing written); an
append whose base moved meanwhile fails (``CommitFailedException``) and is looked at again. So a
worker paused past its lease writes nothing after its successor's claim. pyiceberg's own commit
retries (``commit.retry.num-retries``) would re-apply an append without that look: the sink turns
them off for its own commits (locally: the table's properties are not changed) and retries itself.

Other writers of the table (other partitions, other workers, compaction) make a commit fail
too: the partition refreshes the table and appends again (the keys of other partitions are in
other snapshots, so that is safe). A commit whose outcome is unknown (an unreachable catalog or
warehouse) raises ``SinkUnavailable``; the next commit first looks at the table, and if the
commit had landed, takes its position and writes only the rows after it.

Columns (those of the files sink and PSPF's Spark source): ``topic string, partition int,
id string, key string, value string`` (JSON text), ``encoding string, headers map<string,
string>, timestamp long`` (the id's milliseconds). Namespace and table are created when
missing; a table with other columns is refused. Expiring snapshots drops the positions they
hold: keep each partition's latest (``docs/how-to/iceberg.md``).

The catalog is configured as pyiceberg configures it (``PYICEBERG_CATALOG__NAME__URI``, ...,
or ``.pyiceberg.yaml``), plus ``properties`` given here. Needs the ``iceberg`` extra.
"""

from __future__ import annotations

import base64
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec

from pspf.errors import ConfigError, SinkTargetChanged, SinkUnavailable
from pspf.keys import StreamId, check_name
from pspf.sink.base import SinkPartition, SinkRecord, TransactionalSink, Updates
from pspf.sink.files import record_columns
from pspf.sink.idempotent import Position

if TYPE_CHECKING:
    from pspf.settings import Settings
    from pspf.worker import Worker

log = logging.getLogger("pspf.sink.iceberg")

#: the summary keys of a partition's position and of its owner, before ``/SINK/TOPIC/PARTITION``
POSITION_KEY = "pspf.position"
OWNER_KEY = "pspf.owner"

#: the table's columns: name, Iceberg type, required
COLUMNS: list[tuple[str, str, bool]] = [
    ("topic", "string", True),
    ("partition", "int", True),
    ("id", "string", True),
    ("key", "string", False),
    ("value", "string", False),
    ("encoding", "string", True),
    ("headers", "map<string, string>", False),
    ("timestamp", "long", True),
]

#: commit attempts against other writers before the sink backs off as for an unreachable store
_ATTEMPTS = 30

_NO_RETRIES = "commit.retry.num-retries"


def _pyiceberg() -> Any:
    """The pyiceberg package, or the extra to install."""
    try:
        import pyarrow  # noqa: F401
        import pyiceberg.catalog
        import pyiceberg.exceptions
    except ImportError as exc:
        raise ConfigError(
            f"sink iceberg needs the iceberg extra: pip install 'pspf[iceberg]' ({exc})"
        ) from None
    return pyiceberg


def _unavailable() -> tuple[type[BaseException], ...]:
    """What an unreachable catalog or warehouse raises (the outcome of a commit is then unknown)."""
    from pyiceberg import exceptions as ice

    errors: list[type[BaseException]] = [
        OSError,  # files, S3, HTTP (requests' errors are OSErrors)
        ice.CommitStateUnknownException,
        ice.ServiceUnavailableError,
        ice.ServerError,
        ice.TooManyRequestsError,
    ]
    try:
        from sqlalchemy.exc import OperationalError

        errors.append(OperationalError)
    except ImportError:  # pragma: no cover - no SQL catalog here
        pass
    return tuple(errors)


def table_schema() -> Any:
    """The Iceberg schema of a new table."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import IntegerType, LongType, MapType, NestedField, StringType

    kinds = {"string": StringType(), "int": IntegerType(), "long": LongType()}
    fields = []
    for n, (name, kind, required) in enumerate(COLUMNS, start=1):
        field_type = MapType(100, StringType(), 101, StringType(), False) if "map" in kind else kinds[kind]
        fields.append(NestedField(n, name, field_type, required=required))
    return Schema(*fields)


class IcebergSink(TransactionalSink):
    """Deliver a topic into the Iceberg table ``table`` (``NAMESPACE.TABLE``) of catalog ``catalog``.

    ``properties`` are catalog properties given over pyiceberg's configuration (``uri``,
    ``warehouse``, ``s3.endpoint``, ...). ``name`` is the sink's consumer group (default
    ``sink-iceberg-NAMESPACE.TABLE``). ``batch_size``, when given, replaces the worker's
    (``PSPF_BATCH_SIZE``): the most entries of a partition one snapshot holds, since every
    snapshot costs a data file, a manifest, a manifest list and a metadata file. The table is
    created when missing; one with other columns is refused.
    """

    def __init__(
        self,
        table: str,
        catalog: str = "default",
        name: str | None = None,
        properties: Mapping[str, str] | None = None,
        batch_size: int | None = None,
    ) -> None:
        _pyiceberg()
        if batch_size is not None and not 1 <= batch_size <= 100_000:
            raise ConfigError(f"sink iceberg: batch_size must be 1 to 100000, got {batch_size}")
        self.batch_size = batch_size
        parts = table.split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"sink iceberg: invalid table name {table!r}: NAMESPACE.TABLE")
        self.table_name = table
        self.catalog_name = catalog
        self.properties = {str(k): str(v) for k, v in (properties or {}).items()}
        self.name = check_name("sink", name or f"sink-iceberg-{table}")
        #: the topic delivered (``worker``): part of the summary keys
        self.topic = ""
        #: one table object for the process's partitions, their commits one at a time
        self.lock = threading.RLock()
        self.table: Any = None
        self.uuid: Any = None
        self._catalog: Any = None
        self._arrow: tuple[int, Any] | None = None

    def worker(self, topic: str, settings: Settings) -> Worker:
        self.topic = topic
        if self.batch_size is not None:
            consumer = msgspec.structs.replace(settings.consumer, batch_size=self.batch_size)
            settings = msgspec.structs.replace(settings, consumer=consumer)
        return super().worker(topic, settings)

    def catalog(self) -> Any:
        """The catalog, loaded once (``pyiceberg.catalog.load_catalog``)."""
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            quiet = logging.getLogger("pyiceberg.io")
            if quiet.level == logging.NOTSET:  # "Loaded FileIO" at INFO, once per commit
                quiet.setLevel(logging.WARNING)

            with self.translated():
                try:
                    self._catalog = load_catalog(self.catalog_name, **self.properties)
                except (ValueError, KeyError, NotImplementedError) as exc:
                    raise ConfigError(f"sink iceberg: catalog {self.catalog_name!r}: {_line(exc)}") from None
        return self._catalog

    def prepare(self) -> None:
        """Create the namespace and the table when missing; refuse a table with other columns."""
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, TableAlreadyExistsError

        catalog = self.catalog()
        namespace = self.table_name.rpartition(".")[0]
        with self.lock, self.translated():
            try:
                catalog.create_namespace(namespace)
            except NamespaceAlreadyExistsError:
                pass
            except Exception:  # another sink creating it at once: a SQL catalog's insert fails instead
                if not _namespace_exists(catalog, namespace):
                    raise
            try:
                table = catalog.create_table(self.table_name, schema=table_schema())
                log.info("created Iceberg table %s for sink %s", self.table_name, self.name)
            except TableAlreadyExistsError:
                table = catalog.load_table(self.table_name)
            except Exception:  # the same race for the table
                if not catalog.table_exists(self.table_name):
                    raise
                table = catalog.load_table(self.table_name)
            self._check_columns(table)
            if self.uuid is not None and table.metadata.table_uuid != self.uuid:
                raise self.changed("it was dropped and created again")
            self.table, self.uuid = table, table.metadata.table_uuid

    def _check_columns(self, table: Any) -> None:
        found = [(f.name, str(f.field_type), f.required) for f in table.schema().fields]
        same = len(found) == len(COLUMNS) and all(
            (n, k) == (wanted[0], wanted[1]) and not (required and not wanted[2])
            for (n, k, required), wanted in zip(found, COLUMNS, strict=True)
        )
        if not same:
            wanted = ", ".join(f"{n} {k}" + (" not null" if r else "") for n, k, r in COLUMNS)
            has = ", ".join(f"{n} {k}" + (" not null" if r else "") for n, k, r in found)
            raise ConfigError(
                f"Iceberg table {self.table_name} exists with other columns: the sink needs ({wanted}), "
                f"it has ({has})"
            )

    def refresh(self) -> Any:
        """The table as the catalog has it now (a dropped or replaced one refused)."""
        with self.translated():
            self.table = self.table.refresh()
        if self.table.metadata.table_uuid != self.uuid:
            raise self.changed("it was dropped and created again")
        return self.table

    def append(self, rows: Sequence[SinkRecord], summary: dict[str, str]) -> Any:
        """Append ``rows`` as ONE snapshot with ``summary``; pyiceberg's own retries off.

        pyiceberg builds the append from a local copy of the table's metadata and sends the
        catalog the new snapshot alone (the catalog applies it to the metadata it has, under
        its compare-and-swap). That copy differs in what the append does not read: its retry
        count is 0, and it holds the current snapshot only (the parent of the new one) and no
        logs, since pyiceberg copies the whole metadata many times per append, a cost that grows
        with every snapshot the table keeps.
        """
        import pyarrow as pa

        schema = self._arrow_schema(self.table)
        self.table = append_trimmed(self.table, pa.table(record_columns(rows), schema=schema), summary)
        return self.table

    def _arrow_schema(self, table: Any) -> Any:
        schema_id = table.metadata.current_schema_id
        if self._arrow is None or self._arrow[0] != schema_id:
            from pyiceberg.io.pyarrow import schema_to_pyarrow

            self._arrow = (schema_id, schema_to_pyarrow(table.schema()))
        return self._arrow[1]

    @contextmanager
    def translated(self) -> Iterator[None]:
        """The errors of pyiceberg as the sink's: an unreachable store, a table gone."""
        from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

        try:
            yield
        except (NoSuchTableError, NoSuchNamespaceError):
            raise self.changed("it was dropped") from None
        except _unavailable() as exc:
            raise SinkUnavailable(f"Iceberg catalog {self.catalog_name}: {_line(exc)}") from None

    def changed(self, what: str) -> SinkTargetChanged:
        """The refusal of a table the positions no longer describe."""
        return SinkTargetChanged(
            f"Iceberg table {self.table_name} is not the one sink {self.name} delivered into ({what}): "
            "the positions it kept are gone. Deliver the topic into it under a new --name"
        )

    def key(self, kind: str, partition: int) -> str:
        """A summary key of one partition: ``pspf.position/SINK/TOPIC/PARTITION`` or ``pspf.owner/...``."""
        return f"{kind}/{self.name}/{self.topic}/{partition}"

    def partition(self, partition: int) -> SinkPartition:
        assert self.topic, "an Iceberg sink's partitions are opened by its worker"
        return IcebergPartition(self, partition)

    def describe(self) -> str:
        return f"Iceberg table {self.table_name} (catalog {self.catalog_name})"


class IcebergPartition(SinkPartition):
    """One partition's snapshots: claims the partition, then appends its batches under its token."""

    def __init__(self, sink: IcebergSink, partition: int) -> None:
        self.sink = sink
        self.partition = partition
        self.position_key = sink.key(POSITION_KEY, partition)
        self.owner_key = sink.key(OWNER_KEY, partition)
        self.token = uuid.uuid4().hex
        self.values: dict[tuple[str, str], bytes] = {}
        self.checkpoints: dict[str, StreamId] = {}
        #: the current snapshot when the partition last looked at the table
        self.seen: int | None = None
        #: the last commit's outcome is unknown: look at the table before the next
        self.doubt = False
        #: checkpoints of a commit found landed after its outcome was unknown: rows at or below skipped
        self.floor: dict[str, StreamId] = {}

    def claim(self) -> tuple[dict[tuple[str, str], bytes], dict[str, StreamId]]:
        """Find the partition's latest position, then commit a snapshot carrying a new token."""
        from pyiceberg.exceptions import CommitFailedException

        with self.sink.lock:
            if self.sink.table is None:
                self.sink.prepare()
            table = self.sink.refresh()
            for attempt in range(_ATTEMPTS):
                latest = _walk(table.metadata, self.owner_key, None)
                raw = None if latest is None else latest.get(self.position_key)
                self._adopt(raw)
                summary = {self.owner_key: self.token}
                if raw is not None:
                    summary[self.position_key] = raw
                try:
                    with self.sink.translated():
                        table = self.sink.append([], summary)
                except CommitFailedException:
                    table = self._conflict(attempt)
                    continue
                self.seen = table.metadata.current_snapshot_id
                return dict(self.values), dict(self.checkpoints)
        raise self._busy()

    def commit(
        self, records: Sequence[SinkRecord], updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> None:
        from pyiceberg.exceptions import CommitFailedException

        with self.sink.lock:
            if self.doubt:
                self.sink.refresh()
                self.doubt = False
            for attempt in range(_ATTEMPTS):
                self._follow()
                values, merged = self._merged(updates, checkpoints)
                rows = self._new(records)
                if not rows and not updates and merged == self.checkpoints:
                    return
                summary = {self.owner_key: self.token, self.position_key: _encode(values, merged)}
                try:
                    with self.sink.translated():
                        table = self.sink.append(rows, summary)
                except CommitFailedException:
                    self._conflict(attempt)
                    continue
                except SinkUnavailable:
                    self.doubt = True
                    raise
                self.seen = table.metadata.current_snapshot_id
                self.values, self.checkpoints = values, merged
                return
        raise self._busy()

    def _follow(self) -> None:
        """Look at the snapshots committed since the partition last did: taken over, or landed."""
        metadata = self.sink.table.metadata
        found = _walk(metadata, self.owner_key, self.seen)
        if found is not None:
            if found.get(self.owner_key) != self.token:
                raise SinkUnavailable(
                    f"partition {self.partition} of sink {self.sink.name} was taken over by another "
                    "worker: this one writes nothing more"
                )
            self._adopt(found.get(self.position_key))  # a commit reported failed had landed
            self.floor = dict(self.checkpoints)
        self.seen = metadata.current_snapshot_id

    def _conflict(self, attempt: int) -> Any:
        """Another writer committed first: wait a little, then the table as it is now."""
        time.sleep(min(0.5, 0.005 * 2**attempt) * random.uniform(0.5, 1.0))
        return self.sink.refresh()

    def _adopt(self, raw: str | None) -> None:
        """Take the position of a snapshot (none: the partition's start)."""
        self.values, self.checkpoints = {}, {}
        if raw is not None:
            position = msgspec.msgpack.decode(base64.b64decode(raw), type=Position)
            self.values = {(ns, key): value for ns, key, value in position.values}
            self.checkpoints = {t: StreamId(*c) for t, c in position.checkpoints.items()}

    def _merged(
        self, updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> tuple[dict[tuple[str, str], bytes], dict[str, StreamId]]:
        """The position after this commit; a checkpoint never goes back (a landed commit kept)."""
        values = dict(self.values)
        for name, value in updates.items():
            if value is None:
                values.pop(name, None)
            else:
                values[name] = value
        merged = dict(self.checkpoints)
        for topic, checkpoint in checkpoints.items():
            merged[topic] = max(checkpoint, merged.get(topic, checkpoint))
        return values, merged

    def _new(self, records: Sequence[SinkRecord]) -> Sequence[SinkRecord]:
        """The records not in the table yet: all, unless a commit was found landed after a doubt."""
        if not self.floor:
            return records
        start = StreamId(0, 0)
        return [r for r in records if StreamId.parse(r.entry_id) > self.floor.get(r.topic, start)]

    def _busy(self) -> SinkUnavailable:
        return SinkUnavailable(
            f"Iceberg table {self.sink.table_name}: {_ATTEMPTS} commits of partition {self.partition} "
            "met other writers' commits; backing off"
        )

    def close(self) -> None:
        """Nothing to release: the table object is the sink's."""


def append_trimmed(table: Any, rows: Any, summary: dict[str, str]) -> Any:
    """``table.append(rows)`` as ONE snapshot with ``summary``, from a trimmed copy of the metadata.

    The copy holds the current snapshot only and no logs (pyiceberg copies the whole metadata many
    times per append, a cost that grows with every snapshot kept; the catalog applies the new
    snapshot to the metadata it has), and its commit retries are off. Returns the table after.
    """
    from pyiceberg.table import Table

    current = table.current_snapshot()
    metadata = table.metadata.model_copy(
        update={
            "properties": {**table.metadata.properties, _NO_RETRIES: "0"},
            "snapshots": [] if current is None else [current],
            "snapshot_log": [],
            "metadata_log": [],
        }
    )
    local = Table(table.name(), metadata, table.metadata_location, table.io, table.catalog)
    local.append(rows, snapshot_properties=summary)
    return local


def _namespace_exists(catalog: Any, namespace: str) -> bool:
    from pyiceberg.exceptions import NoSuchNamespaceError

    try:
        catalog.load_namespace_properties(namespace)
    except NoSuchNamespaceError:
        return False
    return True


def _walk(metadata: Any, key: str, until: int | None) -> Mapping[str, str] | None:
    """The summary of the newest snapshot carrying ``key``, from the current one back to ``until``."""
    snapshots = {s.snapshot_id: s for s in metadata.snapshots}
    current = metadata.current_snapshot_id
    while current is not None and current != until:
        snapshot = snapshots.get(current)
        if snapshot is None:  # expired: nothing older is known
            return None
        summary = snapshot.summary.additional_properties if snapshot.summary is not None else {}
        if key in summary:
            return dict(summary)
        current = snapshot.parent_snapshot_id
    return None


def _encode(values: Mapping[tuple[str, str], bytes], checkpoints: Mapping[str, StreamId]) -> str:
    position = Position(
        [(ns, key, value) for (ns, key), value in sorted(values.items())],
        {topic: (c.ms, c.seq) for topic, c in checkpoints.items()},
    )
    return base64.b64encode(msgspec.msgpack.encode(position)).decode()


def _line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
