"""An app's tables: one row, from the state backup (a table) or a worker's own store (a global table).

A table (``App.table``) lives in the partitions' stores beside the state and is backed up with
it, so its row is read as ``state_get`` reads state: from the key's partition's backup in Redis,
or from its store here. A global table (``App.global_table``) is in no backup: each worker holds
it whole in a store of its own under its state dir, read here without its lock (by the CLI and
the admin API alike, under the state dir each was given). The service does not import the app,
so it knows a table only by what Redis and the stores hold: a topic the app reads (a table's rows
are simply under "table/key"), a worker's store of a global table here, the global tables the
app's record names, or a live worker saying it follows one (``Member.global_lag``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pspf import keys
from pspf.errors import NotFound, StateValueError
from pspf.keys import StreamId
from pspf.ownership.membership import live_members
from pspf.service.base import Family
from pspf.state_stores import open_globals_readonly, stored_globals


class Tables(Family):
    """Table rows."""

    def table_row(self, app: str, table: str, key: str) -> Any:
        """The row of ``key`` in ``table`` of ``app``, as JSON shows it.

        A table's from its backup in Redis, or without one from its store here (as
        ``state_get``). A global table's from the store of a worker under the state dir here:
        the CLI's ``--state-dir``, or the one ``pspf admin serve`` was started with.
        """
        keys.check_name("app", app)
        keys.check_name("table", table)
        self.broker.apps.app_partitions(app)  # NotFound for an app that never ran here
        stored = keys.table_key(table, key)
        if table in self.broker.apps.app_topic_list(app):
            raw = self.base.partition_value(app, key, keys.TABLES_NAMESPACE, stored)
            if raw is None:
                raise NotFound(f"table {table!r} of app {app!r} has no row for key {key!r}")
            return _shown_row(table, key, raw)
        copy = self._global_copy(app, table, stored)
        if copy is None:
            raise NotFound(self._no_global(app, table))
        raw, where = copy
        if raw is None:
            raise NotFound(f"global table {table!r} of app {app!r} has no row for key {key!r} (in {where})")
        return _shown_row(table, key, raw)

    def _global_copy(self, app: str, table: str, stored: str) -> tuple[bytes | None, str] | None:
        """The row in the worker's store here that read ``table`` furthest, and the store's path.

        Workers sharing a state dir each hold a copy (their positions differ by what each has yet
        to follow): the one whose last entry read is the newest. None when no store here has it.
        """
        state = self.settings.state
        best: tuple[StreamId, bytes | None, str] | None = None
        for path in stored_globals(state.engine, state.dir, app):
            try:
                store = open_globals_readonly(state.engine, path)
            except NotFound:
                continue  # its worker is creating it: nothing read yet
            with store:
                read = [at for name, at in store.checkpoints().items() if name.startswith(f"{table}/")]
                if read and (best is None or max(read) > best[0]):
                    best = max(read), store.get(keys.GLOBAL_TABLES_NAMESPACE, stored), str(path)
        return None if best is None else best[1:]

    def _no_global(self, app: str, table: str) -> str:
        """Why no row of ``table`` was read here: no worker's store of the global table, or no table.

        The app's record names its global tables (its workers write it at start); a live worker
        following the table says so too, for a record written before global tables were recorded.
        """
        recorded = self.broker.apps.app_global_tables(app)
        live = any(table in member.global_lag for member in live_members(self.broker.leases, app))
        if live or table in (recorded or []):
            text = (
                f"{table!r} is a global table of app {app!r}: its rows are read from a worker's store "
                f"of it, and none is under {self.settings.state.dir}: pass a worker's --state-dir"
            )
            return text if live else text + " (or run a worker with this one)"
        topics = ", ".join(self.broker.apps.app_topic_list(app))
        text = f"app {app!r} has no table {table!r}: it is none of the app's topics ({topics})"
        if recorded is None:
            return text + f", and no live worker follows a global table {table!r}"
        if not recorded:
            return text + " (and it has no global table)"
        return text + f" nor of its global tables ({', '.join(recorded)})"


def _shown_row(table: str, key: str, raw: bytes) -> Any:
    """A stored row (msgpack) as JSON shows it; StateValueError when it cannot be."""
    try:
        return msgspec.to_builtins(msgspec.msgpack.decode(raw), str_keys=True)
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        raise StateValueError(f"stored row of key {key!r} of table {table!r} is unreadable: {exc}") from None
