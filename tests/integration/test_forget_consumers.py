"""Consumers of a group that change names per pod pile up; an owner deletes the idle ones."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from pspf import Settings, Worker
from pspf.keys import CONSUMERS_NAMESPACE, stream_key
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def consumers(rclient: redis.Redis, stream: str, group: str) -> dict[str, int]:
    try:
        found = rclient.xinfo_consumers(stream, group)
    except redis.ResponseError:  # no group yet
        return {}
    return {c["name"].decode(): int(c["pending"]) for c in found}


def test_an_owner_deletes_idle_consumers_with_nothing_pending_and_forgets_them_in_its_store(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    stream = stream_key(topic, 0)
    produce(topic, [("k", {"n": i}) for i in range(10)])
    Worker(summing_app(app, topic), make_settings(PSPF_CONSUMER="old-pod")).run(until_idle=True)
    rclient.xgroup_createconsumer(stream, app, "ghost")  # a consumer that read nothing
    produce(topic, [("k", {"n": i}) for i in range(10, 20)])
    settings = make_settings(PSPF_CONSUMER="new-pod", PSPF_MIN_IDLE_MS=100, PSPF_FORGET_CONSUMERS_AFTER_S=0.2)
    service = Service(settings)
    assert [g.consumers for g in service.apps.groups() if g.app == app] == [2]  # old-pod, ghost
    with WorkerThread(summing_app(app, topic), settings):
        wait_until(
            lambda: set(consumers(rclient, stream, app)) == {"new-pod"}, 20, "the idle consumers to go"
        )
    assert [g.consumers for g in service.apps.groups() if g.app == app] == [1]
    with open_store("sqlite", settings.state.dir, app, 0, readonly=True) as store:
        listed = {name for name, _ in store.items(CONSUMERS_NAMESPACE)}
    assert listed == {"new-pod"}, listed
    with open_store("sqlite", settings.state.dir, app, 0, readonly=True) as store:
        assert store.checkpoints()[topic] is not None
