"""A read of an app's state or of one of its tables, from the partitions' state backups.

``.option("state", app)`` gives one row per key of the app's state (``STATE_SCHEMA``), and
``.option("table", name).option("app", app)`` one row per row of a table (``TABLE_SCHEMA``), each
partition read from its state backup as one consistent snapshot
(``pspf.partition.backup.snapshot``, what ``pspf state export`` reads).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import ConfigError, NotFound, StateValueError
from pspf.ownership.membership import live_members
from pspf.partition.copies import snapshot
from pspf.service.state import shown_state
from pspf.spark.connection import broker_url, connected
from pspf.spark.reading import ARROW_STATE, ARROW_TABLE, PAGE, arrow_batch, read_connection

try:
    import pyarrow as pa
    from pyspark.sql.datasource import DataSourceReader, InputPartition
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the Spark source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'") from exc


# -- state and tables -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateRead:
    """The validated options of a read of an app's state (``table`` None) or of one of its tables."""

    url: str = field(repr=False)  # it may hold a password
    app: str
    table: str | None
    backups: tuple[tuple[int, keys.BackupKeys], ...]


@dataclass(frozen=True)
class BackupPartition(InputPartition):
    """One task: a snapshot of one partition's state backup."""

    partition: int
    backup: keys.BackupKeys


def plan_state_read(options: dict[str, str], what: str) -> StateRead:
    url = broker_url(options)
    table = None
    if what == "state":
        app = keys.check_name("app", options["state"])
    else:
        table = keys.check_name("table", options["table"])
        if not options.get("app"):
            raise ConfigError('a table read needs the app that holds it: .option("app", ...)')
        app = keys.check_name("app", options["app"])
    with connected(url) as broker:
        count = broker.apps.app_partitions(app)  # NotFound for an app that never ran here
        topics = broker.apps.app_topic_list(app)
        if table is not None and table not in topics:
            raise _no_table(broker, app, table, topics)
        found = []
        for partition in range(count if topics else 0):
            backup = keys.backup_keys(topics[0], partition, app)
            if broker.acks.backup_meta(backup.meta).get(keys.BACKUP_IDENTITY):
                found.append((partition, backup))
    missing = sorted(set(range(count if topics else 0)) - {p for p, _ in found})
    if not found or missing:
        which = "" if not found else f" of partitions {missing}"
        raise NotFound(
            f"app {app!r} has no state backup{which} in Redis (is the backup off?): the pspf source reads "
            "the backups; read the stores on the workers' machines with `pspf state export --state-dir`"
        )
    return StateRead(url, app, table, tuple(found))


def _no_table(broker: Broker, app: str, table: str, topics: list[str]) -> Exception:
    """Why ``table`` cannot be read: a global table is in no backup, or the app has no such table."""
    if any(table in member.global_lag for member in live_members(broker.leases, app)):
        return ConfigError(
            f"global table {table!r} of app {app!r} lives only in each worker's local store, not in "
            f'Redis, so the pspf source cannot read it: read its topic with .option("topic", {table!r})'
        )
    return NotFound(f"app {app!r} has no table {table!r}: its topics are {', '.join(topics) or 'none'}")


class StateReader(DataSourceReader):
    """A read of an app's state or table: one task per partition backup, each one snapshot."""

    def __init__(self, read: StateRead) -> None:
        self.read_options = read

    def partitions(self) -> Sequence[InputPartition]:
        return [BackupPartition(p, backup) for p, backup in self.read_options.backups]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BackupPartition)
        read = self.read_options
        what = f"the state of app {read.app!r}" if read.table is None else f"table {read.table!r}"
        with read_connection(read.url, what) as broker:
            copy = snapshot(broker.acks, partition.backup)
        if copy is None:
            raise RuntimeError(
                f"the state backup of app {read.app!r} partition {partition.partition} was removed while "
                "it was read (an app reset or a state import?)"
            )
        values, schema = copy[1], ARROW_STATE if read.table is None else ARROW_TABLE
        if read.table is None:
            found = sorted((key, raw) for (ns, key), raw in values.items() if ns == keys.STATE_NAMESPACE)
            rows = [(key, *_state_text(key, raw)) for key, raw in found]
        else:
            prefix = keys.table_key(read.table, "")
            found = sorted(
                (key[len(prefix) :], raw)
                for (ns, key), raw in values.items()
                if ns == keys.TABLES_NAMESPACE and key.startswith(prefix)
            )
            rows = [(key, *_row_text(read.table, key, raw)) for key, raw in found]
        for at in range(0, len(rows), PAGE):
            keys_, texts, errors = zip(*rows[at : at + PAGE], strict=True)
            yield arrow_batch([keys_, [partition.partition] * len(keys_), texts, errors], schema)


def _state_text(key: str, raw: bytes) -> tuple[str | None, str | None]:
    """A state value as JSON text, as ``pspf state export`` shows it; else (None, why)."""
    try:
        return codec.json_encoder.encode(shown_state(key, raw)).decode(), None
    except StateValueError as exc:
        return None, str(exc)


def _row_text(table: str, key: str, raw: bytes) -> tuple[str | None, str | None]:
    """A table row (msgpack) as JSON text; else (None, why)."""
    try:
        return codec.json_encoder.encode(
            msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True)
        ).decode(), None
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        return None, f"stored row of key {key!r} of table {table!r} is unreadable: {exc}"
