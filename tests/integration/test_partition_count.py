"""The one answer to "how many partitions does topic T have now", as writers and workers ask it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from pspf import Settings
from pspf.broker import Broker, partition_count
from pspf.errors import BrokerError, ConfigError, NotFound, StateError
from pspf.keys import topic_key
from tests.conftest import Names

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(make_settings: Callable[..., Settings]) -> Iterator[Broker]:
    b = Broker(make_settings().redis)
    yield b
    b.close()


def test_the_count_and_layout_of_a_topic_or_not_found(
    make_topic: Callable[[int], str], broker: Broker, names: Names
) -> None:
    topic = make_topic(4)
    assert partition_count(broker.topics, topic) == (4, "0")
    assert partition_count(broker.topics, topic).partitions == 4
    with pytest.raises(NotFound, match="does not exist; create it"):
        partition_count(broker.topics, names.topic())


def test_a_running_repartition_refuses_at_once_or_after_the_wait(
    make_topic: Callable[[int], str], broker: Broker, rclient: redis.Redis
) -> None:
    """An app starting: ConfigError at once; a writer: BrokerError after its wait."""
    topic = make_topic(4)
    rclient.hset(topic_key(topic), "moving", "1")
    with pytest.raises(ConfigError, match=f"topic {topic!r} is being repartitioned: start the app once"):
        partition_count(broker.topics, topic, app="an-app")
    started = time.monotonic()
    with pytest.raises(BrokerError, match=r"not done within 0\.3s; try later$"):
        partition_count(broker.topics, topic, wait_s=0.3, hint="try later")
    assert time.monotonic() - started >= 0.3
    rclient.hdel(topic_key(topic), "moving")
    rclient.hset(topic_key(topic), "layout", "2")
    assert partition_count(broker.topics, topic, wait_s=0.3, hint="h") == (4, "2")
    with pytest.raises(BrokerError, match="its partitions refuse layout '2'"):
        partition_count(broker.topics, topic, wait_s=0.2, hint="h", stale="2")


def test_a_writer_is_refused_a_count_its_readers_were_not_built_for(
    make_topic: Callable[[int], str],
    broker: Broker,
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The record edited behind PSPF's back: a writer refuses; the app itself checks its own record."""
    topic, app = make_topic(4), names.app()
    broker.apps.register_app(app, [topic], 4)
    assert partition_count(broker.topics, topic, wait_s=0.1, hint="h") == (4, "0")
    rclient.hset(topic_key(topic), "partitions", "8")
    with pytest.raises(StateError, match=f"app {app!r} was built for 4 partitions"):
        partition_count(broker.topics, topic, wait_s=0.1, hint="h")
    assert partition_count(broker.topics, topic, app=app) == (8, "0")
