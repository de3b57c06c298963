"""Acknowledging batches under their leases, with the state backup update in the same call.

A batch's acknowledgement, its dead entries' moves to the DLQ and its partition's backup update
(values, checkpoints, one log entry) are applied together or not at all, and only while the
partition's lease is held and the backup is where the update follows on (``BackupUpdate.follows``):
one MULTI/EXEC with the leases and backup metas WATCHed in the common case, else ``lua/ack.lua``
per partition, which refuses only the partition whose lease is lost. ``acking._backup_commands`` and
``lua/ack.lua`` must keep the same effects. Also here: the reads and rewrites of a state backup.
The leases that fence these calls are taken and kept in ``leases``.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Mapping, Sequence
from typing import Any, cast

import hiredis
import redis

from pspf import keys
from pspf.broker.acking import (
    BACKUP_LOG_LENGTH,
    BACKUP_LOG_MIN,
    Acker,
    AckInFlight,
    AckRequest,
    BackupUpdate,
    bucketed,
    layout_meta,
    log_data,
    transaction_sent,
)
from pspf.broker.connection import Connection
from pspf.broker.records import _CLAIM_COUNT, Fields, _text
from pspf.errors import BackupDamaged, BackupWentBack, LeaseLost


class Acknowledging:
    """The fenced acknowledgement with its backup update, and the backup's reads and rewrites."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._ack = conn.register("ack")
        #: the connection of the acknowledgements, kept out of the pool (``pspf.broker.acking``)
        self.acker = Acker(getattr(conn.client, "connection_pool", None))  # none on a cluster

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        """Acknowledge several partitions' batches (and update their backups) under their leases.

        Usually one MULTI/EXEC with the leases WATCHed (``ack_sent``). With DLQ moves, an upload,
        or a lease not held, each partition's call runs in a Lua call that checks its lease (one
        pipelined round trip), so one lost lease refuses only that partition's acknowledgement.
        Each result is (acknowledged, moved to the DLQ) or LeaseLost (BackupWentBack when the
        backup is not where the update follows on: ``BackupUpdate.follows``).
        """
        return self.ack_sent(requests).result()

    def ack_sent(self, requests: Sequence[AckRequest]) -> AckInFlight:
        """``ack``, its reply read later (``AckInFlight.result``): the worker goes on meanwhile.

        The common acknowledgement (no DLQ moves, no upload, not on a cluster) is a MULTI/EXEC
        whose leases and backup keys are WATCHed and checked first (``pspf.broker.acking``): the
        checks read after the previous acknowledgement when its connection still watches the
        same keys, else one round trip waited for. EXEC applies nothing if a lease or a backup
        changed meanwhile; ``result`` then runs the scripts, which say which. A batch's values
        travel as command arguments, which Redis takes far faster than a script's. Any other
        acknowledgement runs here, at once.
        """
        if not requests:
            return AckInFlight(self.conn, self.acker, requests, done=[])
        common = all(not r.dead and (r.backup is None or r.backup.mode == "update") for r in requests)
        if common and not self.conn.cluster:  # one MULTI cannot span a cluster's partitions
            sent = transaction_sent(self.conn, self.acker, self.ack_scripted, requests)
            if sent is not None:
                return sent
        return AckInFlight(self.conn, self.acker, requests, done=self.ack_scripted(requests))

    def ack_scripted(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        """Each partition's acknowledgement in ``lua/ack.lua``, pipelined: one refusal each."""
        results: list[tuple[int, int] | LeaseLost] = []
        calls = [_ack_call(r) for r in requests]
        for reply in self.conn.eval_pipelined(
            self._ack, calls, raise_on_error=False, then=self.conn.ack_wait
        ):
            if isinstance(reply, redis.ResponseError):
                if str(reply).startswith("LEASE_LOST"):
                    results.append(LeaseLost(str(reply)))
                    continue
                if str(reply).startswith("BACKUP_WENT_BACK"):
                    results.append(BackupWentBack(str(reply)))
                    continue
                if str(reply).startswith("BACKUP_DAMAGED"):
                    results.append(BackupDamaged(str(reply)))
                    continue
                with self.conn.translate_errors():
                    raise reply
            results.append((int(reply[0]), int(reply[1])))
        return results

    # -- state backup ---------------------------------------------------------------------------

    def backup_meta(self, meta_key: str) -> dict[str, str]:
        """A backup's identity and checkpoints (``cp:TOPIC``); empty when there is no backup."""
        with self.conn.translate_errors(meta_key):
            raw = self.conn.client.hgetall(meta_key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def set_backup_field(self, meta_key: str, name: str, value: str) -> None:
        """Record a fact about a backup in its meta (its partition count)."""
        with self.conn.translate_errors(meta_key):
            self.conn.client.hset(meta_key, name, value)

    def backup_head(self, backup: keys.BackupKeys) -> tuple[dict[str, str], bytes | None]:
        """A backup's meta and the id of its log's last entry, read in one atomic step."""
        with self.conn.translate_errors(backup.meta):
            pipe = self.conn.on(backup.meta).pipeline(transaction=True)
            pipe.hgetall(backup.meta)
            pipe.xrevrange(backup.log, "+", "-", count=1)
            raw, last = pipe.execute()
        return {_text(k): _text(v) for k, v in raw.items()}, (bytes(last[0][0]) if last else None)

    def backup_log(self, log_key: str, after: bytes, count: int) -> list[tuple[bytes, Fields]]:
        """Up to ``count`` log entries after the id ``after``, oldest first."""
        with self.conn.translate_errors(log_key):
            reply = cast(list[Any], self.conn.client.xread({log_key: after}, count=count))
        return [(bytes(entry_id), fields) for _, entries in reply for entry_id, fields in entries]

    def backup_log_before(self, log_key: str, before: bytes | None, count: int) -> list[tuple[bytes, Fields]]:
        """Up to ``count`` log entries before the id ``before`` (all when None), newest first."""
        if before is None:
            top = "+"
        else:
            parsed = keys.StreamId.parse(before)
            if parsed == keys.ZERO_ID:
                return []
            top = str(parsed.previous())
        with self.conn.translate_errors(log_key):
            entries = cast(
                list[tuple[bytes, Fields]], self.conn.client.xrevrange(log_key, top, "-", count=count)
            )
        return [(bytes(entry_id), fields) for entry_id, fields in entries]

    def backup_layout(self, backup: keys.BackupKeys) -> tuple[list[str], str]:
        """The hashes a backup's values are in (``keys.bucket_keys``), and its layout's identity."""
        with self.conn.translate_errors(backup.meta):
            buckets, layout = self.conn.client.hmget(backup.meta, [keys.BACKUP_BUCKETS, keys.BACKUP_LAYOUT])
        return keys.bucket_keys(backup.values, int(buckets or 1)), _text(layout or b"")

    def backup_keys(self, backup: keys.BackupKeys) -> list[str]:
        """Every key a backup takes: its buckets, meta and log."""
        return [*self.backup_layout(backup)[0], backup.meta, backup.log]

    def lost_buckets(self, backup: keys.BackupKeys) -> list[str]:
        """The buckets (but the first) that lack their layout's mark: deleted or evicted alone."""
        buckets, layout = self.backup_layout(backup)
        if len(buckets) == 1:
            return []
        with self.conn.translate_errors(backup.values):
            pipe = self.conn.on(backup.values).pipeline(transaction=False)
            for key in buckets[1:]:
                pipe.hget(key, keys.BACKUP_LAYOUT_MARK)
            marks = pipe.execute()
        return [key for key, mark in zip(buckets[1:], marks, strict=True) if _text(mark or b"") != layout]

    def backup_values(
        self, backup: keys.BackupKeys, count: int = 10_000, match: bytes | None = None
    ) -> Generator[list[tuple[bytes, bytes]], None, None]:
        """A backup's fields and values (those ``match`` selects), in pages of about ``count`` (HSCAN).

        Bucket after bucket; the next page is asked for before a page is handed over, so the
        server finds it while the caller stores this one; a scan closed early drops its
        connection (a reply is due). A whole read (no ``match``) refuses a bucket that lost its
        layout's mark (BackupDamaged): its values are not all there.
        """
        buckets, layout = self.backup_layout(backup)
        node = self.conn.on(backup.values)
        tail = (b"COUNT", count) if match is None else (b"MATCH", match, b"COUNT", count)
        own = (keys.BACKUP_MARK, keys.BACKUP_LAYOUT_MARK)
        with self.conn.translate_errors(backup.values):
            connection = node.connection_pool.get_connection()

        def ask(key: str, cursor: bytes) -> None:
            command = hiredis.pack_command((b"HSCAN", key, cursor, *tail))
            connection.send_packed_command([command])  # type: ignore[no-untyped-call]

        try:
            with self.conn.translate_errors(backup.values):
                ask(buckets[0], b"0")
            for at, key in enumerate(buckets):
                marked = at == 0 or match is not None
                while True:
                    with self.conn.translate_errors(key):
                        cursor, flat = connection.read_response()
                        if cursor != b"0":
                            ask(key, cursor)
                        elif at + 1 < len(buckets):
                            ask(buckets[at + 1], b"0")
                    names = flat[::2]
                    for name in own:
                        if name in names:
                            where = names.index(name)
                            marked = marked or (name == own[1] and flat[2 * where + 1] == layout.encode())
                            del flat[2 * where : 2 * where + 2], names[where]
                    if flat:
                        pairs = iter(flat)
                        yield list(zip(pairs, pairs, strict=False))
                    if cursor == b"0":
                        break
                if not marked:
                    raise BackupDamaged(
                        f"the state backup bucket {key} lacks its layout's mark: it was deleted or "
                        "evicted on its own, and the values it held are not all there"
                    )
        except BaseException:
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            node.connection_pool.release(connection)

    def backup_value(self, backup: keys.BackupKeys, name: bytes) -> bytes | None:
        """One field of a backup, from its bucket."""
        buckets, _ = self.backup_layout(backup) if name != keys.BACKUP_MARK else ([backup.values], "")
        key = buckets[keys.bucket_of(name, len(buckets))]
        with self.conn.translate_errors(key):
            value = cast(bytes | None, self.conn.client.hget(key, name))
        return value

    def rewind_backup(
        self,
        backup: keys.BackupKeys,
        clear: Collection[str],
        checkpoints: Mapping[str, keys.StreamId | None],
        values: Mapping[bytes, bytes],
        identity: str,
    ) -> bool:
        """Rewind a backup as ``StateStore.rewind`` does a store, under a new identity.

        For a stopped app; one MULTI. The log goes: it no longer leads to this state. False
        when there is no backup.
        """
        if not self.backup_meta(backup.meta).get(keys.BACKUP_IDENTITY):
            return False
        prefixes = tuple(namespace.encode() + b"\x00" for namespace in clear)
        gone = [f for page in self.backup_values(backup) for f, _ in page if f.startswith(prefixes)]
        flat = [x for pair in values.items() for x in pair]
        count = len(self.backup_layout(backup)[0])
        sets, deletes = bucketed(BackupUpdate(backup, identity, {}, flat, gone, buckets=count))
        with self.conn.translate_errors(backup.values):
            pipe = self.conn.on(backup.values).pipeline(transaction=True)
            for key, names in deletes:
                for start in range(0, len(names), _CLAIM_COUNT):
                    pipe.hdel(key, *names[start : start + _CLAIM_COUNT])
            for key, pairs in sets:
                pipe.hset(key, items=pairs)
            pipe.hset(backup.values, keys.BACKUP_MARK, identity)
            dropped = [f"cp:{topic}" for topic, cid in checkpoints.items() if cid is None]
            if dropped:
                pipe.hdel(backup.meta, *dropped)
            meta: dict[str | bytes, str | bytes] = {keys.BACKUP_IDENTITY: identity, keys.BACKUP_MARKED: "1"}
            meta.update({f"cp:{topic}": str(cid) for topic, cid in checkpoints.items() if cid is not None})
            pipe.hset(backup.meta, mapping=meta)  # type: ignore[arg-type]
            pipe.delete(backup.log)
            pipe.execute()
        return True

    def delete_backup(self, backup: keys.BackupKeys) -> None:
        names = self.backup_keys(backup)
        with self.conn.translate_errors(backup.values):
            self.conn.client.delete(*names)


def _ack_call(r: AckRequest) -> tuple[list[Any], list[Any]]:
    """The keys and arguments of ``lua/ack.lua`` for one request."""
    b = r.backup
    mode = "" if b is None else b.mode
    args: list[Any] = [
        r.group,
        r.lease_value,
        len(r.ids),
        len(r.dead),
        mode,
        f"{BACKUP_LOG_LENGTH}:{BACKUP_LOG_MIN}",
        "" if b is None else ",".join(b.follows),
        1 if b is None else b.buckets,
        *r.ids,
    ]
    for entry_id, fields in r.dead:
        args += [entry_id, 2 * len(fields), *(x for pair in fields.items() for x in pair)]
    if b is None:
        return [r.stream, r.lease_key, r.dlq or r.stream, r.stream, r.stream, r.stream], args
    sets, deletes = bucketed(b)
    meta = layout_meta(b)
    args += [b.identity, len(b.checkpoints), len(meta) // 2, len(sets), len(deletes)]
    for topic, checkpoint in b.checkpoints.items():
        args += [topic, checkpoint]
    args += meta
    call_keys = [r.stream, r.lease_key, r.dlq or r.stream, *b.keys]
    if b.mode == "replace":
        others = {*keys.bucket_keys(b.keys.values, b.buckets)[1:], *b.stale} - {b.keys.values}
        call_keys += sorted(others)
    index = {key: at for at, key in enumerate(call_keys, 1) if at >= 4}
    for key, _ in [*sets, *deletes]:
        if key not in index:
            index[key] = len(call_keys) + 1
            call_keys.append(key)
    for key, pairs in sets:
        args += [index[key], len(pairs) // 2, *pairs]
    for key, names in deletes:
        args += [index[key], len(names), *names]
    args.append(log_data(b) if b.mode == "update" else b"")
    return call_keys, args
