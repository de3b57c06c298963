"""Reads sent ahead under watched leases: plain MULTI/EXEC reads that deliver nothing once a lease moved.

After a first read (through the script), the reader's connection keeps the leases WATCHed, so the
next read is a bare XREADGROUP in MULTI/EXEC. Each test moves a lease at the moment a fence could be
missed and checks that nothing was delivered to this consumer (nothing pending under it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from pspf import keys
from pspf.broker import Broker
from pspf.settings import RedisSettings
from tests.conftest import Names

pytestmark = pytest.mark.integration

GROUP, CONSUMER = "g", "c"


@pytest.fixture
def setup(
    redis_url: str, rclient: redis.Redis, names: Names
) -> Iterator[tuple[Broker, tuple[str, str, str]]]:
    """A broker holding the lease of partition 0 of a new topic with a group, and what it reads."""
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    lease, fence = keys.lease_key(topic, 0, GROUP), keys.fence_key(topic, 0, GROUP)
    broker = Broker(RedisSettings(url=redis_url))
    value = broker.leases.acquire_lease(lease, fence, "w", 30_000)
    assert value is not None
    broker.apps.ensure_group(stream, GROUP, "0")
    try:
        yield broker, (stream, lease, value)
    finally:
        broker.close()
        rclient.delete(stream, lease, fence)


def add(rclient: redis.Redis, stream: str, count: int) -> None:
    for n in range(count):
        rclient.xadd(stream, {"key": "k", "value": str(n)})


def pending(rclient: redis.Redis, stream: str) -> int:
    return int(rclient.xpending(stream, GROUP)["pending"])


def armed_read(broker: Broker, read: tuple[str, str, str], rclient: redis.Redis) -> None:
    """A first read through the script, taken: the connection now watches the lease."""
    add(rclient, read[0], 2)
    first = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert not first.armed
    taken = first.take()
    assert taken is not None and [len(e) for _, e in taken[1]] == [2]
    rclient.xack(read[0], GROUP, *[i for i, _ in taken[1][0][1]])


def test_a_read_after_the_first_is_a_plain_transaction_and_delivers(
    setup: tuple[Broker, tuple[str, str, str]], rclient: redis.Redis
) -> None:
    broker, read = setup
    armed_read(broker, read, rclient)
    add(rclient, read[0], 3)
    second = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert second.armed
    taken = second.take()
    assert taken is not None
    lost, entries, _ = taken
    assert lost == [] and [len(e) for _, e in entries] == [3]
    assert pending(rclient, read[0]) == 3


def test_a_lease_taken_after_the_watch_makes_the_read_deliver_nothing(
    setup: tuple[Broker, tuple[str, str, str]], rclient: redis.Redis
) -> None:
    broker, read = setup
    stream, lease, _ = read
    armed_read(broker, read, rclient)
    add(rclient, stream, 3)
    rclient.set(lease, "another|2")  # another worker took the partition
    ahead = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert ahead.armed  # the lease was this worker's when it was watched
    assert ahead.take() is None
    assert pending(rclient, stream) == 0
    # The next read knows the lease moved: through the script, which says it is lost.
    again = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert not again.armed
    assert again.take() == ([stream], [], {})
    assert pending(rclient, stream) == 0


def test_a_connection_made_anew_watches_nothing_so_its_read_goes_through_the_script(
    setup: tuple[Broker, tuple[str, str, str]], rclient: redis.Redis
) -> None:
    broker, read = setup
    stream, lease, _ = read
    armed_read(broker, read, rclient)
    add(rclient, stream, 3)
    broker.reading.reader.connection.disconnect()  # redis-py connects again on the next send, with no WATCH
    rclient.set(lease, "another|2")
    ahead = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert not ahead.armed
    assert ahead.take() == ([stream], [], {})
    assert pending(rclient, stream) == 0


def test_a_lease_renewed_meanwhile_delivers_nothing_once_then_the_reads_go_on(
    setup: tuple[Broker, tuple[str, str, str]], rclient: redis.Redis
) -> None:
    broker, read = setup
    stream, lease, value = read
    armed_read(broker, read, rclient)
    add(rclient, stream, 3)
    assert broker.leases.renew_leases([(lease, value)], 30_000) == [True]  # as the keeper's thread does
    assert broker.reading.read_ahead(GROUP, CONSUMER, [read], 10).take() is None
    assert pending(rclient, stream) == 0
    ahead = broker.reading.read_ahead(GROUP, CONSUMER, [read], 10)
    assert ahead.armed
    taken = ahead.take()
    assert taken is not None and [len(e) for _, e in taken[1]] == [3]


def test_other_streams_or_leases_are_read_through_the_script(
    setup: tuple[Broker, tuple[str, str, str]], rclient: redis.Redis, names: Names
) -> None:
    broker, read = setup
    armed_read(broker, read, rclient)
    topic = names.topic()
    other = (keys.stream_key(topic, 0), keys.lease_key(topic, 0, GROUP), "")
    value = broker.leases.acquire_lease(other[1], keys.fence_key(topic, 0, GROUP), "w", 30_000)
    assert value is not None
    other = (other[0], other[1], value)
    broker.apps.ensure_group(other[0], GROUP, "0")
    try:
        add(rclient, other[0], 2)
        both = broker.reading.read_ahead(GROUP, CONSUMER, [read, other], 10)
        assert not both.armed  # only the first stream's lease was watched
        taken = both.take()
        assert taken is not None and [len(e) for _, e in taken[1]] == [2]
        add(rclient, read[0], 1)
        again = broker.reading.read_ahead(GROUP, CONSUMER, [read, other], 10)
        assert again.armed
        taken = again.take()
        assert taken is not None and [(s.decode(), len(e)) for s, e in taken[1]] == [(read[0], 1)]
    finally:
        broker.reading.reader.close()
        rclient.delete(other[0], other[1], keys.fence_key(topic, 0, GROUP))
