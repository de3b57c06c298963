"""The common acknowledgement as one MULTI/EXEC, sent now and its reply read later.

The acknowledgement of a batch (its backup update and its XACK, ``Acknowledging.ack_sent``) is a
transaction fenced by WATCH: the leases and backup keys are watched and checked first, so EXEC
applies nothing if one of them changed meanwhile. It goes through a connection of its own
(``Acker``), never handed back to the pool, which keeps them watched from one acknowledgement to
the next: every transaction ends with ``WATCH`` and the reads the checks need. The next one, for
the same partitions, is then checked against those replies and sent at once, without a round
trip waited for; the worker goes on with the next batch while the server applies it, and reads
its reply before it sends anything else for those partitions (``AckInFlight.result``).

EXEC runs nothing when a watched key changed since (another owner took a lease, the keeper's
thread renewed one, the backup was touched): ``result`` then runs the scripts, which say per
partition what refused it. A connection made anew watches nothing, so its first acknowledgement
waits for its checks. A lease that expires while watched and that nobody takes lets EXEC through,
as an acknowledgement just before it expired would have gone: whoever takes the lease next finds
the batch in the backup and its entries acknowledged.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import redis

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import Fields, _text, packed, usable
from pspf.errors import BrokerError, LeaseLost

#: Updates a state backup's log keeps at most (about): a store or standby at most this many
#: updates behind catches up from the log; further behind, it restores the whole backup.
BACKUP_LOG_LENGTH = 1000
#: The fewest it keeps. Between the two, the log keeps about as many values as the backup holds
#: (``log_length``): replaying more than that costs more than restoring the whole backup, and a
#: small state updated often would otherwise keep a log hundreds of times its own size.
BACKUP_LOG_MIN = 100


def log_length(backup_fields: int, update_fields: int) -> int:
    """How many updates a backup's log keeps, after one of ``update_fields`` sets and deletes."""
    if update_fields <= 0:
        return BACKUP_LOG_LENGTH
    return max(BACKUP_LOG_MIN, min(BACKUP_LOG_LENGTH, backup_fields // update_fields))


class BackupUpdate(NamedTuple):
    """Writes to a partition's state backup, made in the call that acknowledges its batch."""

    keys: keys.BackupKeys
    #: the new batch identity; "" leaves it (a later part of an upload)
    identity: str
    checkpoints: Mapping[str, str]
    #: fields and values to set, flat: field, value, field, value, ... (as the call sends them)
    sets: Sequence[bytes]
    deletes: Sequence[bytes]
    #: "update" (logged), "replace" (the first part of a whole upload: the backup is emptied
    #: first) or "upload" (a later part); uploads are not logged
    mode: str = "update"
    #: an update's fence: the identities the backup may hold now (empty: not checked); any other
    #: means the backup went back (a fail-over lost writes) and nothing is done
    follows: Collection[str] = ()
    #: how many hashes the values are spread over (``keys.bucket_of``)
    buckets: int = 1
    #: with "replace": the layout's identity, marked in every bucket but the first and, with the
    #: bucket count, in the meta ("" for one bucket); and the other buckets of the layout it
    #: replaces, deleted with the rest
    layout: str = ""
    stale: Sequence[str] = ()


def bucketed(b: BackupUpdate) -> tuple[list[tuple[str, list[bytes]]], list[tuple[str, list[bytes]]]]:
    """An update's values to set (flat pairs) and fields to delete, by the key of their bucket."""
    if b.buckets <= 1:
        return ([(b.keys.values, list(b.sets))] if b.sets else []), (
            [(b.keys.values, list(b.deletes))] if b.deletes else []
        )
    sets: dict[int, list[bytes]] = {}
    if b.layout:
        sets = {i: [keys.BACKUP_LAYOUT_MARK, b.layout.encode()] for i in range(1, b.buckets)}
    crc, count, spread = zlib.crc32, b.buckets, keys.SPREAD_FIELDS  # ``keys.bucket_of``, inlined
    for k in range(0, len(b.sets), 2):
        name = b.sets[k]
        sets.setdefault(crc(name) % count if name.startswith(spread) else 0, []).extend((name, b.sets[k + 1]))
    deletes: dict[int, list[bytes]] = {}
    for name in b.deletes:
        deletes.setdefault(crc(name) % count if name.startswith(spread) else 0, []).append(name)
    names = keys.bucket_keys(b.keys.values, count)
    return [(names[i], v) for i, v in sets.items()], [(names[i], v) for i, v in deletes.items()]


def layout_meta(b: BackupUpdate) -> list[str]:
    """The meta fields a "replace" writes for its layout (none for one bucket)."""
    if b.buckets <= 1 or not b.layout:
        return []
    return [keys.BACKUP_BUCKETS, str(b.buckets), keys.BACKUP_LAYOUT, b.layout]


class AckRequest(NamedTuple):
    """Entries of one topic partition to acknowledge, and dead ones to move, under a lease."""

    stream: str
    group: str
    lease_key: str
    lease_value: str
    ids: Sequence[bytes]
    dlq: str = ""
    #: (entry id, DLQ entry fields) of entries to move to the DLQ
    dead: Sequence[tuple[bytes, Fields]] = ()
    #: the partition's backup update, carried by the call of the app's first topic
    backup: BackupUpdate | None = None


#: The scripts' acknowledgement, which says per partition what refused it (``Acknowledging.ack_scripted``).
Scripted = Callable[[Sequence["AckRequest"]], list[tuple[int, int] | LeaseLost]]
#: What the checks read, as the replies of ``_checks``: lease values, backup heads, backup marks,
#: and the backups' field counts (for their logs' length).
Checks = tuple[list[Any], list[Any], list[Any], list[Any]]


class Acker:
    """The connection of the acknowledgements, and what its WATCH covers with the replies then."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.connection: Any = None
        self._socket: Any = None
        self._watched: tuple[str, ...] = ()
        self._checks: Checks | None = None

    def checks(self, watch: tuple[str, ...]) -> Checks | None:
        """The checks' replies when ``watch`` is watched on this socket since they were read."""
        if self.connection is None or self.connection._sock is not self._socket or self._watched != watch:
            return None
        return self._checks

    def connect(self) -> Any:
        """The connection, made anew when the server closed it (then it watches nothing)."""
        self.connection = usable(self.pool, self.connection)
        return self.connection

    def watching(self, watch: tuple[str, ...], checks: Checks) -> None:
        self._socket = self.connection._sock if self.connection is not None else None
        self._watched, self._checks = watch, checks

    def close(self) -> None:
        """Close the connection: the next acknowledgement waits for its checks."""
        connection, self.connection = self.connection, None
        self._socket, self._watched, self._checks = None, (), None
        if connection is not None:
            connection.disconnect()
            self.pool.release(connection)


def _checks(requests: Sequence[AckRequest], fenced: list[BackupUpdate]) -> list[tuple[Any, ...]]:
    """WATCH the leases and backups, then read what the checks need (``Checks``)."""
    leases = [r.lease_key for r in requests]
    reads: list[tuple[Any, ...]] = [("WATCH", *_watched(requests, fenced)), ("MGET", *leases)]
    reads += [("HMGET", b.keys.meta, "identity", keys.BACKUP_MARKED) for b in fenced]
    reads += [("HGET", b.keys.values, keys.BACKUP_MARK) for b in fenced]
    reads += [("HLEN", b.keys.values) for b in fenced]
    return reads


def _watched(requests: Sequence[AckRequest], fenced: list[BackupUpdate]) -> tuple[str, ...]:
    return (*[r.lease_key for r in requests], *[key for b in fenced for key in (b.keys.meta, b.keys.values)])


def _split(replies: list[Any], fenced: int) -> Checks:
    """The replies of ``_checks`` (after its WATCH's) as (lease values, heads, marks, field counts)."""
    heads, marks = replies[1 : 1 + fenced], replies[1 + fenced : 1 + 2 * fenced]
    return replies[0], heads, marks, replies[1 + 2 * fenced :]


def _pass(requests: Sequence[AckRequest], fenced: list[BackupUpdate], checks: Checks) -> bool:
    """Whether every lease is held and every backup is where its update follows on, undamaged."""
    held, heads, marks, _ = checks
    identities = [identity for identity, _ in heads]
    return not (
        any(_text(v) != r.lease_value for v, r in zip(held, requests, strict=True))
        or any(b.follows and _text(i) not in b.follows for b, i in zip(fenced, identities, strict=True))
        or any(marked and mark != identity for (identity, marked), mark in zip(heads, marks, strict=True))
    )


def transaction_sent(
    conn: Connection, acker: Acker, scripted: Scripted, requests: Sequence[AckRequest]
) -> AckInFlight | None:
    """Send the common acknowledgement (see the module docstring); None when a check fails.

    Then the scripts decide, per partition: a lost lease, a backup gone back or damaged.
    """
    fenced = [r.backup for r in requests if r.backup is not None]
    watch = _watched(requests, fenced)
    try:
        with conn.translate_errors():
            connection = acker.connect()
            checks = acker.checks(watch)
            if checks is None:  # not watched here yet: the checks are waited for, this once
                reads = [("UNWATCH",), *_checks(requests, fenced)]
                connection.send_packed_command(packed(reads))
                replies = [connection.read_response() for _ in reads]
                checks = _split(replies[2:], len(fenced))
            if not _pass(requests, fenced, checks):
                connection.send_packed_command(packed([("UNWATCH",)]))
                connection.read_response()
                acker.watching((), ([], [], [], []))
                return None
            commands: list[tuple[Any, ...]] = [("MULTI",)]
            positions: list[int | None] = []
            prevs = iter(zip((identity for identity, _ in checks[1]), checks[3], strict=True))
            for r in requests:
                if r.backup is not None:
                    prev, fields = next(prevs)
                    commands += _backup_commands(r.backup, _text(prev), int(fields))
                positions.append(len(commands) - 1 if r.ids else None)
                if r.ids:
                    commands.append(("XACK", r.stream, r.group, *r.ids))
            commands += [("EXEC",), *([conn.ack_wait] if conn.ack_wait else [])]
            after = _checks(requests, fenced)
            connection.send_packed_command(packed([*commands, *after]))
    except BaseException:
        acker.close()
        raise
    sent = (len(commands), len(after), watch, positions, len(fenced))
    return AckInFlight(conn, acker, requests, scripted, *sent)


class AckInFlight:
    """An acknowledgement sent (``Acknowledging.ack_sent``) whose reply ``result`` reads, once.

    The acker's connection waits for it: nothing else is sent on it before the reply is read.
    """

    def __init__(
        self,
        conn: Connection,
        acker: Acker,
        requests: Sequence[AckRequest],
        scripted: Scripted | None = None,
        replies: int = 0,
        checks: int = 0,
        watch: tuple[str, ...] = (),
        positions: Sequence[int | None] = (),
        fenced: int = 0,
        done: list[tuple[int, int] | LeaseLost] | None = None,
    ) -> None:
        self.conn, self.acker, self.scripted = conn, acker, scripted
        self.requests = requests
        self._done = done
        self._unread = done is None
        self._replies, self._checks, self._watch = replies, checks, watch
        self._positions = positions
        self._fenced = fenced

    def abandon(self) -> None:
        """Close the connection unread: the call may have run, or not."""
        if self._unread:
            self._unread = False
            self.acker.close()

    def result(self) -> list[tuple[int, int] | LeaseLost]:
        """Each request's result, as ``Acknowledging.ack`` gives it."""
        if self._done is not None:
            return self._done
        if not self._unread:
            raise BrokerError("an acknowledgement sent was already read")
        self._unread = False
        conn, acker = self.conn, self.acker
        try:
            with conn.translate_errors():
                replies = [_response(acker.connection) for _ in range(self._replies + self._checks)]
                checks = replies[self._replies :]
                for reply in replies:  # the first refusal says why (EXEC's own error only follows it)
                    if isinstance(reply, redis.ResponseError):
                        raise reply
        except BaseException:
            acker.close()
            raise
        acker.watching(self._watch, _split(checks[1:], self._fenced))
        replies = replies[: self._replies]
        if conn.ack_wait:
            conn.replicated(replies.pop())
        done = replies[-1]  # after OK and QUEUED..., EXEC's
        if done is None:  # a lease or backup changed under us: nothing was applied
            assert self.scripted is not None
            self._done = self.scripted(self.requests)
            return self._done
        for reply in done:
            if isinstance(reply, redis.ResponseError):
                with conn.translate_errors():
                    raise reply
        self._done = [(0, 0) if at is None else (int(done[at]), 0) for at in self._positions]
        return self._done


def _response(connection: Any) -> Any:
    """One reply; an error reply is returned, not raised, so the replies after it are read too."""
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


_log_encoder = msgspec.msgpack.Encoder()


def log_data(b: BackupUpdate) -> bytes:
    """An update as its log entry's ``data``: (checkpoints, flat sets, deleted fields), msgpack.

    One field, not a field per value: Redis builds a stream entry by appending to one buffer, so
    an entry of many fields costs far more than one of a single value of the same size.
    """
    return _log_encoder.encode((b.checkpoints, b.sets, b.deletes))


def _backup_commands(b: BackupUpdate, prev: str, fields: int) -> list[tuple[Any, ...]]:
    """The commands of ``lua/ack.lua``'s "update": values, deletes, meta, and the log entry.

    ``fields``: how many the backup held before (its log's length follows it, ``log_length``).
    """
    commands: list[tuple[Any, ...]] = []
    sets, deletes = bucketed(b)
    commands += [("HDEL", key, *names) for key, names in deletes]
    commands += [("HSET", key, *pairs) for key, pairs in sets]
    if b.identity:
        commands.append(("HSET", b.keys.values, keys.BACKUP_MARK, b.identity))
    meta: list[Any] = [x for topic, checkpoint in b.checkpoints.items() for x in ("cp:" + topic, checkpoint)]
    if b.identity:
        meta += ["identity", b.identity, keys.BACKUP_MARKED, "1"]
    if meta:
        commands.append(("HSET", b.keys.meta, *meta))
    if BACKUP_LOG_LENGTH > 0:
        keep = log_length(fields * b.buckets, len(b.sets) // 2 + len(b.deletes))
        head = ("XADD", b.keys.log, "MAXLEN", "~", keep, "*", "prev", prev)
        commands.append((*head, "id", b.identity or prev, "data", log_data(b)))
    return commands
