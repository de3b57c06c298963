"""What every read and write of ``format("pspf")`` takes: where the broker is, and a connection to it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pspf.broker import Broker
from pspf.settings import RedisSettings, check_broker_url

#: The options every read and write takes: where the broker is.
CONNECTION_OPTIONS = frozenset({"broker"})
#: Options Spark itself passes (``load(path)``, ``save(path)``, a stream's checkpoint).
SPARK_OPTIONS = frozenset({"path", "checkpointlocation"})


def broker_url(options: dict[str, str]) -> str:
    """The broker URL of the ``broker`` option (any topology; TLS files as URL options), checked."""
    url = options.get("broker", RedisSettings().url)
    check_broker_url(url)
    return url


@contextmanager
def connected(url: str) -> Iterator[Broker]:
    """A broker of ``url`` for the duration of a block (on the driver or in a task)."""
    broker = Broker(RedisSettings(url=url))
    try:
        yield broker
    finally:
        broker.close()
