"""Replay: deliver a stopped app's entries after a position again, rewinding its state to match.

The group moves first, then each partition's store and state backup are rewound in one write
each (checkpoints, retry bookkeeping, the state unless kept, and the marks of entries a redrive
replaced), so a crash in between applies nothing twice and running replay again completes it.
``parse_position`` turns the start, an entry id or a time into the position.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from pspf import codec, keys
from pspf.backup import field
from pspf.errors import ConfigError, DecodeError, NotFound, ParameterError
from pspf.keys import (
    BACKUP_IDENTITY,
    BACKUP_NAMESPACE,
    DEAD_NAMESPACE,
    FAILURES_NAMESPACE,
    FOREIGN_NAMESPACE,
    ORIGINAL_ID_HEADER,
    REDRIVE_APP_HEADER,
    STATE_NAMESPACE,
    SUPERSEDED_NAMESPACE,
    StreamId,
)
from pspf.records import ReplayResult
from pspf.service.base import ServiceBase, parse_time_ms, stream_entries
from pspf.state_stores import StateStore, open_store, stored_partitions


class Replaying(ServiceBase):
    """Replay and its steps."""

    def replay(
        self,
        app: str,
        topics: Sequence[str],
        position: StreamId,
        keep_state: bool = False,
        dry_run: bool = False,
    ) -> ReplayResult:
        """Deliver the entries of ``topics`` after ``position`` to ``app`` again.

        The app must be stopped. The group moves first (re-created at ``position``, with an
        empty pending list); then each partition's store is rewound in one write: checkpoints to
        ``position``, retry bookkeeping dropped, and the state cleared unless ``keep_state``. A
        crash in between leaves the old state with its old checkpoints, which skip the
        re-delivered entries: nothing is applied twice, and running replay again completes it.

        The same write marks the replayed entries that a redrive for ``app`` replaced with a copy
        that is replayed too (each link of a chain of redrives but the last): the app skips them
        and applies the copy, as the first run did, even if the original now succeeds. With
        ``keep_state`` too: the state already holds each entry's effect once, through its copy,
        and the replay applies it once more the same way, never once per copy.
        """
        keys.check_name("app", app)
        partitions = self.broker.app_partitions(app)
        read = sorted(self.broker.app_topics(app))
        chosen = self._replay_topics(app, read, topics, keep_state)
        self._refuse_if_running(app, read, partitions)
        self._refuse_moving_forward(app, chosen, partitions, position)
        state = self.settings.state
        self._need_state_dir(app, "replay resets the app's checkpoints there")
        stores: dict[int, StateStore] = {}
        try:
            for partition in stored_partitions(state.engine, state.dir, app):  # locks them: a worker
                stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)
            self._refuse_if_running(app, read, partitions)  # starting now waits for us
            marks = self._superseded(app, chosen, partitions, position)
            streams = [keys.stream_key(t, p) for t in chosen for p in range(partitions)]
            if not dry_run:
                for partition in sorted(set(marks) - set(stores)):  # the marks need a store
                    stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)
                for stream in streams:
                    self.broker.reset_group(stream, app, str(position))
                self._rewind(app, stores, chosen, partitions, position, marks, keep_state)
            entries = sum(self._entries_after(stream, position) for stream in streams)
        finally:
            for store in stores.values():
                store.close()
        return ReplayResult(
            app=app,
            topics=chosen,
            position=str(position),
            partitions=partitions,
            entries_to_replay=entries,
            superseded=sum(len(found) for found in marks.values()),
            state_reset=not keep_state,
            dry_run=dry_run,
        )

    def _need_state_dir(self, app: str, why: str) -> None:
        state = self.settings.state
        if not (Path(state.dir) / app).is_dir():
            raise NotFound(
                f"no state of app {app!r} under {state.dir}: {why}, "
                "give the app's state directory (--state-dir)"
            )

    def _rewind(
        self,
        app: str,
        stores: dict[int, StateStore],
        topics: list[str],
        partitions: int,
        position: StreamId,
        marks: dict[int, dict[tuple[str, str], bytes]],
        keep_state: bool,
    ) -> None:
        """Rewind the stores here, then the backups, to ``position`` under one new identity."""
        checkpoint = None if position == keys.ZERO_ID else position
        clear = {FAILURES_NAMESPACE, DEAD_NAMESPACE, FOREIGN_NAMESPACE, SUPERSEDED_NAMESPACE}
        clear |= set() if keep_state else {STATE_NAMESPACE}
        identity = f"replay{int(time.time() * 1000)}-0"
        for partition, store in stores.items():
            values = {**marks.get(partition, {}), (BACKUP_NAMESPACE, BACKUP_IDENTITY): identity.encode()}
            store.rewind(clear, {topic: checkpoint for topic in topics}, values)
        self._rewind_backups(app, partitions, clear, {t: checkpoint for t in topics}, marks, identity)

    def _superseded(
        self, app: str, topics: list[str], partitions: int, position: StreamId
    ) -> dict[int, dict[tuple[str, str], bytes]]:
        """Per partition, the marks of the entries after ``position`` that a redrive replaced.

        A redriven copy for ``app`` names the entry it was redriven from (its original id
        header), in the same partition. Both are replayed when the original is after
        ``position``; the copy's id is the mark's value.
        """
        marks: dict[int, dict[tuple[str, str], bytes]] = {}
        for topic in topics:
            for partition in range(partitions):
                stream = keys.stream_key(topic, partition)
                for entry_id, fields in stream_entries(self.broker, stream, position, page_size=1000):
                    replaced = _redriven_from(fields, app)
                    if replaced is not None and position < replaced < StreamId.parse(entry_id):
                        name = keys.entry_name(topic, str(replaced).encode())
                        marks.setdefault(partition, {})[(SUPERSEDED_NAMESPACE, name)] = entry_id
        return marks

    def _rewind_backups(
        self,
        app: str,
        partitions: int,
        clear: set[str],
        checkpoints: dict[str, StreamId | None],
        marks: dict[int, dict[tuple[str, str], bytes]],
        identity: str,
    ) -> None:
        """Rewind the state backups like the stores, under the identity the stores here got.

        Stores elsewhere then differ from their backup and are restored from it when their
        partition is next taken. A crash before this leaves the old backups, which a takeover
        restores: the old state with its old checkpoints, as when replay stops before the stores.
        """
        first = self.broker.app_topic_list(app)[0]
        for partition in range(partitions):
            values = {field(ns, key): value for (ns, key), value in marks.get(partition, {}).items()}
            self.broker.rewind_backup(
                keys.backup_keys(first, partition, app),
                clear,
                checkpoints,
                values,
                identity,
            )

    @staticmethod
    def _replay_topics(app: str, read: list[str], topics: Sequence[str], keep_state: bool) -> list[str]:
        """The topics to replay; all the app reads unless its state is kept."""
        chosen = sorted(set(topics))
        if not chosen:
            raise ConfigError("give at least one topic to replay")
        unknown = [t for t in chosen if t not in read]
        if unknown:
            raise NotFound(f"app {app!r} does not read topic(s) {unknown}; it reads {read}")
        others = [t for t in read if t not in chosen]
        if others and not keep_state:
            raise ParameterError(
                "app {app!r} also reads {others}, and its state comes from all its topics: replay "
                "them too (name them in {topics}), or keep the state with {keep_state}",
                app=app,
                others=others,
            )
        return chosen

    def _refuse_moving_forward(self, app: str, topics: list[str], partitions: int, to: StreamId) -> None:
        for topic in topics:
            for partition in range(partitions):
                # XINFO GROUPS alone: group_position might also count the lag, not needed here.
                mine = self.broker.stream_info(keys.stream_key(topic, partition)).groups.get(app)
                delivered = None if mine is None else mine.last_delivered_id
                if delivered is not None and to > StreamId.parse(delivered):
                    raise ConfigError(
                        f"{to} is after where app {app!r} stands in {topic!r} partition "
                        f"{partition} ({delivered.decode()}): replay only moves back"
                    )

    def _entries_after(self, stream: str, position: StreamId) -> int:
        length = self.broker.stream_info(stream).length
        if position == keys.ZERO_ID or length == 0:
            return length
        return self.broker.count_after(stream, str(position))


def parse_position(
    from_start: bool = False, to_id: str | None = None, to_time: str | None = None
) -> StreamId:
    """A replay position from exactly one of: the start, an entry id, a time.

    ``to_id`` replays the entries after that id. ``to_time`` (ISO 8601, UTC unless it names an
    offset, or unix milliseconds) replays the entries added at or after that time.
    """
    if sum(1 for given in (from_start, to_id, to_time) if given) != 1:
        raise ParameterError("give exactly one of {from_start}, {to_id} or {to_time}")
    if from_start:
        return keys.ZERO_ID
    if to_id is not None:
        try:
            return StreamId.parse(to_id)
        except ConfigError as exc:
            raise ParameterError.invalid("to_id", str(exc)) from None
    assert to_time is not None
    ms = parse_time_ms(to_time, "to_time")
    return keys.ZERO_ID if ms <= 0 else StreamId(ms - 1, keys.MAX_SEQ)


def _redriven_from(fields: dict[bytes, bytes], app: str) -> StreamId | None:
    """The id an entry was redriven from, when a redrive for ``app`` added it; else None."""
    raw = fields.get(codec.HEADERS)
    if raw is None or REDRIVE_APP_HEADER.encode() not in raw:
        return None
    try:
        headers = codec.decode_headers(raw)
        if headers.get(REDRIVE_APP_HEADER) != app:
            return None
        return StreamId.parse(headers.get(ORIGINAL_ID_HEADER, ""))
    except (DecodeError, ConfigError):
        return None  # headers a producer wrote by hand: not a redrive's
