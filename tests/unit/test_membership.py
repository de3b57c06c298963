"""The assignment of partitions to members: even, deterministic, and a join moves only its share."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pspf.broker import Broker
from pspf.ownership import membership
from pspf.ownership.membership import Membership, assign
from pspf.settings import Settings
from pspf.tables.lookups import Lookups


def _members(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"host{rng.randrange(10**6)}/{rng.randrange(10**5)}/{i:08x}", f"host{i}") for i in range(n)]


@pytest.mark.parametrize("partitions", [1, 2, 3, 6, 8, 16, 33])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 40])
def test_every_partition_has_one_owner_and_the_spread_is_even(partitions: int, count: int) -> None:
    members = _members(count, seed=partitions * 100 + count)
    owners = assign(members, partitions)
    assert sorted(owners) == list(range(partitions))
    loads = Counter(owners.values())
    shares = [loads.get(member, 0) for member, _ in members]
    assert max(shares) - min(shares) <= 1
    assert min(shares) == partitions // count


def test_the_same_members_give_the_same_assignment_everywhere() -> None:
    members = _members(5, seed=1)
    assert assign(members, 12) == assign(list(members), 12)
    assert assign([], 12) == {} and assign(members, 0) == {}


@pytest.mark.parametrize("seed", range(30))
def test_a_join_moves_exactly_the_newcomers_share_and_nothing_else(seed: int) -> None:
    rng = random.Random(seed)
    partitions, count = rng.randrange(1, 40), rng.randrange(1, 8)
    members = _members(count + 1, seed)
    before, after = assign(members[:-1], partitions), assign(members, partitions)
    newcomer = members[-1][0]
    moved = {p for p in range(partitions) if before[p] != after[p]}
    assert moved == {p for p, owner in after.items() if owner == newcomer}
    assert len(moved) == partitions // (count + 1)


@pytest.mark.parametrize("seed", range(30))
def test_a_leave_moves_the_leavers_partitions_and_a_bounded_few_more(seed: int) -> None:
    rng = random.Random(seed)
    partitions, count = rng.randrange(2, 40), rng.randrange(2, 8)
    members = _members(count, seed)
    leaver = rng.randrange(count)
    before = assign(members, partitions)
    after = assign(members[:leaver] + members[leaver + 1 :], partitions)
    theirs = {p for p, owner in before.items() if owner == members[leaver][0]}
    moved = {p for p in range(partitions) if before[p] != after[p]}
    assert theirs <= moved
    # The newest member leaving moves only its own; any other a few more (members after it in
    # the join order take their share again).
    if leaver == count - 1:
        assert moved == theirs
    assert len(moved) <= 3 * len(theirs) + count


class CountingTables:
    """Stands in for ``GlobalTables``: each count says how many were made."""

    def __init__(self) -> None:
        self.counts = 0

    def lag(self) -> dict[str, int]:
        self.counts += 1
        return {"products": self.counts}


class Clock:
    """``membership``'s view of ``time``: monotonic seconds set by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_global_tables_lag_is_counted_every_few_seconds_not_at_every_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(membership, "time", clock)
    broker = Broker(Settings.load({}, environ={}).redis)  # never connects: nothing is sent here
    member = Membership(broker.leases, "app", "host/1/ab", "host", 3000)
    tables = CountingTables()
    lookups = Lookups({}, 1, tables)  # type: ignore[arg-type]
    assert member.count_global_lag(None) is None and member.count_global_lag(Lookups({}, 1)) is None
    assert member.count_global_lag(lookups) == {"products": 1}
    clock.now += membership.GLOBAL_LAG_EVERY_S - 0.1
    assert member.count_global_lag(lookups) is None and tables.counts == 1  # not due yet
    clock.now += 0.1
    assert member.count_global_lag(lookups) == {"products": 2}
