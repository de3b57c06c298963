"""How the broker names redis-py's errors: a lost connection must read as "unavailable"."""

from __future__ import annotations

import pytest
import redis

from pspf.broker import Broker
from pspf.errors import BrokerError, BrokerUnavailable
from pspf.settings import RedisSettings


def test_a_connection_lost_while_keys_are_watched_is_unavailable_not_a_refusal() -> None:
    """redis-py reports a connection lost during WATCH as a WatchError. A worker reading under its
    leases met one when Redis was stopped and died of it instead of reconnecting."""
    broker = Broker(RedisSettings(url="redis://127.0.0.1:1/0"))
    with pytest.raises(BrokerUnavailable), broker.translate_errors():
        raise redis.WatchError("A ConnectionError occurred while watching one or more keys")
    with pytest.raises(BrokerError) as refused, broker.translate_errors():
        raise redis.ResponseError("ERR unknown command")
    assert not isinstance(refused.value, BrokerUnavailable)
