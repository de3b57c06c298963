"""Keeping a worker's leases and membership alive, and saying what became of them.

Renewals never wait behind data calls. A read or an acknowledgement caught by a network cut
waits for TCP to retransmit it, up to its socket timeout, which may be longer than the lease
TTL; a renewal queued behind it in the same loop would let the leases of a host that was cut
off for a second run out. So ``LeaseKeeper`` renews the held leases, then the membership, in a
thread of its own on a connection of its own: every quarter of the TTL, each call with a
deadline of a tenth of it, and after a failed call again at once on a new connection. Its first
renewal after a cut goes through as soon as the link is back: a cut shorter than about two
thirds of the TTL moves nothing.

The keeper renews only while the worker's loop comes round (``beat``): a loop stuck past
``stall_s`` (a handler that never returns) is no longer renewed, and its partitions move as a
dead worker's do. Fencing does not rest on the keeper: every acknowledging call checks the
lease's token, so a worker whose renewals failed past the TTL acknowledges nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import msgspec

from pspf.broker import Connection, Leasing
from pspf.errors import BrokerError, BrokerOutOfMemory, BrokerUnavailable
from pspf.keys import lease_key
from pspf.ownership.membership import VANISHED_WITHIN, Membership
from pspf.ownership.owning import Leases, PartitionLeases
from pspf.settings import RedisSettings

log = logging.getLogger("pspf.leases")

#: The keeper renews every this share of the lease TTL ...
RENEW_EVERY = 0.25
#: ... and gives each call this share of it (then tries again on a new connection).
DEADLINE = 0.1


class Lost(NamedTuple):
    """A held partition whose lease a renewal found gone."""

    partition: int
    leases: Leases
    #: seconds since the last renewal of it that went through (or its acquisition)
    unrenewed_s: float
    #: whether renewals failed for want of Redis meanwhile (a cut, a server down)
    unreachable: bool
    ttl_s: float

    @property
    def why(self) -> str:
        """How it was lost, for ``say_gone``."""
        cause = "while Redis was unreachable" if self.unreachable else "(the worker did not renew it in time)"
        return f"expired {cause}: not renewed for {self.unrenewed_s:.1f}s, TTL {self.ttl_s:.1f}s"


class LeaseKeeper:
    """Renews one worker's leases and membership in a thread of its own (see the module docstring)."""

    def __init__(
        self,
        redis: RedisSettings,
        leases: PartitionLeases,
        membership: Membership,
        stall_s: float,
    ) -> None:
        self.ttl_s = leases.ttl_ms / 1000
        self.deadline_s = self.ttl_s * DEADLINE
        timeout = min(redis.connect_timeout_s, self.deadline_s)
        #: a connection of its own, for the lease calls only
        self.conn = Connection(msgspec.structs.replace(redis, connect_timeout_s=timeout), self.deadline_s)
        self.leasing = Leasing(self.conn)
        self.leases = PartitionLeases(self.leasing, leases.group, leases.topics, leases.owner, leases.ttl_ms)
        self.membership = membership
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._renewing = threading.Lock()
        self._held: dict[int, Leases] = {}
        #: partition -> when (monotonic) its last renewal that went through was sent
        self._confirmed: dict[int, float] = {}
        self._lost: list[Lost] = []
        self._alive_until = 0.0
        #: when renewals started to fail (monotonic); None while they go through
        self._failing_since: float | None = None
        self._stalled = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the worker's side ----------------------------------------------------------------------

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="pspf-leases", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop renewing (the worker releases its leases or lets them run out), then disconnect."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.deadline_s * 4 + 1)
        self.conn.close()

    def beat(self, away_s: float = 0.0) -> None:
        """The worker's loop came round: renew for ``stall_s`` more (plus ``away_s``, a known wait)."""
        self._alive_until = max(self._alive_until, time.monotonic() + self.stall_s + away_s)

    def hold(self, partition: int, leases: Leases, asked: float) -> None:
        """Renew ``leases`` too from now on (``asked``: when their acquisition was sent)."""
        with self._lock:
            self._held[partition] = leases
            self._confirmed[partition] = asked

    def forget(self, partition: int) -> None:
        with self._lock:
            self._held.pop(partition, None)
            self._confirmed.pop(partition, None)

    def confirmed_at(self, partition: int) -> float | None:
        """When the last renewal of a held partition's lease that went through was sent."""
        with self._lock:
            return self._confirmed.get(partition)

    def vanished(self, held: dict[int, Leases], look: bool = False) -> list[int]:
        """The partitions of ``held`` renewed (or taken) less than ``VANISHED_WITHIN`` of the TTL ago.

        Their leases did not expire: their keys vanished. With ``look`` only those whose leases
        are not ours any more now (an acknowledgement refused for another reason, a backup that
        went back, leaves the lease in place); none when they cannot be read.
        """
        now = time.monotonic()
        with self._lock:
            recent = [
                p
                for p in held
                if now - self._confirmed.get(p, now - self.ttl_s) < self.ttl_s * VANISHED_WITHIN
            ]
        if not look or not recent:
            return recent
        pairs = [
            (p, lease_key(topic, p, self.leases.group), v) for p in recent for topic, v in held[p].items()
        ]
        try:
            values = self.leasing.lease_values([key for _, key, _ in pairs])
        except BrokerUnavailable:
            return []  # cannot tell now: the renewals find them lost (or not) soon
        return sorted({p for (p, _, v), now_v in zip(pairs, values, strict=True) if now_v != v})

    def take_lost(self) -> list[Lost]:
        """The partitions found lost since the last call (the keeper renews them no more)."""
        with self._lock:
            found, self._lost = self._lost, []
        return found

    def lost(self, partition: int, leases: Leases) -> bool:
        """Whether a renewal found these leases of ``partition`` gone (not yet taken)."""
        with self._lock:
            return any(x.partition == partition and x.leases == leases for x in self._lost)

    # -- the keeper's thread --------------------------------------------------------------------

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            due = self._round()

    def _round(self) -> float:
        """One renewal, if the worker's loop is alive; when (monotonic) the next is due."""
        now = time.monotonic()
        if now > self._alive_until:
            if not self._stalled:
                self._stalled = True
                log.warning(
                    "the worker's loop has not come round for %.1fs: its leases and membership are "
                    "no longer renewed, its partitions move when they run out (the TTL of %.1fs)",
                    now - self._alive_until + self.stall_s,
                    self.ttl_s,
                )
            return now + self.deadline_s
        self._stalled = False
        try:
            self.renew()
        except BrokerOutOfMemory:
            # The leases are renewed (a renewal adds nothing); the membership's write is refused
            # until memory is freed, as the worker's loop says once for the whole episode.
            return now + self.ttl_s * RENEW_EVERY
        except BrokerError as exc:
            if self._failing_since is None:
                self._failing_since = now
                log.warning("renewing the leases failed, trying again at once: %s", exc)
            return time.monotonic() + self.deadline_s / 2
        if self._failing_since is not None:
            log.info("lease renewals go through again after %.1fs", now - self._failing_since)
            self._failing_since = None
        return now + self.ttl_s * RENEW_EVERY

    def renew(self) -> list[int]:
        """Renew the held leases, then the membership; the partitions found lost (kept for ``take_lost``).

        The leases first: a dead worker's leases run out no later than its membership (same TTL),
        so its partitions are free when the others see it gone.
        """
        with self._renewing:
            asked = time.monotonic()
            with self._lock:
                held = dict(self._held)
            lost = self.leases.renew(held) if held else []
            with self._lock:
                for partition, leases in held.items():
                    if self._held.get(partition) != leases:
                        continue  # given up or taken again meanwhile
                    if partition in lost:  # its last renewal stays known: ``vanished`` asks it
                        since = time.monotonic() - self._confirmed.get(partition, asked)
                        del self._held[partition]
                        unreachable = self._failing_since is not None
                        self._lost.append(Lost(partition, leases, since, unreachable, self.ttl_s))
                    else:
                        self._confirmed[partition] = asked
            self.membership.heartbeat(self.leasing)
            return lost


