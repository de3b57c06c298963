"""Every persisted name: Redis keys, store namespaces and headers; the partition function; ids.

This is the only module that formats Redis key names. Every key that belongs to one topic
partition carries the hash tag ``{topic:partition}``, so one Lua call or MULTI can touch the
stream, its lease and its DLQ together, also on Redis Cluster. The names a partition's store
holds are here too, so that readers (the service, tests) need not import the processor.
"""

from __future__ import annotations

import re
import zlib
from typing import NamedTuple

from pspf.errors import ConfigError

PREFIX = "pspf"
TOPICS_KEY = f"{PREFIX}:topics"
APPS_KEY = f"{PREFIX}:apps"
MAX_PARTITIONS = 1024

#: The store namespace that holds ``ctx.state``.
STATE_NAMESPACE = "state"
#: Retry bookkeeping by "topic/id" (``entry_name``): attempts so far, due time of parked entries.
FAILURES_NAMESPACE = "__failures"
#: Entries judged dead whose move to the DLQ is not confirmed yet, by "topic/id".
DEAD_NAMESPACE = "__dead"
#: The consumers whose reads this store's checkpoints account for: an entry pending at one of
#: them, at or below a checkpoint, was applied. Others (a foreign consumer of the group) never
#: applied anything here.
CONSUMERS_NAMESPACE = "__consumers"
#: Entries taken over from consumers outside that history at or below the checkpoint, by
#: "topic/id": run although the checkpoint passed them, then forgotten in the same commit.
FOREIGN_NAMESPACE = "__foreign"
#: The identity of the last batch committed (``BACKUP_IDENTITY``): what the state backup is
#: compared with at takeover.
BACKUP_NAMESPACE = "__backup"
BACKUP_IDENTITY = "identity"
#: The backup's values hash holds its identity too, under this field, set in the same call as its
#: meta's: a values hash deleted or evicted on its own is noticed before anything is written to
#: it. Readers of the values skip it (``Acknowledging.backup_values``).
BACKUP_MARK = f"{BACKUP_NAMESPACE}\x00{BACKUP_IDENTITY}".encode()
#: Meta field: the values hash carries ``BACKUP_MARK`` (a backup from before it does not).
BACKUP_MARKED = "marked"
#: Meta field: how many hashes a backup's values are spread over (``state.backup_buckets``; absent:
#: one). Written in the same call as an upload's first values, with ``BACKUP_LAYOUT``.
BACKUP_BUCKETS = "buckets"
#: Meta field: the identity of the upload that laid the buckets out. Every bucket but the first
#: holds it under ``BACKUP_LAYOUT_MARK`` from that upload on, so one deleted or evicted alone (or
#: made anew by a later write) is told from one that is merely empty.
BACKUP_LAYOUT = "layout"
BACKUP_LAYOUT_MARK = f"{BACKUP_NAMESPACE}\x00{BACKUP_LAYOUT}".encode()
#: Meta field, and store key under ``BACKUP_NAMESPACE``: the partition count the state was built
#: for (a key's partition depends on it).
BACKUP_PARTITIONS = "partitions"
#: Meta field: the adoption record (``pspf.partition.adoption``) of a backup that `pspf state adopt`
#: uploaded; store key under ``BACKUP_NAMESPACE``: the adoption a store follows.
BACKUP_ADOPTED = "adopted"
#: Entries a redrive for the app replaced with a copy later in the stream, by "topic/id" (value:
#: the copy's id). A replay that delivers both marks them: they are done without a handler, so
#: each is applied once, through its last copy, as in the first run. Forgotten in the commit that
#: moves the checkpoint to or past them.
SUPERSEDED_NAMESPACE = "__superseded"
#: Outbox rows (``ctx.emit``): a batch's rows as one page under its first row's zero-padded id
#: (``outbox.row_key``), written once; the status records of rows off the common path, by row id;
#: the counters ("next"), a watermark per target partition and a done mark per page published
#: whole (see ``pspf.outbox.rows``).
OUTBOX_NAMESPACE = "__outbox"
OUTBOX_STATE_NAMESPACE = "__outbox_state"
OUTBOX_META_NAMESPACE = "__outbox_meta"
#: Namespaces whose values are large (a batch's emitted rows in one value): a store may keep them
#: apart from the many small ones (SQLite does: see ``state_stores.sqlite``).
LARGE_VALUE_NAMESPACES = frozenset({OUTBOX_NAMESPACE})
#: Open windows of ``@app.window`` aggregations (``window_key``; see ``pspf.windows``) and the
#: partition's stream time (key ``STREAM_TIME``: the largest event time applied, and its entry).
WINDOWS_NAMESPACE = "__windows"
TIME_NAMESPACE = "__time"
STREAM_TIME = "stream"
#: In ``TIME_NAMESPACE``: "stream/NAME", the stream time of a window that keeps its own (a dataflow's).
WINDOW_TIME_PREFIX = "stream/"
#: In ``TIME_NAMESPACE``: "timer/NAME", the start of the last period an ``@app.timer`` ran in.
TIMER_PREFIX = "timer/"
#: Callbacks handlers scheduled (``ctx.schedule``), by "name/key"; when each key's state expires
#: (``state_ttl``), by key (see ``pspf.windows.timers``).
SCHEDULES_NAMESPACE = "__schedules"
EXPIRY_NAMESPACE = "__expiry"
#: After a repartition, until the app passes the moved entries: the old partitions' checkpoints,
#: by "topic/old partition", and the last moved entry, by "topic/until" (see ``pspf.repartition.run``).
MOVED_NAMESPACE = "__moved"
#: Rows of the app's co-partitioned tables (``App.table``), by "table/key" (``table_key``).
TABLES_NAMESPACE = "__tables"
#: Rows of the app's tables that updates replaced after an entry that waits parked, by
#: "table/key": what that entry's lookup sees when it is tried again (``pspf.tables.table``).
TABLE_HISTORY_NAMESPACE = "__table_history"
#: Each key's rows of the app's versioned tables by event time, by "table/key"
#: (``pspf.tables.versions``).
TABLE_VERSIONS_NAMESPACE = "__table_versions"
#: A partition's view writes committed and maybe not yet in Redis (``pspf.outbox.views``).
VIEWS_NAMESPACE = "__views"
#: Rows of the app's global tables in a worker's own store (``pspf.tables.table.GlobalTables``).
GLOBAL_TABLES_NAMESPACE = "__global"
#: Every namespace a partition's store holds (a restore from the backup clears them all).
STORE_NAMESPACES = (
    STATE_NAMESPACE,
    FAILURES_NAMESPACE,
    DEAD_NAMESPACE,
    CONSUMERS_NAMESPACE,
    FOREIGN_NAMESPACE,
    SUPERSEDED_NAMESPACE,
    BACKUP_NAMESPACE,
    OUTBOX_NAMESPACE,
    OUTBOX_STATE_NAMESPACE,
    OUTBOX_META_NAMESPACE,
    WINDOWS_NAMESPACE,
    TIME_NAMESPACE,
    SCHEDULES_NAMESPACE,
    EXPIRY_NAMESPACE,
    TABLES_NAMESPACE,
    TABLE_HISTORY_NAMESPACE,
    TABLE_VERSIONS_NAMESPACE,
    MOVED_NAMESPACE,
    VIEWS_NAMESPACE,
)

