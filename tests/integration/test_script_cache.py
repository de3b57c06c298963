"""Lua calls sent as EVALSHA in pipelines survive a server that lost its script cache.

A restart empties the cache; each pipelined call it refuses with NOSCRIPT is sent again once the
script is loaded, and only those calls, so a chunk of entries is never added twice.
"""

from __future__ import annotations

import pytest
import redis

from pspf import keys
from pspf.broker import AckRequest, Broker
from pspf.settings import RedisSettings
from tests.conftest import Names

pytestmark = pytest.mark.integration


def test_pipelined_scripts_reload_after_a_script_flush_and_run_once(
    redis_url: str, rclient: redis.Redis, names: Names
) -> None:
    topic = names.topic()
    stream = keys.stream_key(topic, 0)
    lease, fence = keys.lease_key(topic, 0, "g"), keys.fence_key(topic, 0, "g")
    broker = Broker(RedisSettings(url=redis_url))
    try:
        rclient.delete(stream, lease, fence)
        value = broker.leases.acquire_lease(lease, fence, "w", 10_000)
        assert value is not None

        rclient.script_flush()
        flat = [4, b"key", b"k", b"value", b"1"] * 3
        assert broker.publishing.add_chunks(topic, "0", {0: (None, flat)}, 60) == {0: 3}
        assert rclient.xlen(stream) == 3

        rclient.script_flush()
        assert broker.leases.renew_leases([(lease, value)], 10_000) == [True]

        broker.apps.ensure_group(stream, "g", "0")
        ids = [
            entry_id for _, entries in rclient.xreadgroup("g", "c", {stream: ">"}) for entry_id, _ in entries
        ]
        rclient.script_flush()
        assert broker.acks.ack([AckRequest(stream, "g", lease, value, ids)]) == [(3, 0)]

        # A read sent ahead that found no script delivered nothing: the caller reads again.
        assert (
            broker.reading.read_ahead("g", "c", [(stream, lease, value)], 10).drop() == {}
        )  # loads the script
        assert broker.publishing.add_chunks(topic, "0", {0: (None, flat)}, 60) == {0: 3}
        rclient.script_flush()
        broker.reading.reader.close()  # a connection made anew watches nothing: read through the script
        assert broker.reading.read_ahead("g", "c", [(stream, lease, value)], 10).take() is None
        assert rclient.xpending(stream, "g")["pending"] == 0
        taken = broker.reading.read_ahead("g", "c", [(stream, lease, value)], 10).take()
        assert taken is not None and [len(entries) for _, entries in taken[1]] == [3]
        assert broker.acks.ack([AckRequest(stream, "g", lease, value, [i for i, _ in taken[1][0][1]])]) == [
            (3, 0)
        ]
        assert rclient.xpending(stream, "g")["pending"] == 0

        rclient.script_flush()
        broker.leases.release_leases([(lease, value)])
        assert not rclient.exists(lease)
    finally:
        rclient.delete(stream, lease, fence)
        broker.close()
