"""What the Producer refuses before it reaches Redis: text that cannot be stored as UTF-8."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pspf import Producer, Settings
from pspf.broker import Broker
from pspf.errors import ConfigError


@pytest.fixture
def producer() -> Iterator[Producer]:
    """A producer whose broker is unreachable: any Redis call would fail with BrokerUnavailable."""
    broker = Broker(Settings.load({"PSPF_BROKER": "redis://127.0.0.1:1/0"}, environ={}).redis)
    with Producer(broker) as producer:
        yield producer
    broker.close()


@pytest.mark.parametrize(
    ("topic", "value", "key", "headers", "message"),
    [
        # "\udcff" is how Python keeps the byte 0xff of a non-UTF-8 command line or file name.
        ("orders", {"a": 1}, "\udcff", None, r"key '\\udcff' is not valid UTF-8"),
        ("orders", {"a": 1}, "u\ud800", None, r"key 'u\\ud800' is not valid UTF-8"),
        ("orders", {"a": "\udcff"}, "u1", None, "cannot encode value as JSON"),
        ("orders", {"a": 1}, "u1", {"trace": "\udcff"}, r"header 'trace' value '\\udcff' is not valid UTF-8"),
        ("orders", {"a": 1}, "u1", {"\udcff": "x"}, r"header name '\\udcff' is not valid UTF-8"),
        ("orders", {"a": 1}, "u1", {"attempt": 2}, "header 'attempt' value must be a string, not int"),
        ("t\udcff", {"a": 1}, "u1", None, "invalid topic name"),
    ],
)
def test_text_that_is_not_utf8_is_a_config_error_before_any_io(
    producer: Producer, topic: str, value: Any, key: str, headers: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        producer.send(topic, value, key=key, headers=headers)
    assert producer.sent == 0
