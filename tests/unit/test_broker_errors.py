"""How the broker names redis-py's errors: a lost connection must read as "unavailable"."""

from __future__ import annotations

import pytest
import redis

from pspf.broker import Broker
from pspf.broker.connection import local_server_hint
from pspf.errors import BrokerError, BrokerUnavailable
from pspf.settings import RedisSettings, parse_broker_url


def test_a_connection_lost_while_keys_are_watched_is_unavailable_not_a_refusal() -> None:
    """redis-py reports a connection lost during WATCH as a WatchError. A worker reading under its
    leases met one when Redis was stopped and died of it instead of reconnecting."""
    broker = Broker(RedisSettings(url="redis://127.0.0.1:1/0"))
    with pytest.raises(BrokerUnavailable), broker.conn.translate_errors():
        raise redis.WatchError("A ConnectionError occurred while watching one or more keys")
    with pytest.raises(BrokerError) as refused, broker.conn.translate_errors():
        raise redis.ResponseError("ERR unknown command")
    assert not isinstance(refused.value, BrokerUnavailable)


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("redis://127.0.0.1:6379/0", " (to start a local server there: pspf server)"),
        ("redis://localhost:6380", " (to start a local server there: pspf server --port 6380)"),
        ("redis://cache.internal:6379/0", ""),  # another machine: pspf server cannot start it
        ("rediss://127.0.0.1:6379/0", ""),  # pspf server speaks no TLS
        ("redis+cluster://127.0.0.1:7000", ""),
    ],
)
def test_the_local_server_hint_is_for_plain_urls_on_this_machine(url: str, hint: str) -> None:
    assert local_server_hint(parse_broker_url(url)) == hint
