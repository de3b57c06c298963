"""Partition leases with fencing tokens, and the app's memberships (worker heartbeats).

A lease is a key holding ``consumer/pid/nonce|token``: taken only when free (``lua/lease_acquire.lua``,
the token from the partition's fence counter, so it only grows), renewed and released only by the
value that holds it. The fenced reads and acknowledgements check it; a membership is what the
rendezvous assignment of partitions to workers is computed over.
"""

from __future__ import annotations

from collections.abc import Sequence

from pspf import keys
from pspf.broker.connection import Connection
from pspf.broker.records import _text


class Leasing:
    """Taking, renewing and giving up partition leases; workers' memberships of an app."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lease_acquire = conn.register("lease_acquire")
        self._lease_renew = conn.register("lease_renew")
        self._lease_release = conn.register("lease_release")
        self._member_heartbeat = conn.register("member_heartbeat")

    def acquire_lease(self, lease_key: str, fence_key: str, owner: str, ttl_ms: int) -> str | None:
        """Take a free lease; its value (owner and fencing token), or None when it is held."""
        with self.conn.translate_errors():
            value = self._lease_acquire(keys=[lease_key, fence_key], args=[owner, ttl_ms])
        return None if value is None else bytes(value).decode()

    def renew_leases(self, leases: Sequence[tuple[str, str]], ttl_ms: int) -> list[bool]:
        """Extend leases (key, value) in one round trip; False where a lease is lost."""
        calls = [([key], [value, ttl_ms]) for key, value in leases]
        return [bool(r) for r in self.conn.eval_pipelined(self._lease_renew, calls)]

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        """Give leases up so a standby takes the partitions at once."""
        self.conn.eval_pipelined(self._lease_release, [([key], [value]) for key, value in leases])

    def lease_values(self, lease_keys: Sequence[str]) -> list[str | None]:
        """Each lease's value (``consumer/pid/nonce|token``), None where it is free."""
        with self.conn.translate_errors():
            if not lease_keys:
                values = []
            elif self.conn.cluster:  # the leases of several partitions are in several slots
                values = self.conn.client.mget_nonatomic(lease_keys)
            else:
                values = self.conn.client.mget(lease_keys)
        return [None if v is None else _text(v) for v in values]

    def lease_holders(self, lease_keys: Sequence[str]) -> list[str | None]:
        """The owner part of each lease's value (``consumer/pid/nonce``), None where it is free."""
        return [None if v is None else v.rpartition("|")[0] for v in self.lease_values(lease_keys)]

    # -- members --------------------------------------------------------------------------------

    def member_heartbeat(
        self, app: str, member: str, ttl_ms: int, info: bytes, stay: bool = True
    ) -> tuple[int, bool, list[tuple[str, int, int, bytes]]]:
        """Renew (or end) a worker's membership; the server's time, whether it was a member, the live.

        Each member as (id, joined ms, expiry ms, info), in id order. "Was a member": its entries
        were there and unexpired before this call.
        """
        member_keys = [keys.members_key(app), keys.joined_key(app), keys.member_info_key(app)]
        with self.conn.translate_errors(member_keys[0]):
            reply = self._member_heartbeat(
                keys=member_keys, args=[member, ttl_ms, info, "1" if stay else "0"]
            )
        now, present, rest = int(reply[0]), int(reply[1]) == 1, reply[2:]
        return (
            now,
            present,
            [
                (_text(rest[i]), int(float(rest[i + 1])), int(float(rest[i + 2])), bytes(rest[i + 3]))
                for i in range(0, len(rest), 4)
            ],
        )

    def members(self, app: str) -> tuple[int, list[tuple[str, int, int, bytes]]]:
        """The server's time and the live members as ``member_heartbeat`` gives them (a read only)."""
        with self.conn.translate_errors(keys.members_key(app)):
            pipe = self.conn.on(keys.members_key(app)).pipeline(transaction=True)
            pipe.time()
            pipe.zrange(keys.members_key(app), 0, -1, withscores=True)
            pipe.zrange(keys.joined_key(app), 0, -1, withscores=True)
            pipe.hgetall(keys.member_info_key(app))
            (seconds, micros), expiries, joined, info = pipe.execute()
        now = int(seconds) * 1000 + int(micros) // 1000
        since = {_text(m): int(score) for m, score in joined}
        return now, [
            (_text(m), since.get(_text(m), now), int(expiry), bytes(info.get(m, b"{}")))
            for m, expiry in expiries
            if expiry > now
        ]
