"""A worker's cache of committed values is one budget shared by the partitions it owns.

Each partition keeps at most its share, so a worker's memory stays bounded however many
partitions it owns; the values past a share are read from the store again, and the state is
the same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from pspf import Settings
from pspf.cycle import processor
from pspf.keys import stream_key
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, read_state, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def drained(rclient: redis.Redis, topic: str, app: str) -> bool:
    """Every partition's entries delivered to the app and acknowledged."""
    for p in range(4):
        stream = stream_key(topic, p)
        groups = {g["name"].decode(): g for g in rclient.xinfo_groups(stream)}
        group = groups.get(app)
        last = rclient.xinfo_stream(stream)["last-generated-id"]
        if group is None or group["pending"] or group["last-delivered-id"] != last:
            return False
    return True


def test_four_partitions_share_the_budget_and_the_state_is_exact(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processor, "CACHE_LIMIT", 400)
    monkeypatch.setattr(processor, "MIN_CACHE_SHARE", 10)
    topic, app = make_topic(4), names.app()
    records = [(f"k{n % 300}", {"n": n}) for n in range(3_000)]
    produce(topic, records)
    settings = make_settings()
    with WorkerThread(summing_app(app, topic), settings) as runner:
        wait_until(lambda: drained(rclient, topic, app), 60, "the worker to handle every entry")
        runner.check()
        owned = dict(runner.worker.processor.owned)
        limits = {p.cache_limit for p in owned.values()}
        sizes = [len(p.cache) for p in owned.values()]
        runner.stop()
    assert len(owned) == 4 and limits == {100}, limits
    assert all(size <= 100 for size in sizes), sizes
    expected: dict[str, int] = {}
    for key, value in records:
        expected[key] = expected.get(key, 0) + value["n"]
    state = read_state(settings.state.dir, app, 4)
    assert {key: v["total"] for key, v in state.items()} == expected
