"""The round trips of a repartition: entries copied with their ids, staged keys swapped in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis

from pspf.broker.connection import Connection
from pspf.broker.records import Fields

#: Entries per pipelined round trip when copying.
COPY_CHUNK = 1000


class Moving:
    """Copying streams and hashes into staged keys, and renaming them over the live ones.

    A repartition is claimed per topic (``lua/repartition_claim.lua``, ``lua/repartition_abort.lua``)
    with three keys under the topic's hash tag: its plan, its runner's lease and an abort's mark.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._repartition_claim = conn.register("repartition_claim")
        self._repartition_abort = conn.register("repartition_abort")

    def claim_repartition(self, claim_keys: Sequence[str], plan: str, runner: str, ttl_ms: int) -> list[str]:
        """Record ``plan`` ("": take up the recorded one) with ``runner`` holding its lease, atomically.

        The script's reply: ``taken``, ``held``, ``aborting`` or ``none``, then plan and runner.
        """
        with self.conn.translate_errors(claim_keys[0]):
            reply = self._repartition_claim(keys=claim_keys, args=[plan, runner, ttl_ms])
        return [_text(part) for part in reply]

    def claim_abort(self, claim_keys: Sequence[str]) -> list[str]:
        """Turn a topic's plan into its abort mark unless a runner holds it or it began to switch."""
        with self.conn.translate_errors(claim_keys[0]):
            reply = self._repartition_abort(keys=claim_keys)
        return [_text(part) for part in reply]

    def add_with_ids(self, stream: str, entries: Sequence[tuple[str, Fields]]) -> None:
        """XADD each entry under its given id (ascending, above the stream's last), pipelined."""
        node = self.conn.on(stream)
        with self.conn.translate_errors(stream):
            for start in range(0, len(entries), COPY_CHUNK):
                pipe = node.pipeline(transaction=False)
                for entry_id, fields in entries[start : start + COPY_CHUNK]:
                    pipe.xadd(stream, fields, id=entry_id)  # type: ignore[arg-type]
                pipe.execute()

    def replace_hash(self, key: str, mapping: Mapping[Any, Any]) -> None:
        """The hash ``key`` holds exactly ``mapping`` (none: the key is deleted), in one MULTI."""
        with self.conn.translate_errors(key):
            pipe = self.conn.on(key).pipeline(transaction=True)
            pipe.delete(key)
            items = list(mapping.items())
            for start in range(0, len(items), COPY_CHUNK):
                pipe.hset(key, mapping=dict(items[start : start + COPY_CHUNK]))
            pipe.execute()

    def add_fields(self, key: str, pairs: Sequence[tuple[Any, Any]]) -> None:
        """HSET ``pairs`` into the hash ``key``, in chunks of one pipeline."""
        with self.conn.translate_errors(key):
            pipe = self.conn.on(key).pipeline(transaction=False)
            for start in range(0, len(pairs), COPY_CHUNK):
                pipe.hset(key, mapping=dict(pairs[start : start + COPY_CHUNK]))
            pipe.execute()

    def rename_over(self, source: str, target: str) -> bool:
        """RENAME ``source`` over ``target`` (same slot); False when ``source`` is gone already."""
        with self.conn.translate_errors(source):
            try:
                self.conn.on(source).rename(source, target)
            except redis.ResponseError as exc:
                if "no such key" in str(exc).lower():
                    return False
                raise
        return True

    def empty_stream(self, key: str) -> None:
        """Make ``key`` an empty stream (a group made with MKSTREAM, then destroyed), in one MULTI."""
        with self.conn.translate_errors(key):
            pipe = self.conn.on(key).pipeline(transaction=True)
            pipe.delete(key)
            pipe.xgroup_create(key, "pspf-empty", id="0", mkstream=True)
            pipe.xgroup_destroy(key, "pspf-empty")
            pipe.execute()

    def set_if_absent(self, key: str, value: str, ttl_ms: int) -> bool:
        """SET ``key`` NX PX: an operation's lease; False when another holds it."""
        with self.conn.translate_errors(key):
            return bool(self.conn.client.set(key, value, nx=True, px=ttl_ms))

    def set_value(self, key: str, value: str) -> None:
        with self.conn.translate_errors(key):
            self.conn.client.set(key, value)

    def exists(self, key: str) -> bool:
        with self.conn.translate_errors(key):
            return bool(self.conn.client.exists(key))

    def delete_keys(self, names: Sequence[str]) -> None:
        """DEL each of ``names`` (one command a key: they may be in any slot)."""
        with self.conn.translate_errors():
            pipe = self.conn.client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

    def hash_fields(self, key: str) -> dict[str, str]:
        with self.conn.translate_errors(key):
            raw = self.conn.client.hgetall(key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def set_fields(self, key: str, mapping: Mapping[str, str]) -> None:
        with self.conn.translate_errors(key):
            self.conn.client.hset(key, mapping=dict(mapping))

    def delete_fields(self, key: str, names: Sequence[str]) -> None:
        if names:
            with self.conn.translate_errors(key):
                self.conn.client.hdel(key, *names)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw
