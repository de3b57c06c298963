"""An app's state: read a key or its windows, list keys, export, import and adopt stores.

Reads come from the partitions' state backups in Redis (any machine), unless the service reads
local state or a partition has no backup (it is off): then from its store here, read without
locking it. Export lines are NDJSON (``ExportCheckpoints`` then ``ExportValue`` per partition;
which values: ``pspf.service.exporting``); import loads them into empty stores and drops the
backups; adopt takes the stores here as the state on a server that lost its groups and backups.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

import msgspec

from pspf import codec, keys
from pspf.errors import ConfigError, NotFound, ParameterError
from pspf.keys import STATE_NAMESPACE, StreamId
from pspf.ownership.owning import check_partition_count
from pspf.partition.backup import field, split_field
from pspf.partition.copies import snapshot
from pspf.service.adopting import Adopter
from pspf.service.base import Family
from pspf.service.exporting import export_lines, kept_bookkeeping, parse_export_line
from pspf.service.exporting import shown_state as shown_state  # pspf.spark reads it here
from pspf.service.records import AdoptResult, ExportCheckpoints, ImportResult, OpenWindow
from pspf.state_stores import StateStore, StoreTransaction, missing_state, open_store, stored_partitions


class State(Family):
    """State operations."""

    def _no_state(self, app: str) -> str:
        """What was looked for and not found: the backups (unless read locally) and the stores here."""
        state = self.settings.state
        text = missing_state(state.engine, state.dir, app)
        return text if self.base.local_state else f"no state backup of app {app!r} in Redis, and {text}"

    def state_get(self, app: str, key: str) -> dict[str, Any]:
        """The state of ``key`` in ``app``, from the partition's backup in Redis (any machine).

        Without a backup (it is off), from the partition's store here, read without locking it.
        """
        keys.check_name("app", app)
        raw = self.base.partition_value(app, key, STATE_NAMESPACE, key)
        if raw is None:
            raise NotFound(f"app {app!r} has no state for key {key!r}")
        return shown_state(key, raw)

    def state_windows(self, app: str, key: str) -> list[OpenWindow]:
        """The open windows of ``key`` in ``app``'s window aggregations, oldest first.

        From the partition's backup in Redis, or without one from its store here, as
        ``state_get``; each with its window's name and topic, and the accumulator so far.
        """
        keys.check_name("app", app)
        partition = keys.partition_for(codec.encode_text("key", key), self.broker.apps.app_partitions(app))
        backup = None if self.base.local_state else self.base.backup_keys(app, partition)
        found: list[tuple[str, bytes]] = []
        if backup is not None:
            pattern = field(keys.WINDOWS_NAMESPACE, "*/" + _glob_escape(key))
            for page in self.broker.acks.backup_values(backup, match=pattern):
                found += ((split_field(name)[1], raw) for name, raw in page)
        else:
            with open_store(
                self.settings.state.engine, self.settings.state.dir, app, partition, readonly=True
            ) as store:
                found = list(store.items(keys.WINDOWS_NAMESPACE))
        windows = []
        for name, raw in found:
            window = keys.split_window_key(name)
            if window.kind == "w" and window.key == key:
                windows.append(
                    OpenWindow(
                        window=window.name or None,
                        topic=window.topic,
                        start=window.a,
                        end=int(window.b),
                        value=msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True),
                    )
                )
        if not windows:
            raise NotFound(f"app {app!r} has no open window for key {key!r}")
        return sorted(windows, key=lambda w: (w.start, w.end, w.window or "", w.topic))

    def state_keys(self, app: str, prefix: str = "", limit: int | None = None) -> list[str]:
        """The keys that have state in ``app``, over every partition store found, sorted."""
        keys.check_name("app", app)
        state = self.settings.state
        backups = {}
        if not self.base.local_state:
            backups = {
                p: b for p in range(self.base.app_partitions(app)) if (b := self.base.backup_keys(app, p))
            }
        partitions = sorted({*backups, *stored_partitions(state.engine, state.dir, app)})
        if not partitions:
            raise NotFound(self._no_state(app))
        found: list[str] = []
        head = field(STATE_NAMESPACE, prefix)
        for partition in partitions:
            if partition in backups:
                found.extend(
                    name.decode()[len(STATE_NAMESPACE) + 1 :]
                    for page in self.broker.acks.backup_values(backups[partition])
                    for name, _ in page
                    if name.startswith(head)
                )
                continue
            with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                found.extend(key for key, _ in store.items(STATE_NAMESPACE, prefix))
        found.sort()
        return found if limit is None else found[:limit]

    def state_export(
        self,
        app: str,
        partition: int | None = None,
        warn: Callable[[str], None] | None = None,
        internal: bool = False,
    ) -> Iterator[bytes]:
        """NDJSON lines of an app's state: per partition its checkpoints, then its values.

        The values of the app's state (``exporting.APP_STATE``); with ``internal`` every value,
        the bookkeeping too.

        From the partitions' backups in Redis (any machine) unless the service reads local
        state; a partition without a backup (it is off) from its store here. Each partition is
        one consistent snapshot (a running app keeps committing meanwhile). ``value`` is the
        stored msgpack, base64: exact; ``state`` repeats a state value readably. A state value
        that cannot be shown is exported all the same, with ``error`` instead of ``state``, and
        ``warn`` hears of it: a backup must not stop at a value the app cannot read either.
        """
        keys.check_name("app", app)
        state = self.settings.state
        backups: dict[int, keys.BackupKeys] = {}
        if not self.base.local_state:
            wanted = range(self.base.app_partitions(app)) if partition is None else [partition]
            backups = {p: b for p in wanted if (b := self.base.backup_keys(app, p))}
        stored = stored_partitions(state.engine, state.dir, app)
        partitions = sorted({*backups, *stored}) if partition is None else [partition]
        if not partitions:
            raise NotFound(self._no_state(app))
        for p in partitions:
            if p in backups:
                copy = snapshot(self.broker.acks, backups[p])
                if copy is not None:
                    checkpoints, values = copy
                    sorted_rows = ((ns, key, value) for (ns, key), value in sorted(values.items()))
                    yield from export_lines(app, p, checkpoints, sorted_rows, warn, internal)
                    continue
            with open_store(state.engine, state.dir, app, p, readonly=True) as store:
                checkpoints, rows = store.dump()
                try:
                    yield from export_lines(app, p, checkpoints, rows, warn, internal)
                finally:
                    # Ends the snapshot while the store is open, also when the reader stops early
                    # (a closed pipe): closed later, by the garbage collector, it fails.
                    _close(rows)

    def state_adopt(
        self, app: str, partitions: Sequence[int] = (), topics: Sequence[str] = (), replace: bool = False
    ) -> AdoptResult:
        """Take the stores here as an app's state on a server that lost its groups and backups.

        For each partition with a store here (and each of ``partitions`` without one, which
        starts anew) whose state the server lost: the store is uploaded as its backup, and its
        consumer groups are created at the store's checkpoints, past which the streams' last ids
        are moved. On a second machine, a store later than the one adopted replaces it
        (``pspf.service.adopting``; once workers applied entries on top, only with ``replace``);
        other partitions are left alone: the server holds their state. The app must be stopped.
        """
        keys.check_name("app", app)
        state = self.settings.state
        local = stored_partitions(state.engine, state.dir, app)
        stores: dict[int, tuple[dict[str, StreamId], int | None]] = {}
        for partition in local:
            with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
                built = store.get(keys.BACKUP_NAMESPACE, keys.BACKUP_PARTITIONS)
                stores[partition] = store.checkpoints(), None if built is None else int(built)
        read = _app_order(
            app, self.broker.apps.app_topic_list(app), topics, {t for cps, _ in stores.values() for t in cps}
        )
        if not read:
            raise ParameterError(
                "no store of app {app} under {dir} and no topic named: give the app's topics with {topics}",
                app=repr(app),
                dir=state.dir,
            )
        counts = {topic: self.broker.topics.topic_partitions(topic) for topic in read}
        count = next(iter(counts.values()))
        if len(set(counts.values())) > 1:
            raise ConfigError(f"the topics of app {app!r} must have the same partition count: {counts}")
        for partition, (_, recorded) in stores.items():
            check_partition_count(app, read, recorded, count, f"the store of partition {partition}")
        self.base.refuse_if_running(app, read, count)
        adopter = Adopter(self.broker, self.settings, app, read, count, replace)
        adopted: dict[int, dict[str, str]] = {}
        kept: list[int] = []
        for partition in sorted({*local, *partitions}):
            if partition >= count:
                raise ParameterError.invalid(
                    "partitions", f"{partition} is not one of the {count} partitions"
                )
            starts = adopter.adopt(partition, partition in stores)
            if starts is None:
                kept.append(partition)
            else:
                adopted[partition] = starts
        self.broker.apps.register_app(app, read, count)
        return AdoptResult(app=app, adopted=adopted, kept=kept)

    def state_import(self, app: str, lines: Iterable[bytes]) -> ImportResult:
        """Load ``state_export`` lines into an app's stores, which must be empty and not in use.

        A partition exported without its bookkeeping keeps the bookkeeping of its backup
        (``exporting.kept_bookkeeping``). The backups go then: the stores are the state.
        """
        keys.check_name("app", app)
        partitions = values = kept = 0
        current: tuple[int, StateStore, StoreTransaction] | None = None
        try:
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                line = parse_export_line(number, raw)
                if current is None or current[0] != line.partition:
                    if current is not None:
                        current[2].commit()
                        current[1].close()
                        current = None
                    current = self._empty_store(app, line.partition)
                    partitions += 1
                if isinstance(line, ExportCheckpoints):
                    for topic, entry_id in line.checkpoints.items():
                        current[2].set_checkpoint(topic, StreamId.parse(entry_id))
                    for namespace, key, value in [] if line.internal else self._bookkeeping(app, line):
                        current[2].set(namespace, key, value)
                        kept += 1
                else:
                    current[2].set(line.namespace, line.key, line.value)
                    values += 1
            if current is not None:
                current[2].commit()
        finally:
            if current is not None:
                current[1].close()
        # The imported stores are the state now: their backups go, and the next worker to take
        # each partition uploads its store.
        first = self.broker.apps.app_topic_list(app)[:1]
        for topic in first:
            for partition in range(self.broker.apps.app_partitions(app)):
                self.broker.acks.delete_backup(keys.backup_keys(topic, partition, app))
        return ImportResult(partitions=partitions, values=values, kept=kept)

    def _empty_store(self, app: str, partition: int) -> tuple[int, StateStore, StoreTransaction]:
        """A partition's store opened for an import, with its transaction; refused unless empty."""
        state = self.settings.state
        store = open_store(state.engine, state.dir, app, partition, durability=state.durability)
        if store.checkpoints() or _has_values(store):
            store.close()
            raise ConfigError(
                f"app {app!r} partition {partition} already has state under {state.dir}: "
                "import into an empty state directory"
            )
        return partition, store, store.transaction()

    def _bookkeeping(self, app: str, line: ExportCheckpoints) -> list[tuple[str, str, bytes]]:
        """What an import of a partition's app state alone keeps from its backup."""
        backup = self.base.backup_keys(app, line.partition)
        copy = None if backup is None else snapshot(self.broker.acks, backup)
        return kept_bookkeeping(app, line, copy, known=self.base.app_partitions(app) > 0)


def _app_order(app: str, recorded: list[str], named: Sequence[str], stored: set[str]) -> list[str]:
    """An app's topics in its order (its state backup is on the first one's partitions).

    The server's record keeps the order; after it was lost, the topics named come first, in the
    order given. Where neither fixes the first of several topics, ConfigError.
    """
    order = list(dict.fromkeys([*recorded, *named]))
    order += sorted(stored - set(order))
    if len(order) > 1 and not recorded and not named:
        raise ParameterError(
            "app {app} reads several topics ({found}) and the server no longer records their "
            "order: name them with {topics}, the app's first topic first (its state backup is kept "
            "there)",
            app=repr(app),
            found=", ".join(order),
        )
    return order


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern (HSCAN MATCH)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _has_values(store: StateStore) -> bool:
    rows = store.dump()[1]
    try:
        return next(rows, None) is not None
    finally:
        _close(rows)


def _close(rows: Iterator[Any]) -> None:
    """End a store snapshot's rows (``StateStore.dump``) before the store closes."""
    if isinstance(rows, Generator):
        rows.close()
