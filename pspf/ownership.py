"""Partition leases: one owner per partition of a group, with fencing tokens.

A worker owns partition ``p`` of its app when it holds the lease of ``p`` on every topic the app
reads (one store per (app, p) holds the state of all those topics). A lease has a time to live,
is renewed while the worker runs and released when it stops; its value carries a fencing token
that the acknowledging Lua call checks, so an ex-owner can no longer acknowledge.
"""

from __future__ import annotations

import logging

from pspf import keys
from pspf.broker import Broker

log = logging.getLogger(__name__)

#: topic -> lease value held for one partition
Leases = dict[str, str]


class PartitionLeases:
    """Acquires, renews and releases the leases of one group's partitions."""

    def __init__(self, broker: Broker, group: str, topics: list[str], owner: str, ttl_ms: int) -> None:
        self.broker = broker
        self.group = group
        self.topics = topics
        self.owner = owner
        self.ttl_ms = ttl_ms

    def acquire(self, partition: int) -> Leases | None:
        """Take the partition's lease on every topic, or none of them."""
        held: Leases = {}
        for topic in self.topics:
            value = self.broker.acquire_lease(
                keys.lease_key(topic, partition, self.group),
                keys.fence_key(topic, partition, self.group),
                self.owner,
                self.ttl_ms,
            )
            if value is None:
                self.release(partition, held)
                return None
            held[topic] = value
        return held

    def takeable(self, partitions: list[int]) -> list[int]:
        """Those of ``partitions`` whose leases are free, or ours without our knowing it.

        A lease call that timed out on our side may still have been applied by the server (after
        a stall): such a lease carries our owner id but we do not hold it, and nobody would work
        the partition until it expires. It is released here, so it can be taken again now.
        """
        pairs = [(p, keys.lease_key(topic, p, self.group)) for p in partitions for topic in self.topics]
        values = self.broker.lease_values([key for _, key in pairs])
        orphans: list[tuple[str, str]] = []
        busy: set[int] = set()
        for (partition, key), value in zip(pairs, values, strict=True):
            if value is not None and value.rpartition("|")[0] == self.owner:
                orphans.append((key, value))
            elif value is not None:
                busy.add(partition)
        if orphans:
            log.warning("releasing leases of ours that a timed-out call took: %s", [k for k, _ in orphans])
            self.broker.release_leases(orphans)
        return [p for p in partitions if p not in busy]

    def renew(self, held: dict[int, Leases]) -> list[int]:
        """Extend every held lease; the partitions whose lease was lost."""
        pairs = [
            (partition, keys.lease_key(topic, partition, self.group), value)
            for partition, leases in held.items()
            for topic, value in leases.items()
        ]
        renewed = self.broker.renew_leases([(key, value) for _, key, value in pairs], self.ttl_ms)
        lost = sorted({partition for (partition, _, _), ok in zip(pairs, renewed, strict=True) if not ok})
        for partition in lost:
            log.warning("lease expired or taken over group=%s partition=%s", self.group, partition)
        return lost

    def release(self, partition: int, leases: Leases) -> None:
        if leases:
            self.broker.release_leases(
                [(keys.lease_key(topic, partition, self.group), value) for topic, value in leases.items()]
            )