#: Headers a repartition adds to the entries it moves: the partition each had before, and its id
#: then when it had to change (another old partition had the same id).
MOVED_FROM_HEADER = "pspf-moved-from"
MOVED_ID_HEADER = "pspf-moved-id"
#: Header a redrive adds so that only the app that dead-lettered an entry runs it again.
REDRIVE_APP_HEADER = "pspf-redrive-app"
#: Header a redrive adds: how often the entry was redriven.
REDRIVE_COUNT_HEADER = "pspf-redrive-count"
#: Header a redrive adds: the id of the entry it was redriven from (the previous link of a chain).
ORIGINAL_ID_HEADER = "pspf-original-id"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if it is a valid topic or app name, else raise ConfigError.

    Names are limited to letters, digits, ``.``, ``_`` and ``-`` so they can never break a key's
    hash tag or a file name under the state directory.
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid {kind} name {name!r}: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def table_key(table: str, key: str) -> str:
    """The store key of a table's row: the table's name (a topic name: no "/"), then the key."""
    return f"{table}/{key}"


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of a key: CRC32 of its UTF-8 bytes modulo the partition count."""
    return zlib.crc32(key) % partitions


def topic_key(topic: str) -> str:
    """Hash holding a topic's metadata (its partition count)."""
    return f"{PREFIX}:topic:{{{topic}}}"


def app_key(app: str) -> str:
    """Hash holding what a running app reads (its topics and partition count)."""
    return f"{PREFIX}:app:{{{app}}}"


def savepoints_key(app: str) -> str:
    """Hash of an app's savepoints: name -> where it was written and its state (``pspf.savepoint``)."""
    return f"{PREFIX}:savepoints:{{{app}}}"


def members_key(app: str) -> str:
    """Sorted set of an app's live workers (member id -> expiry, server ms): who shares its work."""
    return f"{PREFIX}:app:{{{app}}}:members"