def say_gone(leases: PartitionLeases, partition: int, why: str) -> None:
    """Say that a held partition's lease is gone (``why``), and who holds the partition now."""
    try:
        holders = sorted(leases.holders(partition))
    except BrokerUnavailable:
        now = "who holds it now is unknown (Redis unreachable)"
    else:
        now = (
            f"partition {partition} is now held by {', '.join(holders)}"
            if holders
            else f"partition {partition} is free: this worker takes it again when it should own it"
        )
    log.warning("the lease of partition %s %s; %s", partition, why, now)


def say_waiting(membership: Membership, leases: PartitionLeases, partitions: int) -> None:
    """Say once (INFO) which partitions an earlier run of this worker holds, and until when.

    A worker killed (kill -9) leaves its membership and leases to run out; restarted with the
    same consumer name, it waits for them up to the lease TTL, which would look like a hang.
    """
    for member, left_s in membership.earlier_runs():
        held = leases.held_by(member.id, partitions)
        if not held:
            continue
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + max(0.0, left_s)))
        log.info(
            "waiting for partitions %s: an earlier run of consumer %s (%s, pid %s) holds them and did "
            "not stop cleanly; they are free when its membership and leases run out, until about %s "
            "(in %.1fs)",
            held,
            member.consumer,
            member.host,
            member.pid,
            until,
            max(0.0, left_s),
        )
