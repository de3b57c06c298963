"""What operators ask of a topic's DLQ and of an app's partition owners.

DLQ redrive moves one entry atomically (``lua/redrive.lua``). Outbox-replay requests are how an
operator asks a partition's owner to replay rows: a request waits in a hash until the owner
records its outcome, unless a newer request replaced it meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import cast

import msgspec
import redis

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import Fields


class Requests:
    """The DLQ's entries and moves, and outbox-replay requests."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._redrive = conn.register("redrive")

    # -- DLQ ------------------------------------------------------------------------------------

    def dlq_range(
        self, dlq: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[tuple[bytes, Fields]]:
        """DLQ entries in id order."""
        with self.conn.translate_errors():
            return list(self.conn.client.xrange(dlq, start, end, count))

    def redrive(self, dlq: str, stream: str, dlq_id: bytes, fields: Fields) -> bytes | None:
        """Move one DLQ entry back to ``stream`` as ``fields``; None when it was gone already."""
        args = [dlq_id, *(x for pair in fields.items() for x in pair)]
        with self.conn.translate_errors():
            new_id = self._redrive(keys=[dlq, stream], args=args)
        return None if new_id is None else bytes(new_id)

    def dlq_delete(self, dlq: str, ids: Sequence[bytes]) -> int:
        with self.conn.translate_errors():
            return int(self.conn.client.xdel(dlq, *ids)) if ids else 0

    # -- outbox replay requests ---------------------------------------------------------------

    def request_outbox_replay(self, app: str, partition: int, ids: Sequence[int]) -> None:
        """Ask the owner of a partition to replay outbox rows (added to a request still waiting)."""
        key = keys.outbox_replay_key(app)
        with self.conn.translate_errors(key), self.conn.on(key).pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    waiting = pipe.hget(key, str(partition))
                    wanted = sorted({*ids, *(msgspec.json.decode(waiting) if waiting else [])})
                    pipe.multi()
                    pipe.hset(key, str(partition), msgspec.json.encode(wanted))
                    pipe.hdel(keys.outbox_replayed_key(app), str(partition))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def outbox_replay_requests(self, app: str, partitions: Sequence[int]) -> dict[int, bytes]:
        """The waiting replay requests (raw) of those partitions."""
        if not partitions:
            return {}
        key = keys.outbox_replay_key(app)
        with self.conn.translate_errors(key):
            found = cast(list[bytes | None], self.conn.client.hmget(key, [str(p) for p in partitions]))
        return {p: raw for p, raw in zip(partitions, found, strict=True) if raw}

    def finish_outbox_replay(self, app: str, partition: int, request: bytes, outcome: bytes) -> None:
        """Record what a replay request did and drop it, unless a newer request replaced it meanwhile."""
        key = keys.outbox_replay_key(app)
        with self.conn.translate_errors(key), self.conn.on(key).pipeline(transaction=True) as pipe:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            if pipe.hget(key, str(partition)) != request:
                pipe.unwatch()
                return  # the next lease round applies the newer one (it includes these ids too)
            pipe.multi()
            pipe.hdel(key, str(partition))
            pipe.hset(keys.outbox_replayed_key(app), str(partition), outcome)
            with suppress(redis.WatchError):
                pipe.execute()

    def outbox_replay_outcomes(self, app: str, partitions: Sequence[int]) -> dict[int, bytes | None]:
        """Per partition: None while its request waits, else what its owner did (raw JSON)."""
        with self.conn.translate_errors(keys.outbox_replay_key(app)):
            pipe = self.conn.on(keys.outbox_replay_key(app)).pipeline(transaction=True)
            pipe.hmget(keys.outbox_replay_key(app), [str(p) for p in partitions])
            pipe.hmget(keys.outbox_replayed_key(app), [str(p) for p in partitions])
            waiting, done = pipe.execute()
        return {p: None if w else d for p, w, d in zip(partitions, waiting, done, strict=True)}