def joined_key(app: str) -> str:
    """Sorted set of when each live worker of an app joined (member id -> server ms)."""
    return f"{PREFIX}:app:{{{app}}}:joined"


def member_info_key(app: str) -> str:
    """Hash of each live worker's host, pid and consumer name (member id -> JSON)."""
    return f"{PREFIX}:app:{{{app}}}:member-info"


def outbox_replay_key(app: str) -> str:
    """Hash of operators' outbox replay requests (partition -> JSON row ids); the owner applies them."""
    return f"{PREFIX}:app:{{{app}}}:outbox-replay"


def outbox_replayed_key(app: str) -> str:
    """Hash of what the owners did with the last replay request per partition (JSON)."""
    return f"{PREFIX}:app:{{{app}}}:outbox-replayed"


def stream_key(topic: str, partition: int) -> str:
    """The stream of one topic partition, e.g. ``pspf:{orders:0}``."""
    return f"{PREFIX}:{{{topic}:{partition}}}"


def layout_key(topic: str, partition: int) -> str:
    """The layout generation a partition's stream belongs to (absent: "0"); see ``lua/add.lua``."""
    return f"{PREFIX}:{{{topic}:{partition}}}:layout"


def dlq_key(topic: str, partition: int) -> str:
    """The dead-letter stream of one topic partition (shared by the apps reading the topic)."""
    return f"{PREFIX}:{{{topic}:{partition}}}:dlq"


def sink_marker_key(topic: str, partition: int, chunk: str) -> str:
    """Marks one chunk of a Spark write as added to a partition (so a replay skips it)."""
    return f"{PREFIX}:{{{topic}:{partition}}}:sink:{chunk}"


def lease_key(topic: str, partition: int, group: str) -> str:
    """The lease a worker of ``group`` holds on a topic partition (value: owner and token)."""
    return f"{PREFIX}:{{{topic}:{partition}}}:lease:{group}"


def fence_key(topic: str, partition: int, group: str) -> str:
    """Counter that hands out increasing fencing tokens for a lease."""
    return f"{PREFIX}:{{{topic}:{partition}}}:fence:{group}"


def entry_name(topic: str, entry_id: bytes) -> str:
    """The store key of one entry's bookkeeping (failures, dead, foreign): ``topic/id``."""
    return f"{topic}/{entry_id.decode()}"


class WindowKey(NamedTuple):
    """The parts of a ``window_key``."""

    topic: str
    #: the window's name; "" in the layout of stores written before windows had names, which
    #: keyed a topic's one window by the topic alone
    name: str
    kind: str
    key: str
    a: int
    b: str


def window_key(topic: str, name: str, kind: str, key: str, a: int, b: int | str) -> str:
    """The store key of a window's state, the entry key last (it may hold any character).

    A window is known by its name and its topic (``topic:name``; names cannot hold ``:``). Kinds:
    a window's accumulator ("w": start, end), a closed session's marker ("c": start, end), a
    sliding window's kept entry ("e": event time, entry id).
    """
    return f"{window_prefix(topic, name, kind)}{a}/{b}/{key}"


def window_prefix(topic: str, name: str, kind: str) -> str:
    """What every ``window_key`` of one window and kind starts with."""
    return f"{topic}:{name}/{kind}/"


def window_time_key(name: str) -> str:
    """The ``TIME_NAMESPACE`` key of the stream time a window keeps of its own."""
    return f"{WINDOW_TIME_PREFIX}{name}"


def split_window_key(stored: str) -> WindowKey:
    """The parts of a ``window_key``, or of a key that names a topic alone (``name`` "")."""
    window, kind, a, b, key = stored.split("/", 4)
    topic, _, name = window.partition(":")
    return WindowKey(topic, name, kind, key, int(a), b)


def backup_key(topic: str, partition: int, group: str) -> str:
    """Hash of every value a partition's store holds (field ``namespace NUL key``): its backup.

    It lives on the hash tag of the app's first topic, beside that stream and lease.
    """
    return f"{PREFIX}:{{{topic}:{partition}}}:backup:{group}"


#: The backup fields ``bucket_of`` spreads over the buckets: values per key (state, windows,
#: timers, tables).
SPREAD_FIELDS = tuple(
    f"{namespace}\x00".encode()
    for namespace in (
        STATE_NAMESPACE,
        WINDOWS_NAMESPACE,
        EXPIRY_NAMESPACE,
        SCHEDULES_NAMESPACE,
        TABLES_NAMESPACE,
        TABLE_HISTORY_NAMESPACE,
        TABLE_VERSIONS_NAMESPACE,
        GLOBAL_TABLES_NAMESPACE,
    )
)


