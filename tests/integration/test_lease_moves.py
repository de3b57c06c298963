"""After a lost connection, a worker says what happened to its partitions: a lease that moved to
another worker is that, not Redis data loss; a backup that went back under a lease still held is.

The cut is simulated on the shared server: the lease and the backup are changed as another
owner (or a server that lost writes) would leave them, then the worker's connections are killed.
``tests/crash/test_network_cuts.py`` does the same with a real network cut.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis

from pspf import Settings
from pspf.broker import Acknowledging, AckRequest
from pspf.errors import BrokerUnavailable
from pspf.keys import backup_meta_key, lease_key, stream_key
from tests.conftest import Names, standalone_only
from tests.integration.failures_support import WorkerThread, read_state, summing_app
from tests.support import wait_until

pytestmark = [pytest.mark.integration, standalone_only]


def _cut_off(
    rclient: redis.Redis, changes: Callable[[redis.client.Pipeline], None], caplog: pytest.LogCaptureFixture
) -> None:
    """Apply ``changes`` and drop every other client's connection in one transaction, then drop
    them again until the worker lost one in use (an idle one is replaced without a word)."""
    with rclient.pipeline(transaction=True) as pipe:
        changes(pipe)
        pipe.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        pipe.execute()
    deadline = time.monotonic() + 10
    while not any("Redis unavailable" in m for m in _messages(caplog)) and time.monotonic() < deadline:
        rclient.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        time.sleep(0.03)


def _settled(rclient: redis.Redis, topic: str, app: str) -> None:
    """Wait until the backup's checkpoint is the stream's last entry: the worker is idle."""
    meta, last = (
        backup_meta_key(topic, 0, app),
        rclient.xinfo_stream(stream_key(topic, 0))["last-generated-id"],
    )
    wait_until(lambda: rclient.hget(meta, f"cp:{topic}") == last, 15, "the entries in the backup")


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("pspf")]


@pytest.fixture
def owner(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> tuple[str, str]:
    """A topic of one partition and an app whose backup holds a first batch (the worker not yet running)."""
    topic, app = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})] * 10)
    return topic, app


def test_a_lease_taken_over_while_unreachable_is_said_as_such(
    owner: tuple[str, str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic, app = owner
    caplog.set_level(logging.INFO, logger="pspf")
    meta, lease = backup_meta_key(topic, 0, app), lease_key(topic, 0, app)
    with WorkerThread(summing_app(app, topic), make_settings(PSPF_LEASE_TTL_MS=3000)) as runner:
        _settled(rclient, topic, app)
        token = int(rclient.get(lease).decode().rpartition("|")[2])

        def taken_over(pipe: redis.client.Pipeline) -> None:
            # As a worker that took the partition after the lease expired leaves them.
            pipe.set(lease, f"elsewhere/77/0000beef|{token + 1}", px=30_000)
            pipe.hset(meta, "identity", f"{token + 1}-3")

        _cut_off(rclient, taken_over, caplog)
        wait_until(lambda: not runner.worker.processor.owned, 15, "the worker to give partition 0 up")
        runner.check()
    said = _messages(caplog)
    assert not [m for m in said if "went back" in m or "lost writes" in m], said
    moved = [m for m in said if "lease of partition 0" in m and "now held by elsewhere" in m]
    assert moved, said


def test_a_backup_that_went_back_under_a_lease_still_held_is_lost_writes(
    owner: tuple[str, str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic, app = owner
    caplog.set_level(logging.INFO, logger="pspf")
    meta = backup_meta_key(topic, 0, app)
    with WorkerThread(summing_app(app, topic), make_settings(PSPF_LEASE_TTL_MS=3000)) as runner:
        _settled(rclient, topic, app)
        identity = rclient.hget(meta, "identity")
        token, _, seq = identity.decode().rpartition("-")

        def went_back(pipe: redis.client.Pipeline) -> None:
            # A fail-over to a replica that missed the last writes: same owner, an earlier identity.
            pipe.hset(meta, "identity", f"{token}-{int(seq) - 1}")

        _cut_off(rclient, went_back, caplog)
        wait_until(
            lambda: any("went back" in m for m in _messages(caplog)),
            15,
            "the worker to say the backup went back",
        )
        runner.check()
    said = _messages(caplog)
    # Said by the check after the reconnect, or by an acknowledgement the backup refused first.
    assert any("state backup" in m and "went back" in m for m in said), said
    assert not [m for m in said if "now held by" in m], said


class _LostWithTheServer:
    """An acknowledgement whose connection died before its reply: it may have run, or not."""

    def result(self) -> list[object]:
        raise BrokerUnavailable("connection lost (the test's fail-over)")

    def abandon(self) -> None:
        pass


@pytest.mark.parametrize("entry_kept", [True, False], ids=["entries-kept", "last-entry-lost"])
def test_a_call_never_read_is_sent_again_only_while_the_server_holds_its_entries(
    owner: tuple[str, str],
    make_settings: Callable[..., Settings],
    produce: Callable[..., int],
    rclient: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    entry_kept: bool,
) -> None:
    """A fail-over to a replica that had none of a batch's acknowledging call (the worker never
    read its reply) and, in one case, not the batch's last entry either. The store applied that
    batch: its writes may go again only when its entries are all still there; otherwise the
    store is rebuilt from the backup and the entries left are applied. Either way the state is
    the sum of the entries the server holds."""
    topic, app = owner
    caplog.set_level(logging.INFO, logger="pspf")
    stream = stream_key(topic, 0)
    lose = threading.Event()
    real = Acknowledging.ack_sent

    def ack_sent(self: Acknowledging, requests: Sequence[AckRequest]) -> object:
        if lose.is_set() and any(r.ids for r in requests):
            lose.clear()
            if not entry_kept:
                rclient.xdel(stream, requests[0].ids[-1])
            return _LostWithTheServer()
        return real(self, requests)

    monkeypatch.setattr(Acknowledging, "ack_sent", ack_sent)
    with WorkerThread(summing_app(app, topic), make_settings(PSPF_LEASE_TTL_MS=3000)) as runner:
        _settled(rclient, topic, app)
        lose.set()
        produce(topic, [("k", {"n": 10})] * 5)
        wait_until(lambda: not lose.is_set(), 15, "the batch's acknowledgement")
        wait_until(lambda: rclient.xpending(stream, app)["pending"] == 0, 15, "the entries acknowledged")
        runner.stop()
    held = sum(json.loads(fields[b"value"])["n"] for _, fields in rclient.xrange(stream))
    assert held == 10 + (50 if entry_kept else 40)
    assert read_state(tmp_path / "state", app, 1)["k"]["total"] == held
    said = _messages(caplog)
    went_back = [m for m in said if "state backup of partition 0 went back" in m]
    assert bool(went_back) is not entry_kept, said
