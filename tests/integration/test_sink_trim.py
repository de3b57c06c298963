"""The sink's trimming (``Publishing.add_chunks`` with ``maxlen``/``minid``) stops at the groups' floor.

The floor of a stream is the lowest, over its consumer groups, of each group's oldest pending id,
or its last-delivered-id when nothing is pending. These call the Lua script directly, without
Spark, so they also run in CI's pass against Redis 6.2 (``PSPF_TEST_REDIS_SERVER``), whose XINFO
GROUPS reply has fewer fields. ``tests/spark/test_sink_trim.py`` covers the same through Spark.
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

#: a few more than asked may stay: approximate trimming removes whole nodes (100 entries each)
NODE = 100


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    broker = Broker(RedisSettings(url=redis_url))
    yield broker
    broker.close()


def seed(client: redis.Redis, stream: str, count: int) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        pipe.xadd(stream, {"value": str(i)})
    return [bytes(entry_id) for entry_id in pipe.execute()]


def consume(client: redis.Redis, stream: str, group: str, read: int, acked: int) -> None:
    """``group`` reads the first ``read`` entries and acknowledges the first ``acked`` of them."""
    client.xgroup_create(stream, group, id="0")
    if read:
        reply = client.xreadgroup(group, "c1", {stream: ">"}, count=read)
        ids = [entry_id for _, entries in reply for entry_id, _ in entries]
        assert len(ids) == read
        if acked:
            assert client.xack(stream, group, *ids[:acked]) == acked


def add(broker: Broker, topic: str, count: int, maxlen: str = "", minid: str = "") -> None:
    """Add ``count`` entries to partition 0 of ``topic`` as the sink does."""
    flat = [2, "value", "new"] * count
    assert broker.publishing.add_chunks(topic, "0", {0: (None, flat)}, 60, maxlen, minid) == {0: count}


def ids_of(client: redis.Redis, stream: str) -> list[bytes]:
    return [bytes(entry_id) for entry_id, _ in client.xrange(stream)]


def from_floor(ids: list[bytes], floor: bytes) -> list[bytes]:
    """The ids at or above ``floor``, compared as stream ids (``b"1-10" > b"1-9"``)."""
    low = keys.StreamId.parse(floor)
    return [i for i in ids if keys.StreamId.parse(i) >= low]


def test_a_group_with_nothing_pending_keeps_what_it_has_not_read(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    ids = seed(rclient, stream, 3_000)
    consume(rclient, stream, names.app(), read=500, acked=500)  # floor: its last-delivered id
    consume(rclient, stream, names.app(), read=2_000, acked=1_000)  # oldest pending is higher

    add(broker, topic, 10, maxlen="10")

    kept = ids_of(rclient, stream)
    assert from_floor(kept, ids[499])[:-10] == ids[499:]
    assert len(kept) - 10 - len(ids[499:]) < NODE  # what both acknowledged went


def test_a_group_that_never_read_keeps_everything(broker: Broker, rclient: redis.Redis, names: Names) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    ids = seed(rclient, stream, 1_000)
    consume(rclient, stream, names.app(), read=0, acked=0)

    add(broker, topic, 10, maxlen="0")
    add(broker, topic, 10, minid="99999999999999-0")

    assert ids_of(rclient, stream)[:-20] == ids


def test_a_minid_below_the_floor_trims_to_the_minid(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    ids = seed(rclient, stream, 3_000)
    consume(rclient, stream, names.app(), read=3_000, acked=3_000)

    add(broker, topic, 10, minid=ids[1_500].decode())

    kept = ids_of(rclient, stream)
    assert kept[-1_510:-10] == ids[1_500:]
    assert 1_510 <= len(kept) < 1_510 + NODE


def test_a_maxlen_above_the_floor_trims_to_about_maxlen(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    seed(rclient, stream, 3_000)
    consume(rclient, stream, names.app(), read=3_000, acked=3_000)

    add(broker, topic, 10, maxlen="500")

    assert 500 <= rclient.xlen(stream) < 500 + NODE


def test_a_stream_that_grew_while_an_app_lagged_shrinks_back_once_it_caught_up(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    group = names.app()
    rclient.xadd(stream, {"value": "first"})
    consume(rclient, stream, group, read=0, acked=0)
    for _ in range(6):
        add(broker, topic, 2_000, maxlen="100")
    assert rclient.xlen(stream) == 12_001  # the app has read none of it

    def catch_up() -> None:
        everything = rclient.xreadgroup(group, "c1", {stream: ">"})
        rclient.xack(stream, group, *[entry_id for _, entries in everything for entry_id, _ in entries])

    catch_up()
    for _ in range(6):  # each call looks at a bounded number of entries: a few calls catch up
        add(broker, topic, 10, maxlen="100")
        catch_up()

    assert 100 <= rclient.xlen(stream) < 100 + NODE


def test_ids_beyond_what_a_lua_number_holds_compare_exactly(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    """2**53 + 1 and 2**53 are the same Lua number: compared as numbers, the floor would lose."""
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    big = 2**53
    ids = [rclient.xadd(stream, {"value": str(seq)}, id=f"{big}-{seq}") for seq in range(1, 301)]
    group = names.app()
    rclient.xgroup_create(stream, group, id=f"{big}-150")  # has read up to seq 150

    add(broker, topic, 1, minid=f"{big + 1}-0")

    kept = ids_of(rclient, stream)
    assert from_floor(kept, ids[149]) == [*ids[149:], f"{big}-301".encode()]  # the entry it added
