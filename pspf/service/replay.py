"""Replay and reset: move a stopped app's groups, rewinding its state to match.

Replay delivers the entries after a position again; reset starts the app afresh at the start or
the end of its topics. The groups move first, then each partition's store and state backup are
rewound in one write each (checkpoints, retry bookkeeping, the state unless kept, and the marks of
entries a redrive replaced), so a crash in between applies nothing twice and running the command
again completes it. ``parse_position`` turns the start, an entry id or a time into the position.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from pspf import codec, keys
from pspf.errors import ConfigError, DecodeError, NotFound, ParameterError, StateOutOfReach
from pspf.keys import (
    BACKUP_IDENTITY,
    BACKUP_NAMESPACE,
    DEAD_NAMESPACE,
    EXPIRY_NAMESPACE,
    FAILURES_NAMESPACE,
    FOREIGN_NAMESPACE,
    ORIGINAL_ID_HEADER,
    REDRIVE_APP_HEADER,
    SCHEDULES_NAMESPACE,
    STATE_NAMESPACE,
    SUPERSEDED_NAMESPACE,
    TABLE_HISTORY_NAMESPACE,
    TABLE_VERSIONS_NAMESPACE,
    TABLES_NAMESPACE,
    TIME_NAMESPACE,
    WINDOWS_NAMESPACE,
    StreamId,
)
from pspf.ownership.operation_lease import one_at_a_time
from pspf.partition.backup import field
from pspf.service.base import Family, parse_time_ms, stream_entries
from pspf.service.records import AppReset, ReplayResult
from pspf.state_stores import StateStore, open_store, stored_partitions

#: what a run leaves in a partition besides the state: redone by the entries handled again
BOOKKEEPING = frozenset({FAILURES_NAMESPACE, DEAD_NAMESPACE, FOREIGN_NAMESPACE, SUPERSEDED_NAMESPACE})
#: everything a reset deletes with the state: a fresh start keeps no window, timer, TTL or row
APP_STATE = frozenset(
    {
        STATE_NAMESPACE,
        WINDOWS_NAMESPACE,
        TIME_NAMESPACE,
        SCHEDULES_NAMESPACE,
        EXPIRY_NAMESPACE,
        TABLES_NAMESPACE,
        TABLE_HISTORY_NAMESPACE,
        TABLE_VERSIONS_NAMESPACE,
    }
)
#: a partition's topics and the checkpoint each is rewound to (None: from the first entry)
Checkpoints = dict[str, StreamId | None]


class Replaying(Family):
    """Replay and its steps."""

    @one_at_a_time("replay")
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
        partitions = self.broker.apps.app_partitions(app)
        read = sorted(self.broker.apps.app_topics(app))
        chosen = self._replay_topics(app, read, topics, keep_state)
        self.base.refuse_if_running(app, read, partitions)
        self._refuse_moving_forward(app, chosen, partitions, position)
        self._need_state_dir(app, "replay resets the app's checkpoints there")
        with self._stores_here(app, read, partitions) as stores:
            marks = self._superseded(app, chosen, partitions, position)
            streams = [keys.stream_key(t, p) for t in chosen for p in range(partitions)]
            if not dry_run:
                self._open_for_marks(app, stores, marks)
                for stream in streams:
                    self.broker.apps.reset_group(stream, app, str(position))
                checkpoint = None if position == keys.ZERO_ID else position
                rewound = {p: {topic: checkpoint for topic in chosen} for p in range(partitions)}
                clear = BOOKKEEPING | (set() if keep_state else APP_STATE)
                self._rewind(app, stores, rewound, marks, clear)
            entries = sum(self._entries_after(stream, position) for stream in streams)
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

    @one_at_a_time("app reset")
    def reset_app(
        self, app: str, to_end: bool = False, keep_state: bool = False, dry_run: bool = False
    ) -> AppReset:
        """Start a stopped app afresh from the start (or the end) of every topic it reads.

        Its groups are re-created there with empty pending lists. Without ``keep_state`` its state
        goes: values, windows, stream time, schedules, TTLs and table rows; a table's topic then
        starts from its first entry even ``to_end``, so the table is rebuilt before the new
        entries. The stores in this state dir and the state backups are rewound as replay does
        (stores elsewhere restore from their backup); a partition with neither is refused, since
        a store somewhere would keep checkpoints that skip the entries delivered again.

        Raises:
            NotFound: the app never ran here.
            AppRunning: a worker of the app holds a lease.
            StateOutOfReach: a partition's state is neither in a backup nor in this state dir.
        """
        keys.check_name("app", app)
        partitions = self.broker.apps.app_partitions(app)
        topics = self.broker.apps.app_topic_list(app)
        rebuilt = (
            [] if keep_state or not to_end else [t for t in self.broker.apps.app_tables(app) if t in topics]
        )
        from_start = topics if not to_end else rebuilt
        self.base.refuse_if_running(app, topics, partitions)
        with self._stores_here(app, topics, partitions) as stores:
            self._refuse_unreachable_state(app, topics[0], partitions, stores)
            positions = self._reset_positions(topics, from_start, partitions)
            skipped = sum(
                self._unhandled(app, t, p) for (t, p), at in positions.items() if at != keys.ZERO_ID
            )
            entries = sum(self._entries_after(keys.stream_key(t, p), at) for (t, p), at in positions.items())
            marks = self._superseded(app, from_start, partitions, keys.ZERO_ID)
            if not dry_run:
                self._open_for_marks(app, stores, marks)
                self._reset_groups(app, stores, positions, partitions, marks, keep_state)
        return AppReset(
            app=app,
            to="end" if to_end else "start",
            topics=topics,
            tables_rebuilt=rebuilt,
            partitions=partitions,
            entries_to_process=entries,
            entries_skipped=skipped,
            superseded=sum(len(found) for found in marks.values()),
            state_reset=not keep_state,
            stores_here=sorted(stores),
            dry_run=dry_run,
        )

    def restart_groups(self, app: str) -> list[str]:
        """Re-create a stopped app's groups at the first entry of its topics; its state untouched.

        For a sink (``pspf sink reset``), whose checkpoints live in its database and are deleted
        there after this: until then they skip what the groups deliver again, so a crash in
        between applies nothing twice. The topics (none when the app never ran).

        Raises:
            AppRunning: a worker of the app holds a lease.
        """
        keys.check_name("app", app)
        try:
            partitions = self.broker.apps.app_partitions(app)
        except NotFound:
            return []
        topics = self.broker.apps.app_topic_list(app)
        self.base.refuse_if_running(app, topics, partitions)
        for topic in topics:
            for partition in range(partitions):
                self.broker.apps.reset_group(keys.stream_key(topic, partition), app, str(keys.ZERO_ID))
        return topics

    def _reset_positions(
        self, topics: list[str], from_start: list[str], partitions: int
    ) -> dict[tuple[str, int], StreamId]:
        """Where each (topic, partition) stream starts again: its first entry, or after its last."""
        positions = {}
        for topic in topics:
            for partition in range(partitions):
                last = (
                    None
                    if topic in from_start
                    else self.broker.topics.last_id(keys.stream_key(topic, partition))
                )
                positions[(topic, partition)] = keys.ZERO_ID if last is None else StreamId.parse(last)
        return positions

    def _reset_groups(
        self,
        app: str,
        stores: dict[int, StateStore],
        positions: dict[tuple[str, int], StreamId],
        partitions: int,
        marks: dict[int, dict[tuple[str, str], bytes]],
        keep_state: bool,
    ) -> None:
        """Re-create the groups at ``positions``, then rewind the stores and backups to them."""
        rewound: dict[int, Checkpoints] = {p: {} for p in range(partitions)}
        for (topic, partition), at in positions.items():
            self.broker.apps.reset_group(keys.stream_key(topic, partition), app, str(at))
            rewound[partition][topic] = None if at == keys.ZERO_ID else at
        self._rewind(app, stores, rewound, marks, BOOKKEEPING | (set() if keep_state else APP_STATE))

    def _refuse_unreachable_state(
        self, app: str, first: str, partitions: int, stores: dict[int, StateStore]
    ) -> None:
        """Refuse partitions whose state is in no backup and not here: their stores stay unreset."""
        unreachable = [
            p
            for p in range(partitions)
            if p not in stores
            and not self.broker.acks.backup_meta(keys.backup_keys(first, p, app).meta).get(BACKUP_IDENTITY)
        ]
        if unreachable:
            raise StateOutOfReach(
                f"app {app!r} has no state backup of partitions {unreachable} and no store of them "
                f"under {self.settings.state.dir}: a store elsewhere would keep checkpoints that skip "
                "the entries delivered again. Run the reset with the state dir that holds them "
                "(--state-dir), or run the app once with the state backup on"
            )

    def _unhandled(self, app: str, topic: str, partition: int) -> int:
        """Entries of the stream the app's group has pending or not yet delivered."""
        stream = keys.stream_key(topic, partition)
        info = self.broker.topics.stream_info(stream)
        mine = info.groups.get(app)
        if mine is None:
            return info.length
        return mine.pending + self.broker.topics.count_after(stream, mine.last_delivered_id)

    @contextmanager
    def _stores_here(self, app: str, topics: list[str], partitions: int) -> Iterator[dict[int, StateStore]]:
        """The app's stores in this state dir, open until the block ends.

        Open stores are locked: a worker of the app cannot start meanwhile. Refused if a worker
        took a lease before they were opened.
        """
        state = self.settings.state
        stores: dict[int, StateStore] = {}
        try:
            for partition in stored_partitions(state.engine, state.dir, app):
                stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)
            self.base.refuse_if_running(app, topics, partitions)  # starting now waits for us
            yield stores
        finally:
            for store in stores.values():
                store.close()

    def _open_for_marks(self, app: str, stores: dict[int, StateStore], marks: Mapping[int, object]) -> None:
        """Open (create) the stores here that superseded marks must be written to."""
        state = self.settings.state
        for partition in sorted(set(marks) - set(stores)):
            stores[partition] = open_store(state.engine, state.dir, app, partition, state.durability)

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
        checkpoints: dict[int, Checkpoints],
        marks: dict[int, dict[tuple[str, str], bytes]],
        clear: set[str] | frozenset[str],
    ) -> None:
        """Rewind the stores here, then the backups, to ``checkpoints`` under one new identity."""
        identity = f"replay{int(time.time() * 1000)}-0"
        for partition, store in stores.items():
            values = {**marks.get(partition, {}), (BACKUP_NAMESPACE, BACKUP_IDENTITY): identity.encode()}
            store.rewind(clear, checkpoints[partition], values)
        self._rewind_backups(app, clear, checkpoints, marks, identity)

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
        clear: set[str] | frozenset[str],
        checkpoints: dict[int, Checkpoints],
        marks: dict[int, dict[tuple[str, str], bytes]],
        identity: str,
    ) -> None:
        """Rewind the state backups like the stores, under the identity the stores here got.

        Stores elsewhere then differ from their backup and are restored from it when their
        partition is next taken. A crash before this leaves the old backups, which a takeover
        restores: the old state with its old checkpoints, as when replay stops before the stores.
        """
        first = self.broker.apps.app_topic_list(app)[0]
        for partition, rewound in checkpoints.items():
            values = {field(ns, key): value for (ns, key), value in marks.get(partition, {}).items()}
            self.broker.acks.rewind_backup(
                keys.backup_keys(first, partition, app), clear, rewound, values, identity
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
                mine = self.broker.topics.stream_info(keys.stream_key(topic, partition)).groups.get(app)
                delivered = None if mine is None else mine.last_delivered_id
                if delivered is not None and to > StreamId.parse(delivered):
                    raise ConfigError(
                        f"{to} is after where app {app!r} stands in {topic!r} partition "
                        f"{partition} ({delivered.decode()}): replay only moves back"
                    )

    def _entries_after(self, stream: str, position: StreamId) -> int:
        length = self.broker.topics.stream_info(stream).length
        if position == keys.ZERO_ID or length == 0:
            return length
        return self.broker.topics.count_after(stream, str(position))


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
