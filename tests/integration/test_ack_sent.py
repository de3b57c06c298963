"""Acknowledgements sent and read later, on a connection that keeps the leases and backups watched.

After a first acknowledgement (its checks waited for), the next one for the same partition is
sent at once, checked against what was read after the first. Each test changes a watched key at
the moment a fence could be missed and checks that nothing was applied: the entries stay pending
and the backup stays where it was; the scripts then say what refused it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import redis

from pspf import keys
from pspf.broker import AckRequest, BackupUpdate, Broker
from pspf.broker.acking import BACKUP_LOG_MIN
from pspf.errors import BackupWentBack, LeaseLost
from pspf.settings import RedisSettings
from tests.conftest import Names

pytestmark = pytest.mark.integration

GROUP = "g"
Setup = tuple[Broker, str, str, str, keys.BackupKeys]


@pytest.fixture
def setup(redis_url: str, rclient: redis.Redis, names: Names) -> Iterator[Setup]:
    """A broker holding the lease of partition 0 of a new topic with a group, and the keys it uses."""
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    lease, fence = keys.lease_key(topic, 0, GROUP), keys.fence_key(topic, 0, GROUP)
    backup = keys.backup_keys(topic, 0, GROUP)
    broker = Broker(RedisSettings(url=redis_url))
    value = broker.leases.acquire_lease(lease, fence, "w", 30_000)
    assert value is not None
    broker.apps.ensure_group(stream, GROUP, "0")
    try:
        yield broker, stream, lease, value, backup
    finally:
        broker.close()
        rclient.delete(stream, lease, fence, *backup, *keys.bucket_keys(backup.values, 4))


def delivered(rclient: redis.Redis, stream: str, count: int) -> list[bytes]:
    """``count`` new entries delivered to the group: their ids."""
    for n in range(count):
        rclient.xadd(stream, {"key": "k", "value": str(n)})
    reply = rclient.xreadgroup(GROUP, "c", {stream: ">"})
    return [entry_id for _, entries in reply for entry_id, _ in entries]


def update(backup: keys.BackupKeys, identity: str, follows: tuple[str, ...], total: int) -> BackupUpdate:
    return BackupUpdate(
        backup, identity, {"t": f"0-{total}"}, [b"state\0k", str(total).encode()], [], follows=follows
    )


def first_ack(setup: Setup, rclient: redis.Redis) -> None:
    """The first acknowledgement: its checks waited for; then its connection watches the keys."""
    broker, stream, lease, value, backup = setup
    ids = delivered(rclient, stream, 2)
    request = AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-1", (), 2))
    assert broker.acks.acker.checks((lease, backup.meta, backup.values)) is None
    assert broker.acks.ack_sent([request]).result() == [(2, 0)]
    assert broker.acks.acker.checks((lease, backup.meta, backup.values)) is not None


def test_the_next_acknowledgement_is_sent_without_waiting_and_applies(
    setup: Setup, rclient: redis.Redis
) -> None:
    broker, stream, lease, value, backup = setup
    first_ack(setup, rclient)
    ids = delivered(rclient, stream, 3)
    sent = broker.acks.ack_sent(
        [AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-2", ("1-1",), 5))]
    )
    assert sent.result() == [(3, 0)]
    assert rclient.xpending(stream, GROUP)["pending"] == 0
    assert rclient.hget(backup.meta, "identity") == b"1-2"
    assert rclient.hget(backup.values, b"state\0k") == b"5"
    [(_, fields)] = rclient.xrevrange(backup.log, count=1)
    assert fields[b"prev"] == b"1-1" and fields[b"id"] == b"1-2"


def test_a_lease_taken_after_the_last_acknowledgement_refuses_the_next(
    setup: Setup, rclient: redis.Redis
) -> None:
    broker, stream, lease, value, backup = setup
    first_ack(setup, rclient)
    ids = delivered(rclient, stream, 3)
    rclient.set(lease, "another|2")  # another worker took the partition
    request = AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-2", ("1-1",), 5))
    [refused] = broker.acks.ack_sent([request]).result()
    assert isinstance(refused, LeaseLost)
    assert rclient.xpending(stream, GROUP)["pending"] == 3
    assert rclient.hget(backup.meta, "identity") == b"1-1"
    assert rclient.hget(backup.values, b"state\0k") == b"2"


def test_a_backup_gone_back_after_the_last_acknowledgement_refuses_the_next(
    setup: Setup, rclient: redis.Redis
) -> None:
    broker, stream, lease, value, backup = setup
    first_ack(setup, rclient)
    ids = delivered(rclient, stream, 3)
    rclient.hset(backup.meta, "identity", "1-0")  # a fail-over to a replica that missed the last write
    request = AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-2", ("1-1",), 5))
    [refused] = broker.acks.ack_sent([request]).result()
    assert isinstance(refused, BackupWentBack)
    assert rclient.xpending(stream, GROUP)["pending"] == 3
    assert rclient.hget(backup.values, b"state\0k") == b"2"


def test_a_connection_made_anew_waits_for_its_checks(setup: Setup, rclient: redis.Redis) -> None:
    broker, stream, lease, value, backup = setup
    first_ack(setup, rclient)
    ids = delivered(rclient, stream, 3)
    broker.acks.acker.connection.disconnect()  # redis-py connects again on the next send, with no WATCH
    rclient.set(lease, "another|2")
    request = AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-2", ("1-1",), 5))
    [refused] = broker.acks.ack_sent([request]).result()
    assert isinstance(refused, LeaseLost)
    assert rclient.xpending(stream, GROUP)["pending"] == 3


def test_a_lease_renewed_meanwhile_applies_through_the_scripts(setup: Setup, rclient: redis.Redis) -> None:
    broker, stream, lease, value, backup = setup
    first_ack(setup, rclient)
    ids = delivered(rclient, stream, 3)
    assert broker.leases.renew_leases([(lease, value)], 30_000) == [True]  # as the keeper's thread does
    request = AckRequest(stream, GROUP, lease, value, ids, backup=update(backup, "1-2", ("1-1",), 5))
    assert broker.acks.ack_sent([request]).result() == [(3, 0)]
    assert rclient.xpending(stream, GROUP)["pending"] == 0
    assert rclient.hget(backup.meta, "identity") == b"1-2"


@pytest.mark.parametrize("path", ["sent", "scripted"])
def test_a_small_backup_updated_often_keeps_a_log_of_about_its_own_size(
    setup: Setup, rclient: redis.Redis, path: str
) -> None:
    """20 keys, 300 updates of 10 each: the log keeps the fewest updates it keeps, not all 300."""
    broker, stream, lease, value, backup = setup
    fields = [f"state\0k{i}".encode() for i in range(20)]
    call = broker.acks.ack if path == "sent" else broker.acks.ack_scripted
    follows: tuple[str, ...] = ()
    for n in range(1, 301):
        half = fields[(n % 2) * 10 : (n % 2) * 10 + 10]
        sets = [x for field in half for x in (field, str(n).encode())]
        update = BackupUpdate(backup, f"1-{n}", {"t": f"0-{n}"}, sets, [], follows=follows)
        assert call([AckRequest(stream, GROUP, lease, value, [], backup=update)]) == [(0, 0)]
        follows = (f"1-{n}",)
    assert rclient.hlen(backup.values) == 21  # the 20 keys and the backup's mark
    # MAXLEN ~ trims whole nodes of the stream (up to 100 small entries each)
    assert rclient.xlen(backup.log) <= BACKUP_LOG_MIN + 100
    (last,) = rclient.xrevrange(backup.log, count=1)
    assert last[1][b"id"] == b"1-300"  # every update is still logged


@pytest.mark.parametrize("path", ["sent", "scripted"])
def test_a_backup_in_buckets_gets_the_same_values_by_the_transaction_and_by_the_script(
    setup: Setup, rclient: redis.Redis, path: str
) -> None:
    """An upload laying out 4 buckets, then updates that set and delete: each key's state lands
    in the bucket its CRC-32 names, the bookkeeping in the first, whichever way the call goes."""
    broker, stream, lease, value, backup = setup
    call = broker.acks.ack if path == "sent" else broker.acks.ack_scripted
    names = [f"state\0k{i}".encode() for i in range(40)]
    upload = BackupUpdate(
        backup,
        "1-1",
        {"t": "0-1"},
        [x for n in names for x in (n, b"0")],
        [],
        "replace",
        buckets=4,
        layout="1-1",
    )
    assert broker.acks.ack([AckRequest(stream, GROUP, lease, value, [], backup=upload)]) == [(0, 0)]
    expected = {n: b"0" for n in names}
    for step in range(2, 6):
        sets = [x for n in names[step::3] for x in (n, str(step).encode())]
        sets += [f"__failures\0t/{step}".encode(), b"x" * 100]
        gone = [n for n in names[step + 1 :: 5] if n not in sets]  # a journal sets or deletes a key
        update = BackupUpdate(
            backup, f"1-{step}", {"t": f"0-{step}"}, sets, gone, follows=(f"1-{step - 1}",), buckets=4
        )
        assert call([AckRequest(stream, GROUP, lease, value, [], backup=update)]) == [(0, 0)]
        for name in gone:
            expected.pop(name, None)
        expected.update(zip(sets[::2], sets[1::2], strict=True))
    buckets = keys.bucket_keys(backup.values, 4)
    held = {key: rclient.hgetall(key) for key in buckets}
    assert held[buckets[0]].pop(keys.BACKUP_MARK) == b"1-5"
    for key in buckets[1:]:
        assert held[key].pop(keys.BACKUP_LAYOUT_MARK) == b"1-1"
    for at, key in enumerate(buckets):
        assert held[key] == {
            n: v for n, v in expected.items() if (zlib.crc32(n) % 4 if n.startswith(b"state\0") else 0) == at
        }
    assert rclient.hmget(backup.meta, "buckets", "layout") == [b"4", b"1-1"]


def test_an_upload_lays_out_and_drops_more_buckets_than_a_script_unpacks_at_once(
    setup: Setup, rclient: redis.Redis
) -> None:
    """9,000 buckets (Lua unpacks at most about 8,000 values at once): the upload's script lays
    them all out, and the next upload, into 2, deletes the other 8,998."""
    broker, stream, lease, value, backup = setup
    many = keys.bucket_keys(backup.values, 9_000)
    upload = BackupUpdate(backup, "1-1", {}, [b"state\0k", b"1"], [], "replace", buckets=9_000, layout="1-1")
    try:
        assert broker.acks.ack([AckRequest(stream, GROUP, lease, value, [], backup=upload)]) == [(0, 0)]
        assert rclient.exists(*many) == 9_000
        smaller = upload._replace(buckets=2, layout="1-2", stale=many[1:])
        assert broker.acks.ack([AckRequest(stream, GROUP, lease, value, [], backup=smaller)]) == [(0, 0)]
        assert rclient.exists(*many) == 2
        assert rclient.hget(many[1], keys.BACKUP_LAYOUT_MARK) == b"1-2"
    finally:
        for start in range(0, len(many), 1_000):
            rclient.delete(*many[start : start + 1_000])
