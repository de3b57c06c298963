"""An app's outbox: list and show its rows, and ask the partitions' owners to publish rows again.

Rows are read from the partitions' state backups, else from the stores here. A row id is
``PARTITION:ROW``. A replay is a request the partition's owner applies (its store holds the
rows); the service waits for the owners' replies, and a request not applied in time stays queued.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from pspf import keys
from pspf.errors import ConfigError, NotFound, ParameterError
from pspf.outbox.rows import OutboxRow, RowState, rows_in_backup, rows_in_store
from pspf.service.base import Family, json_any
from pspf.service.records import OutboxReplay, OutboxRowDetail, OutboxRowInfo
from pspf.state_stores import open_store, stored_partitions


class OutboxRows(Family):
    """Outbox operations."""

    def _outbox_rows(self, app: str, partition: int | None = None) -> Iterator[tuple[int, OutboxRow]]:
        """(partition, row) of an app's outbox rows: from the backups, else from the stores here."""
        keys.check_name("app", app)
        state = self.settings.state
        wanted = range(self.base.app_partitions(app)) if partition is None else [partition]
        backups = (
            {} if self.base.local_state else {p: b for p in wanted if (b := self.base.backup_keys(app, p))}
        )
        stored = [p for p in stored_partitions(state.engine, state.dir, app) if partition in (None, p)]
        partitions = sorted({*backups, *stored})
        if not partitions:
            raise NotFound(f"no outbox of app {app!r} in Redis or under {state.dir}")
        for p in partitions:
            if p in backups:
                pages = self.broker.acks.backup_values(
                    backups[p], match=keys.OUTBOX_NAMESPACE.encode() + b"*"
                )
                yield from (
                    (p, row) for row in rows_in_backup((pair for page in pages for pair in page), app, p)
                )
                continue
            with open_store(state.engine, state.dir, app, p, readonly=True) as store:
                found = rows_in_store(store, app, p)
            yield from ((p, row) for row in found)

    def outbox_list(
        self, app: str, row_state: str | None = None, partition: int | None = None, limit: int | None = None
    ) -> list[OutboxRowInfo]:
        """An app's outbox rows (those in ``row_state``), by partition and row number."""
        wanted = None if row_state is None else _row_state(row_state)
        found = []
        for p, row in self._outbox_rows(app, partition):
            if wanted is None or row.state is wanted:
                found.append(OutboxRowInfo.of(p, row))
                if limit is not None and len(found) >= limit:
                    break
        return found

    def outbox_show(self, app: str, row_id: str) -> OutboxRowDetail:
        """One outbox row whole (ROW_ID as ``outbox_list`` gives it)."""
        partition, number = parse_row_id(row_id)
        return OutboxRowDetail.of(partition, self._outbox_row(app, partition, number))

    def outbox_replay(
        self,
        app: str,
        ids: Sequence[str] = (),
        dead: bool = False,
        all_rows: bool = False,
        limit: int | None = None,
        dry_run: bool = False,
        wait_s: float = 30.0,
    ) -> OutboxReplay:
        """Publish outbox rows again: DEAD or PUBLISHED -> PENDING, under new sequence numbers.

        Select rows by id, every DEAD row, or every DEAD and PUBLISHED row. The partition's
        owner applies the request (its store holds the rows); this waits up to ``wait_s`` for
        it, and a request no worker applied in time stays queued for the next owner.
        """
        if sum(1 for given in (bool(ids), dead, all_rows) if given) != 1:
            raise ParameterError("give exactly one of {ids}, {dead} or {all}")
        replayable = (RowState.PUBLISHED, RowState.DEAD)
        selected: list[tuple[int, int]] = []
        if ids:
            for row_id in ids:
                partition, number = parse_row_id(row_id)
                row = self._outbox_row(app, partition, number)
                if row.state not in replayable:
                    raise ConfigError(
                        f"outbox row {row_id} is {row.state}: only published or dead rows replay"
                    )
                selected.append((partition, number))
        else:
            states = (RowState.DEAD,) if dead else replayable
            selected = [(p, row.id) for p, row in self._outbox_rows(app) if row.state in states]
        selected = selected[:limit] if limit is not None else selected
        names = [f"{p}:{n}" for p, n in selected]
        if dry_run or not selected:
            return OutboxReplay(selected=names, dry_run=dry_run)
        by_partition: dict[int, list[int]] = {}
        for p, n in selected:
            by_partition.setdefault(p, []).append(n)
        for p, numbers in by_partition.items():
            self.broker.requests.request_outbox_replay(app, p, numbers)
        deadline = time.monotonic() + wait_s
        outcomes: dict[int, bytes | None] = {}
        while True:
            outcomes = self.broker.requests.outbox_replay_outcomes(app, sorted(by_partition))
            if all(outcomes.values()) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        replayed = [
            f"{p}:{n}" for p, raw in outcomes.items() if raw for n in json_any.decode(raw).get("replayed", [])
        ]
        return OutboxReplay(
            selected=names,
            dry_run=False,
            replayed=replayed,
            waiting=[p for p, raw in outcomes.items() if not raw],
        )

    def _outbox_row(self, app: str, partition: int, number: int) -> OutboxRow:
        """One row, from the partition's backup, else from its store here."""
        found = [row for p, row in self._outbox_rows(app, partition) if row.id == number]
        if not found:
            raise NotFound(f"app {app!r} has no outbox row {partition}:{number}")
        return found[0]


def parse_row_id(row_id: str) -> tuple[int, int]:
    """``"2:17"`` -> (partition 2, row 17)."""
    partition, sep, number = row_id.partition(":")
    if not (sep and partition.isascii() and partition.isdigit() and number.isascii() and number.isdigit()):
        raise ConfigError(
            f"invalid outbox row id {row_id!r}: expected PARTITION:ROW as `pspf outbox list` prints it"
        )
    return int(partition), int(number)


def _row_state(text: str) -> RowState:
    try:
        return RowState(text)
    except ValueError:
        raise ParameterError.invalid(
            "state", f"invalid outbox state {text!r}: use {', '.join(RowState)}"
        ) from None
