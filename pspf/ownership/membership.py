"""Work sharing: the live workers of an app, and which of its partitions each should own.

The contract:

- Membership: every worker renews its membership with its leases (``pspf.ownership.leases``: a quarter of
  the lease TTL, on a connection of their own) and at each lease round (a third of the TTL),
  with the lease TTL as its time to live, in three keys on the app's hash tag (``keys.members_key``
  and the two beside it). The server's clock decides expiry and join times. A worker that stops
  leaves at once; a dead one expires after the TTL.
- Assignment: a pure function of the counted members (with their join times) and the partition
  count, ``assign``, computed by every worker; no coordinator. It is even (each of M members
  gets floor(P/M) or ceil(P/M)) and deterministic; a join moves exactly the newcomer's share,
  a leave a few more than the leaver's partitions (see ``assign``).
- No flapping: a member counts once it has been a member for ``JOIN_DELAY`` lease rounds, so one
  that joins and leaves at once moves nothing (when no member is that old, as at a cold start,
  all count).
- Acting: a worker acts on its own target only. Between two cycles (everything processed is
  committed and acknowledged) it releases the partitions it should not own, and it takes the ones
  it should own once their leases are free. Leases and fencing are unchanged, so two workers that
  briefly disagree about the members can never both own a partition.
- Global tables: a member says, with its membership, how many entries each global table's
  streams hold past its own read position (``count_global_lag``, every ``GLOBAL_LAG_EVERY_S``):
  the position lives in the worker's own store, so only the worker can say. It goes and expires
  with the membership; ``pspf lag`` shows it per live member.
- Settling: after a change, the partitions that move are released at the old owner's next lease
  round and taken at the new owner's next one: within about two thirds of the lease TTL plus a
  batch, after ``JOIN_DELAY`` for a join. A dead worker's partitions move when its membership
  and leases expire (a worker renews its leases before its membership: they run out first, or
  moments after for one it took since): the others schedule a lease round for that moment
  (``first_expiry_at``), so within the lease TTL of its death.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from pspf.broker import Leasing

if TYPE_CHECKING:
    from pspf.tables.lookups import Lookups

log = logging.getLogger("pspf.membership")

#: Lease rounds (a third of the lease TTL each) a new member waits before it counts.
JOIN_DELAY = 1
#: A lease or membership gone sooner than this share of its TTL after its last renewal did not
#: expire by time: its keys vanished (evicted or deleted). The margin covers clocks that drift.
VANISHED_WITHIN = 0.9
#: How often a member counts the entries its global tables are behind (not per batch: it reads
#: each table's streams from its positions to their ends).
GLOBAL_LAG_EVERY_S = 5.0


class MemberInfo(msgspec.Struct, frozen=True):
    """What a member says of itself."""

    consumer: str
    host: str
    pid: int
    ttl_ms: int
    #: entries each global table's streams hold past this worker's positions, as last counted
    global_lag: dict[str, int] = {}


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """A live worker of an app, as the member list holds it."""

    id: str
    consumer: str
    host: str
    pid: int
    joined_ms: int
    last_heartbeat_ms: int
    #: when its membership runs out unless it renews it (server ms)
    expiry_ms: int
    #: entries each global table's streams hold past its positions (``MemberInfo.global_lag``)
    global_lag: dict[str, int] = {}


_info_encoder = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(MemberInfo)


def _score(consumer: str, partition: int) -> bytes:
    return hashlib.blake2b(f"{consumer}\x00{partition}".encode(), digest_size=8).digest()


def assign(members: list[tuple[str, str]], partitions: int) -> dict[int, str]:
    """Partition -> member id, for members given as (member id, consumer name) in join order.

    The first member owns every partition; each later one, in join order, takes floor(P/k) (k
    members so far) from the most loaded members (the earliest joined first among equals), each
    time the donor's partition that scores best for it. So the spread is even (floor(P/M) or
    ceil(P/M) each), and a member that joins takes exactly its share and moves nothing else. A
    member that leaves changes the order of those after it: more than its own partitions may
    move then (in simulations, about twice as many).
    """
    if not members or partitions <= 0:
        return {}
    owned: dict[str, list[int]] = {members[0][0]: list(range(partitions))}
    rank = {member: i for i, (member, _) in enumerate(members)}
    for k, (member, consumer) in enumerate(members[1:], start=2):
        taken: list[int] = []
        for _ in range(partitions // k):
            donor = max(owned, key=lambda m: (len(owned[m]), -rank[m]))
            best = max(owned[donor], key=lambda p: _score(consumer, p))
            owned[donor].remove(best)
            taken.append(best)
        owned[member] = taken
    return {p: member for member, found in owned.items() for p in found}


class Membership:
    """One worker's membership in its app, and its target partitions."""

    def __init__(self, leasing: Leasing, app: str, member: str, consumer: str, ttl_ms: int) -> None:
        self.leasing = leasing
        self.app = app
        self.member = member
        self.ttl_ms = ttl_ms
        self._about = MemberInfo(consumer, socket.gethostname(), os.getpid(), ttl_ms)
        self._info = _info_encoder.encode(self._about)
        #: when (monotonic) to count the global tables' lag next
        self._count_lag_at = 0.0
        self.members: list[Member] = []
        self._now = 0
        #: the last target, to log changes of it
        self._target: set[int] | None = None
        #: whether the last ``target`` differed from the one before
        self.changed = False
        #: when the last renewal that went through was sent (monotonic); None before the first
        self._renewed_at: float | None = None
        #: when its reply came (monotonic): the server's ``_now`` was at or before it
        self._replied_at = 0.0
        #: the lease keeper's thread renews too: its replies and the lease round's are applied
        #: under this lock, the latest asked last
        self._lock = threading.Lock()
        self._asked = 0.0
        #: earlier runs of this worker already named (``earlier_runs``)
        self._named: set[str] = set()

    def heartbeat(self, leasing: Leasing | None = None) -> list[Member]:
        """Renew this worker's membership (through ``leasing``, else the worker's); the live members.

        A membership gone before its TTL could run out since the last renewal was evicted or
        deleted under the worker: that is an error. One that expired because the worker did not
        renew it in time (a stall, a server refusing writes) is a warning. Either way the worker
        joins again.
        """
        asked = time.monotonic()
        now, present, found = (leasing or self.leasing).member_heartbeat(
            self.app, self.member, self.ttl_ms, self._info
        )
        replied = time.monotonic()
        members = [_member(*row) for row in found]
        with self._lock:
            # Only a call sent after a renewal's reply came: two in flight at once (this thread's
            # and the other's) may be served in the other order, the later sent finding no member.
            if not present and self._renewed_at is not None and asked > self._replied_at:
                self._say_gone(time.monotonic() - self._renewed_at)
            if asked >= self._asked:  # an older reply (the other thread's) changes nothing
                self._asked = self._renewed_at = asked
                self._replied_at, self.members, self._now = replied, members, now
            return self.members

    def _say_gone(self, since: float) -> None:
        if since < self.ttl_ms / 1000 * VANISHED_WITHIN:
            log.error(
                "PSPF keys vanished under the running worker (evicted or deleted): its membership "
                "of app %s was gone %.1fs after its last renewal, before its TTL of %.1fs; joining again",
                self.app,
                since,
                self.ttl_ms / 1000,
            )
        else:
            log.warning(
                "membership of app %s expired (not renewed for %.1fs): joining again", self.app, since
            )

    def earlier_runs(self) -> list[tuple[Member, float]]:
        """Earlier runs of this worker, each named once, with the seconds until they run out.

        They are members with this worker's consumer name but another id: a restart on the same
        host keeps the name, and a worker that stops leaves at once, so such a member is an
        earlier run of this worker that was killed (kill -9).
        """
        with self._lock:
            found = [
                (m, (m.expiry_ms - self._now) / 1000 - (time.monotonic() - self._replied_at))
                for m in self.members
                if m.consumer == self._about.consumer and m.id != self.member and m.id not in self._named
            ]
        self._named.update(m.id for m, _ in found)
        return found

    def count_global_lag(self, lookups: Lookups | None) -> dict[str, int] | None:
        """Count the global tables' lag for the next heartbeats, when due; the counts, else None.

        Counted here, not by ``pspf lag`` from published positions, because the worker's own
        metrics need the figure too; a reader gets it ready with the members.
        """
        tables = None if lookups is None else lookups.global_tables
        if tables is None or time.monotonic() < self._count_lag_at:
            return None
        self._count_lag_at = time.monotonic() + GLOBAL_LAG_EVERY_S
        behind = tables.lag()
        self._about = msgspec.structs.replace(self._about, global_lag=behind)
        self._info = _info_encoder.encode(self._about)
        return behind

    def first_expiry_at(self) -> float | None:
        """When (monotonic) the first other member's membership runs out, as of the last heartbeat.

        A live member renews it well before (every third of its TTL); a dead one leaves then,
        and its partitions move: a worker looks again at that moment, not at its next round.
        Measured from the heartbeat's reply, so never early by the server's clock.
        """
        with self._lock:
            others = [m.expiry_ms for m in self.members if m.id != self.member]
            if not others:
                return None
            return self._replied_at + (min(others) - self._now) / 1000

    def leave(self) -> None:
        self.leasing.member_heartbeat(self.app, self.member, self.ttl_ms, self._info, stay=False)

    def target(self, partitions: int) -> set[int]:
        """The partitions this worker should own now (after a ``heartbeat``)."""
        with self._lock:
            members, old_enough = self.members, self._now - JOIN_DELAY * self.ttl_ms // 3
        counted = [m for m in members if m.joined_ms <= old_enough] or members
        in_order = sorted(counted, key=lambda m: (m.joined_ms, m.id))
        owners = assign([(m.id, m.consumer) for m in in_order], partitions)
        mine = {p for p, member in owners.items() if member == self.member}
        self.changed = mine != self._target
        if self.changed:
            log.info(
                "rebalance app=%s members=%s counted=%s partitions of this worker: %s",
                self.app,
                len(members),
                len(counted),
                sorted(mine),
            )
            self._target = mine
        return mine


def live_members(leasing: Leasing, app: str) -> list[Member]:
    """The live members of an app, read without joining."""
    _, found = leasing.members(app)
    return [_member(*row) for row in found]


def _member(member: str, joined_ms: int, expiry_ms: int, raw: bytes) -> Member:
    try:
        info = _info_decoder.decode(raw)
    except msgspec.ValidationError:
        info = MemberInfo(member.partition("/")[0], "?", 0, 0)
    return Member(
        id=member,
        consumer=info.consumer,
        host=info.host,
        pid=info.pid,
        joined_ms=joined_ms,
        last_heartbeat_ms=expiry_ms - info.ttl_ms,
        expiry_ms=expiry_ms,
        global_lag=info.global_lag,
    )
