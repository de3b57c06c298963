"""Reads sent ahead: the next batch asked for while this one is handled, fenced by the leases.

A read sent ahead goes through a connection of its own (``Reader``), never handed back to the
pool, because it keeps the partitions' leases WATCHed from one read to the next: every read ends
with ``WATCH leases`` and ``MGET leases``. The next read is then a plain ``MULTI, XREADGROUP,
EXEC`` when each lease was this worker's right after it was watched: EXEC runs only if no lease
changed since, so it delivers only under leases still held, and costs the server no more than
the XREADGROUP itself. A fenced read through ``lua/read.lua`` costs it about twice as much (the
entries are copied into Lua and back), so it is kept for the reads that cannot be armed: the
first one, one after the streams or a lease changed, one after the connection was made anew
(a WATCH does not survive its socket). A lease renewed meanwhile (the keeper's thread) makes
EXEC deliver nothing: the caller reads again.

A lease that expires while watched and that nobody takes leaves the read going through; that is
what a read just before it expired would have done: what it delivered is pending here, and
whoever takes the lease next claims the partition's pending entries before anything new.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import redis
from redis.exceptions import NoScriptError

from pspf.broker.connection import Connection
from pspf.broker.records import RawEntry, _entries, packed, usable
from pspf.errors import BrokerError


class Reads(Protocol):
    """What a read sent ahead needs of the reading family (``Reading``)."""

    conn: Connection
    reader: Reader

    @property
    def read_sha(self) -> str:
        """The SHA of ``lua/read.lua``."""

    def load_read_script(self) -> None: ...


Reply = tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]


class Reader:
    """The connection of the reads sent ahead, and the leases it watches with their values then."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.connection: Any = None
        #: the socket the WATCH was sent on: one made anew has no WATCH
        self._socket: Any = None
        self._watched: dict[str, bytes | None] = {}

    def armed(self, streams: Sequence[tuple[str, str, str]]) -> bool:
        """Whether every lease of ``streams`` is watched on this socket and was held right after.

        Checks the connection first (made anew if the server closed it: then it watches nothing),
        so the read ``send`` sends next goes on the socket this answer was given for.
        """
        self.connection = usable(self.pool, self.connection)
        if self._socket is None or self.connection._sock is not self._socket:
            return False
        if len(self._watched) != len(streams):
            return False
        return all(self._watched.get(lease) == value.encode() for _, lease, value in streams)

    def send(self, commands: list[tuple[Any, ...]]) -> Any:
        """Send ``commands`` in one write on the reader's connection (after ``armed``: never made anew)."""
        if self.connection is None:
            self.connection = self.pool.get_connection()
        self.connection.send_packed_command(packed(commands))
        return self.connection

    def watching(self, leases: Sequence[str], values: Sequence[bytes | None]) -> None:
        """Note the leases the last read watched and their values right after."""
        self._socket = self.connection._sock if self.connection is not None else None
        self._watched = dict(zip(leases, values, strict=True))

    def close(self) -> None:
        """Close the connection: the reads after this one are scripted until it is armed again."""
        connection, self.connection = self.connection, None
        self._socket, self._watched = None, {}
        if connection is not None:
            connection.disconnect()
            self.pool.release(connection)


class ReadAhead:
    """A fenced read sent ahead (``Reading.read_ahead``); the reader's connection waits for its reply.

    What it delivered is pending for this consumer either way: ``take`` returns it as
    ``read_new`` would, ``drop`` only says which entries they were (to be read again from the
    pending list, in order), ``abandon`` closes the connection without reading.
    """

    def __init__(self, reading: Reads, streams: list[tuple[str, str, str]], armed: bool) -> None:
        self.reading = reading
        self.streams = [stream for stream, _, _ in streams]
        self.leases = [lease for _, lease, _ in streams]
        self.armed = armed
        self._unread = True

    @staticmethod
    def commands(
        reading: Reads,
        group: str,
        consumer: str,
        streams: Sequence[tuple[str, str, str]],
        count: int,
        armed: bool,
    ) -> list[tuple[Any, ...]]:
        """The read (armed: in MULTI/EXEC; else one ``lua/read.lua`` call a stream), then the WATCH."""
        names = [stream for stream, _, _ in streams]
        leases = [lease for _, lease, _ in streams]
        if armed:
            read = ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS")
            commands: list[tuple[Any, ...]] = [("MULTI",), (*read, *names, *[">"] * len(names)), ("EXEC",)]
        else:
            sha = reading.read_sha
            commands = [("UNWATCH",)]
            for stream, lease, value in streams:
                commands.append(("EVALSHA", sha, 2, stream, lease, group, consumer, count, value))
        return [*commands, ("WATCH", *leases), ("MGET", *leases)]

    def take(self) -> Reply | None:
        """The read's result as ``read_new`` returns it.

        None when it delivered nothing: a lease changed since it was watched (EXEC ran nothing),
        the streams had nothing new, or the server had no script (a restart emptied its cache);
        the caller reads again.
        """
        return self._replies()

    def drop(self) -> dict[str, list[bytes]]:
        """Read the replies without using them: the ids delivered, per stream."""
        taken = self._replies()
        if taken is None:
            return {}
        return {stream.decode(): [entry_id for entry_id, _ in entries] for stream, entries in taken[1]}

    def abandon(self) -> None:
        """Close the connection unread: what the read delivered stays pending for this consumer."""
        if self._unread:
            self._unread = False
            self.reading.reader.close()

    def _replies(self) -> Reply | None:
        if not self._unread:
            raise BrokerError("a read sent ahead was already read")
        self._unread = False
        reader = self.reading.reader
        connection = reader.connection
        try:
            with self.reading.conn.translate_errors():
                replies = [_response(connection) for _ in range(self._count())]
                _raised(replies[-2])  # the WATCH, before what it covers is trusted
                reader.watching(self.leases, _raised(replies[-1]))
                return self._armed(replies) if self.armed else self._scripted(replies[1:-2])
        except BaseException:
            reader.close()
            raise

    def _count(self) -> int:
        return 5 if self.armed else 3 + len(self.streams)

    def _armed(self, replies: list[Any]) -> Reply | None:
        _raised(replies[0])
        _raised(replies[1])
        executed = _raised(replies[2])
        if executed is None:  # a lease changed after it was watched: nothing ran
            return None
        (reply,) = executed
        if not reply:
            return None  # nothing new: read_new gives the streams' last ids to wait after
        return [], [(stream, _entries(_raised(raw))) for stream, raw in _raised(reply)], {}

    def _scripted(self, replies: list[Any]) -> Reply | None:
        if any(isinstance(reply, NoScriptError) for reply in replies):
            self.reading.load_read_script()
            return None
        return fenced_reads(self.streams, [_raised(reply) for reply in replies])


def fenced_reads(streams: Sequence[str], replies: Sequence[Any]) -> Reply:
    """``lua/read.lua``'s replies as ``Reading.read_new`` returns them: lost, read, last ids."""
    lost: list[str] = []
    read: list[tuple[bytes, list[RawEntry]]] = []
    last: dict[str, bytes] = {}
    for stream, reply in zip(streams, replies, strict=True):
        if reply[0] == 0:
            lost.append(stream)
        elif reply[0] == 1:
            read.append((stream.encode(), _entries(reply[1])))
        else:
            last[stream] = bytes(reply[1])
    return lost, read, ({} if read else last)


def _response(connection: Any) -> Any:
    """One reply; an error reply is returned, not raised, so the replies after it are read too."""
    try:
        return connection.read_response()
    except redis.ResponseError as exc:
        return exc


def _raised(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply
