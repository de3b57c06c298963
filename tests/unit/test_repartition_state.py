"""Splitting and merging backed-up state by key into a new partition count."""

from __future__ import annotations

import msgspec
import pytest

from pspf import keys
from pspf.repartition.state import GONE, Gone, new_partitions, split, spread
from pspf.state_stores.base import field


def no_entries(topic: str, entry_id: str) -> bytes | Gone | None:
    raise AssertionError(f"looked up {topic}/{entry_id}")


def stream_time(ms: int) -> bytes:
    return msgspec.msgpack.encode((ms, "orders", b"1-0"))


@pytest.mark.parametrize("count", [3, 8])
def test_each_keyed_namespace_follows_its_key(count: int) -> None:
    expected = (keys.partition_for(b"user:7/x", count),)
    cases = {
        keys.STATE_NAMESPACE: "user:7/x",
        keys.EXPIRY_NAMESPACE: "user:7/x",
        keys.TABLES_NAMESPACE: keys.table_key("customers", "user:7/x"),
        keys.TABLE_HISTORY_NAMESPACE: keys.table_key("customers", "user:7/x"),
        keys.SCHEDULES_NAMESPACE: "remind/user:7/x",
        keys.WINDOWS_NAMESPACE: keys.window_key("orders", "per_minute", "w", "user:7/x", 0, 60000),
    }
    for namespace, key in cases.items():
        assert new_partitions(namespace, key, count, no_entries) == expected, namespace


def test_bookkeeping_follows_the_key_of_the_entry_it_names() -> None:
    found = {("orders", "5-0"): b"alice", ("orders", "6-0"): None, ("orders", "7-0"): GONE}

    def entry_key(topic: str, entry_id: str) -> bytes | Gone | None:
        return found[(topic, entry_id)]

    for namespace in (keys.FAILURES_NAMESPACE, keys.DEAD_NAMESPACE, keys.FOREIGN_NAMESPACE):
        assert new_partitions(namespace, "orders/5-0", 8, entry_key) == (keys.partition_for(b"alice", 8),)
        assert new_partitions(namespace, "orders/6-0", 8, entry_key) == (spread("6-0", 8),)
        assert new_partitions(namespace, "orders/7-0", 8, entry_key) == ()  # trimmed: nothing left to do


def test_timers_reach_every_partition_and_per_partition_records_none() -> None:
    assert new_partitions(keys.TIME_NAMESPACE, keys.TIMER_PREFIX + "hourly", 5, no_entries) == (0, 1, 2, 3, 4)
    for namespace in (keys.CONSUMERS_NAMESPACE, keys.BACKUP_NAMESPACE, keys.OUTBOX_META_NAMESPACE):
        assert new_partitions(namespace, "anything", 5, no_entries) == ()
    with pytest.raises(ValueError, match="no rule moves"):
        new_partitions("__unknown", "k", 5, no_entries)


def test_split_routes_every_value_once_and_the_latest_stream_time_wins() -> None:
    users = [f"u{i}" for i in range(200)]
    old = [
        [
            (field(keys.STATE_NAMESPACE, u), f"{u}-state".encode())
            for u in users
            if keys.partition_for(u.encode(), 2) == p
        ]
        for p in range(2)
    ]
    old[0].append((field(keys.TIME_NAMESPACE, keys.STREAM_TIME), stream_time(5_000)))
    old[1].append((field(keys.TIME_NAMESPACE, keys.STREAM_TIME), stream_time(9_000)))
    new = split(old, 5, no_entries)
    states = {name: value for part in new for name, value in part.items() if not name.startswith(b"__time")}
    assert len(states) == 200 and all(value == name[6:] + b"-state" for name, value in states.items())
    for q, part in enumerate(new):
        for name in part:
            namespace, _, key = name.partition(b"\x00")
            if namespace == keys.STATE_NAMESPACE.encode():
                assert keys.partition_for(key, 5) == q
        # every new partition got keys of both old ones: the later stream time
        assert part[field(keys.TIME_NAMESPACE, keys.STREAM_TIME)] == stream_time(9_000)


def test_a_chains_window_keeps_its_own_stream_time_through_a_split() -> None:
    """A dataflow window's stream time ("stream/NAME") is carried like the partition's, by name."""
    own = field(keys.TIME_NAMESPACE, keys.window_time_key("orders.window-1"))
    other = field(keys.TIME_NAMESPACE, keys.window_time_key("w2"))
    old = [
        [(field(keys.STATE_NAMESPACE, "u1"), b"1"), (own, stream_time(3)), (other, stream_time(50))],
        [(field(keys.STATE_NAMESPACE, "u2"), b"2"), (own, stream_time(8))],
    ]
    new = split(old, 3, no_entries)
    of_u1 = keys.partition_for(b"u1", 3)
    of_u2 = keys.partition_for(b"u2", 3)
    for q, part in enumerate(new):
        expected = {of_u1: stream_time(3), of_u2: stream_time(8)}
        if of_u1 == of_u2:
            expected = {of_u1: stream_time(8)}
        assert part.get(own) == expected.get(q)
        assert part.get(other) == (stream_time(50) if q == of_u1 else None)


def test_a_merge_keeps_the_stream_time_of_the_sources_it_got_state_from() -> None:
    """A source with no state (a quiet partition) still hands its stream time to every new one."""
    key_a = next(f"a{i}" for i in range(1000) if keys.partition_for(f"a{i}".encode(), 2) == 0)
    old = [
        [
            (field(keys.STATE_NAMESPACE, key_a), b"1"),
            (field(keys.TIME_NAMESPACE, keys.STREAM_TIME), stream_time(1)),
        ],
        [(field(keys.TIME_NAMESPACE, keys.STREAM_TIME), stream_time(7))],  # no state: reaches all
    ]
    new = split(old, 2, no_entries)
    assert [part[field(keys.TIME_NAMESPACE, keys.STREAM_TIME)] for part in new] == [stream_time(7)] * 2


def test_every_new_partition_goes_on_above_every_old_outbox_counter() -> None:
    """Targets drop a row whose sequence is not above the last recorded for its (app, partition)."""
    old = [
        [
            (field(keys.OUTBOX_META_NAMESPACE, "next"), b"40/900"),
            (field(keys.OUTBOX_META_NAMESPACE, "sent/t:0"), b"1"),
        ],
        [(field(keys.OUTBOX_META_NAMESPACE, "next"), b"75/310")],
    ]
    new = split(old, 3, no_entries)
    assert [part[field(keys.OUTBOX_META_NAMESPACE, "next")] for part in new] == [b"75/900"] * 3
    assert all(field(keys.OUTBOX_META_NAMESPACE, "sent/t:0") not in part for part in new)