def bucket_keys(values: str, buckets: int) -> list[str]:
    """The hashes a backup's values are spread over: the values key, then ``values:1`` ...

    App names hold no ":", so none of them is another app's key.
    """
    return [values, *(f"{values}:{i}" for i in range(1, buckets))]


def bucket_of(name: bytes, buckets: int) -> int:
    """The bucket of a backup field (CRC-32: the same on every machine and version).

    Only the namespaces that grow with the keys are spread (``SPREAD_FIELDS``); the bookkeeping
    stays in the first bucket: its values (a failure's record, an outbox page) are often larger
    than Redis keeps in a compact hash, and one such value, even deleted, leaves its hash large.
    """
    return zlib.crc32(name) % buckets if buckets > 1 and name.startswith(SPREAD_FIELDS) else 0


def backup_meta_key(topic: str, partition: int, group: str) -> str:
    """Hash of the backup's batch identity and its checkpoint per topic (``cp:TOPIC``)."""
    return f"{PREFIX}:{{{topic}:{partition}}}:backup-meta:{group}"


def backup_log_key(topic: str, partition: int, group: str) -> str:
    """Stream of the backup's recent updates, one entry per update (capped, ``acking.log_length``).

    A standby follows it; a store a few batches behind catches up from it.
    """
    return f"{PREFIX}:{{{topic}:{partition}}}:backup-log:{group}"


def schemas_key(topic: str) -> str:
    """Hash of a topic's schema versions: ``v1``, ``v2``, ... each the JSON of one and how it was set."""
    return f"{PREFIX}:topic:{{{topic}}}:schemas"


def producers_key(topic: str, partition: int) -> str:
    """Hash of the last sequence number published to a topic partition per producer (app/partition).

    The outbox's publishing call checks and records it, so a repeated publish adds nothing.
    """
    return f"{PREFIX}:{{{topic}:{partition}}}:producers"


class BackupKeys(NamedTuple):
    """The keys of one partition's state backup (one hash tag: one Lua call updates them all)."""

    values: str
    meta: str
    log: str


def backup_keys(topic: str, partition: int, group: str) -> BackupKeys:
    """The backup keys of (group, partition); ``topic`` is the app's first topic."""
    return BackupKeys(
        backup_key(topic, partition, group),
        backup_meta_key(topic, partition, group),
        backup_log_key(topic, partition, group),
    )


class StreamId(NamedTuple):
    """A stream entry id; compares as the integer pair ``(ms, seq)``, never as a string."""

    ms: int
    seq: int

    @classmethod
    def parse(cls, raw: bytes | str) -> StreamId:
        """Parse ``b"1700000000000-3"``; raise ConfigError when it is not a stream id."""
        text = raw.decode() if isinstance(raw, bytes) else raw
        ms, sep, seq = text.partition("-")
        # int() alone would take "1_0", " 1" or other scripts' digits, which Redis refuses.
        if ms.isdigit() and (seq.isdigit() or not sep) and text.isascii():
            parsed = cls(int(ms), int(seq) if sep else 0)
            if parsed.ms <= MAX_SEQ and parsed.seq <= MAX_SEQ:
                return parsed
        raise ConfigError(f"invalid stream id {text!r}: expected MS-SEQ")

    def __str__(self) -> str:
        return f"{self.ms}-{self.seq}"

    def __repr__(self) -> str:
        """As Redis writes it, also inside a dict or a list in a log line or a message."""
        return f"{self.ms}-{self.seq}"

    def previous(self) -> StreamId:
        """The largest id before this one (an inclusive range end just below it)."""
        if self.seq == 0:
            return StreamId(self.ms - 1, MAX_SEQ)
        return StreamId(self.ms, self.seq - 1)

    def next(self) -> StreamId:
        """The smallest id after this one (for exclusive range starts that Redis 6.2 lacks)."""
        if self.seq == MAX_SEQ:
            return StreamId(self.ms + 1, 0)
        return StreamId(self.ms, self.seq + 1)


ZERO_ID = StreamId(0, 0)
#: The largest sequence number of a stream id (an unsigned 64-bit integer).
MAX_SEQ = 2**64 - 1


def source_done_key(source: str, topic: str) -> str:
    """Set of the objects (paths under its URL) a source added to ``topic`` whole: a restart skips them."""
    return f"{PREFIX}:source:{{{source}}}:{topic}:done"


def source_layouts_key(source: str, topic: str) -> str:
    """Hash of the layouts each object in progress was added in (path -> "layout:partitions,...").

    Written before the first row of an object goes out in a layout, so a restart knows every
    producer record (``producers_key``) that may hold the object's rows; removed when it is done.
    """
    return f"{PREFIX}:source:{{{source}}}:{topic}:layouts"
