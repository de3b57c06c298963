"""Global tables: every worker holds all of each, in a store of its own, and follows their streams.

A global table (``App.global_table``) has any partition count. ``GlobalTables`` reads every
global table to the end of its streams before the worker handles an entry, then follows them
between batches; a lookup sees the row as of the worker's position. What a table is, its rows and
its lookups are in ``pspf.tables.table``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pspf import codec, keys
from pspf.errors import DecodeError
from pspf.keys import StreamId

if TYPE_CHECKING:
    from pspf.broker import Broker, RawEntry, ReadSent
    from pspf.state_stores import StateStore

from pspf.tables.table import GLOBAL_CACHE_LIMIT, GLOBAL_READ_COUNT, MISSING, RowCache, Table, _encode_row

log = logging.getLogger("pspf.tables")

#: After a look found nothing new, the next waits this long: a look is a round trip, which each
#: cycle (hundreds a second) would pay for a table that rarely changes. While updates come, every
#: cycle looks.
QUIET_LOOK_S = 0.05


class GlobalTables:
    """The app's global tables, whole, in this worker's own store, and its position in each stream.

    ``bootstrap`` reads every stream to the end it had when called; ``follow`` reads what came
    since, between batches. Each read is applied in ONE store transaction with the new positions.
    """

    def __init__(
        self, tables: Iterable[Table], store: StateStore, broker: Broker | None, counts: dict[str, int]
    ) -> None:
        """Tables with their partition counts; ``broker`` reads their streams.

        Without a broker, entries come through ``apply`` only (``TestApp``).
        """
        self.tables = {t.name: t for t in tables}
        self.store = store
        self.broker = broker
        #: stream -> (table, checkpoint name in the store)
        self.streams: dict[str, tuple[Table, str]] = {}
        for table in self.tables.values():
            for partition in range(counts[table.name]):
                stream = keys.stream_key(table.name, partition)
                self.streams[stream] = (table, f"{table.name}/{partition}")
        saved = store.checkpoints()
        self.positions: dict[str, StreamId | None] = {
            stream: saved.get(name) for stream, (_, name) in self.streams.items()
        }
        self.cache = RowCache()
        #: when (monotonic) ``follow_between`` looks next
        self._look_at = 0.0
        #: the look sent by the last ``follow_between``, its replies not read yet
        self._look: ReadSent | None = None

    def row(self, name: str, key: str) -> bytes | None:
        """A row as stored (None: no row)."""
        stored = keys.table_key(name, key)
        raw = self.cache.get(stored)
        return self.load(stored) if raw is MISSING else raw

    def load(self, stored: str) -> bytes | None:
        """A row from the store, remembered."""
        raw = self.store.get(keys.GLOBAL_TABLES_NAMESPACE, stored)
        self.cache.put({stored: raw}, GLOBAL_CACHE_LIMIT)
        return raw

    def bootstrap(self) -> int:
        """Read every stream up to its end as of now; the entries applied."""
        assert self.broker is not None
        ends = {stream: self.broker.topics.last_id(stream) for stream in self.streams}
        targets = {s: StreamId.parse(end) for s, end in ends.items() if end is not None}
        started = last_log = time.monotonic()
        applied = 0
        while True:
            behind = [s for s, end in targets.items() if (self.positions[s] or keys.ZERO_ID) < end]
            if not behind:
                break
            got = self.follow(behind)
            applied += got
            if got == 0:  # entries up to the end were deleted (trimmed): nothing more to read
                break
            if time.monotonic() - last_log >= 5:
                last_log = time.monotonic()
                log.info("global tables: %s entries read, %s streams behind", applied, len(behind))
        if self.streams:
            log.info(
                "global tables %s loaded: %s entries in %.1f s",
                sorted(self.tables),
                applied,
                time.monotonic() - started,
            )
        return applied

    def follow(self, streams: Iterable[str] | None = None) -> int:
        """Apply what the streams (all by default) have past their positions; the entries read."""
        after = {s: self.positions[s] for s in (self.streams if streams is None else streams)}
        if not after or self.broker is None:
            return 0
        return self.apply(self.broker.reading.read_after(after, GLOBAL_READ_COUNT))

    def follow_between(self) -> int:
        """``follow`` between batches: each cycle while updates come, else every QUIET_LOOK_S.

        A look's round trip is overlapped with the batch: it is sent in one cycle and what it
        found applied in the next (on a cluster it is read at once). Returns the entries applied.
        """
        now = time.monotonic()
        look, self._look = self._look, None
        got = 0
        if look is not None:
            got = self.apply(look.take())
            self._look_at = now if got else now + QUIET_LOOK_S
        if now < self._look_at or not self.streams or self.broker is None:
            return got
        self._look = self.broker.reading.send_read_after(self.positions, GLOBAL_READ_COUNT)
        if self._look is None:  # a cluster: the look is read now
            found = self.follow()
            self._look_at = now if found else now + QUIET_LOOK_S
            got += found
        return got

    def apply(self, read: list[tuple[str, list[RawEntry]]]) -> int:
        """Apply entries of the tables' streams with the new positions in ONE store transaction.

        ``read``: per stream, entries in id order. Returns how many were applied.
        """
        if not read:
            return 0
        rows: dict[str, bytes | None] = {}
        count = 0
        with self.store.transaction() as tx:
            for stream, entries in read:
                table, name = self.streams[stream]
                for entry_id, fields in entries:
                    self._apply(table, entry_id, fields, rows)
                count += len(entries)
                tx.set_checkpoint(name, StreamId.parse(entries[-1][0]))
            tx.put(keys.GLOBAL_TABLES_NAMESPACE, rows)
        for stream, entries in read:
            self.positions[stream] = StreamId.parse(entries[-1][0])
        self.cache.refresh(rows)  # rows looked up before; others are read when looked up
        return count

    def _apply(self, table: Table, entry_id: bytes, fields: Any, rows: dict[str, bytes | None]) -> None:
        raw_key = None if fields is None else fields.get(codec.KEY)
        try:
            if raw_key is None:
                raise DecodeError("the entry has no key")
            value = table.value_decoder.decode(fields)
            key = raw_key.decode()
        except (DecodeError, UnicodeDecodeError) as exc:
            log.warning("global table %s: entry %s skipped: %s", table.name, entry_id.decode(), exc)
            return
        rows[keys.table_key(table.name, key)] = None if value is None else _encode_row(value)

    def lag(self) -> dict[str, int]:
        """Entries each table's streams hold past this worker's positions (up to a limit per stream)."""
        behind: dict[str, int] = {}
        assert self.broker is not None
        for stream, (table, _) in self.streams.items():
            position = self.positions[stream]
            count = self.broker.topics.count_after(stream, str(position or keys.ZERO_ID))
            behind[table.name] = behind.get(table.name, 0) + count
        return behind

    def close(self) -> None:
        look, self._look = self._look, None
        if look is not None:
            look.abandon()
        self.store.close()
