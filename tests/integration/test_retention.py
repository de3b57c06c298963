"""Retention: trimming never removes an entry some app still needs, and frees memory once none does."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Settings, Worker
from pspf.cli import cli
from pspf.errors import BrokerError, ConfigError, NotFound
from pspf.keys import partition_for, stream_key
from pspf.service import Service
from pspf.worker import lease_round
from pspf.worker.retention import Retention
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def run_until_idle(app: str, topic: str, settings: Settings) -> None:
    Worker(summing_app(app, topic), settings).run(until_idle=True)


def produce_n(produce: Callable[..., int], topic: str, first: int, n: int) -> None:
    produce(topic, [(f"k{i % 5}", {"n": i}) for i in range(first, first + n)])


def ids(rclient: redis.Redis, stream: str) -> list[bytes]:
    return [entry_id for entry_id, _ in rclient.xrange(stream)]


@pytest.fixture
def service(make_settings: Callable[..., Settings]) -> Service:
    return Service(make_settings())


def test_a_lagging_app_keeps_what_it_has_not_acknowledged_and_trimming_frees_once_it_caught_up(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    fast, slow = names.app(), names.app()
    produce_n(produce, topic, 0, 500)
    run_until_idle(slow, topic, make_settings(PSPF_STATE_DIR=str(tmp_path / "slow")))
    produce_n(produce, topic, 500, 500)
    # The slow app has 10 more entries delivered and not acknowledged (a consumer that died mid-batch).
    rclient.xreadgroup(slow, "gone", {stream: ">"}, count=10)
    run_until_idle(fast, topic, make_settings(PSPF_STATE_DIR=str(tmp_path / "fast")))
    every = ids(rclient, stream)
    assert len(every) == 1000

    aggressive = Retention(max_len=0)
    dry = service.topics.trim_topic(topic, dry_run=True, override=aggressive)
    assert [p.removable for p in dry.partitions] == [500] and ids(rclient, stream) == every
    assert dry.partitions[0].held_by == f"group {slow}"
    done = service.topics.trim_topic(topic, override=aggressive)
    assert done.removed == 500
    # the first pending entry of the slow app is the first one left: nothing it needs went
    assert ids(rclient, stream) == every[500:]
    assert rclient.xpending(stream, slow)["min"] == every[500]

    before = service.topics.describe_topic(topic).trims[0].memory_bytes
    rclient.xautoclaim(stream, slow, "gone2", 0, "0-0")  # the slow app's worker takes them over...
    run_until_idle(slow, topic, make_settings(PSPF_STATE_DIR=str(tmp_path / "slow")))
    assert rclient.xpending(stream, slow)["pending"] == 0
    assert service.topics.trim_topic(topic, override=aggressive).removed == 500
    assert rclient.xlen(stream) == 0
    after = service.topics.describe_topic(topic).trims[0].memory_bytes
    assert before is not None and after is not None and after < before / 5, (before, after)
    # both apps still have their whole state, and read on after the trim
    assert service.state_get(slow, "k0") == service.state_get(fast, "k0") == {"total": sum(range(0, 1000, 5))}


def test_an_app_of_the_topic_without_a_group_holds_the_trim_and_the_replay_window_too(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    app = names.app()
    produce_n(produce, topic, 0, 100)
    Worker(summing_app(app, topic), make_settings()).run(until_idle=True)
    dry = service.topics.trim_topic(topic, dry_run=True, override=Retention(max_len=0))
    assert dry.partitions[0].removable == 100
    held = service.topics.trim_topic(topic, override=Retention(max_len=0, replay_window_ms=3_600_000))
    assert held.removed == 0 and held.partitions[0].held_by == "replay window"
    rclient.xgroup_destroy(stream, app)  # the app still reads the topic: it would start again from 0
    held = service.topics.trim_topic(topic, override=Retention(max_len=0))
    assert held.removed == 0 and held.partitions[0].held_by == f"app {app} has no group"
    assert rclient.xlen(stream) == 100


def test_max_age_and_max_len_remove_the_oldest_only(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    rclient.xadd(stream, {b"key": b"old", b"value": b'{"n": 1}'}, id="1000-0")  # from 1970: any max age
    produce_n(produce, topic, 0, 300)
    Worker(summing_app(names.app(), topic), make_settings()).run(until_idle=True)
    every = ids(rclient, stream)
    assert service.topics.trim_topic(topic, override=Retention(max_age_ms=86_400_000)).removed == 1
    assert ids(rclient, stream) == every[1:]
    service.topics.set_retention(topic, Retention(max_len=120))
    assert service.topics.describe_topic(topic).retention == Retention(max_len=120)
    assert service.topics.trim_topic(topic).removed == 180
    assert ids(rclient, stream) == every[-120:]


def test_a_running_worker_applies_the_topics_retention_to_its_partitions(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lease_round, "TRIM_EVERY_S", 0.0)
    topic = make_topic(2)
    service.topics.set_retention(topic, Retention(max_len=50))
    app = names.app()
    with WorkerThread(summing_app(app, topic), make_settings()):
        for first in range(0, 2000, 500):
            produce_n(produce, topic, first, 500)
            wait_until(lambda: all(rclient.xlen(stream_key(topic, p)) <= 50 for p in range(2)), 15, "trims")
    assert sum(service.state_get(app, f"k{j}")["total"] for j in range(5)) == sum(range(2000))


def test_without_a_retention_trim_is_refused_and_nothing_goes(
    make_topic: Callable[[int], str], produce: Callable[..., int], service: Service
) -> None:
    topic = make_topic(1)
    produce_n(produce, topic, 0, 10)
    with pytest.raises(ConfigError, match="has no retention"):
        service.topics.trim_topic(topic)


def test_the_cli_sets_shows_and_trims(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    produce_n(produce, topic, 0, 40)
    Worker(summing_app(names.app(), topic), make_settings()).run(until_idle=True)

    def pspf(*args: str) -> Result:
        return CliRunner().invoke(cli, [*args, "--broker", redis_url])

    refused = pspf("topic", "trim", topic)
    assert refused.exit_code == 2 and "has no retention" in refused.output
    assert pspf("topic", "retention", topic, "--max-len", "10", "--replay-window", "0s").exit_code == 0
    shown = pspf("topic", "retention", topic, "--json")
    assert json.loads(shown.output) == {"max_age_ms": None, "max_len": 10, "replay_window_ms": 0}
    dry = pspf("topic", "trim", topic, "--dry-run")
    assert dry.exit_code == 0 and "dry run: 30 entries would go" in dry.output
    assert rclient.xlen(stream_key(topic, 0)) == 40
    done = pspf("topic", "trim", topic)
    assert done.exit_code == 0 and f"trimmed 30 entries from topic {topic}" in done.output
    described = pspf("topic", "describe", topic)
    assert "max length 10" in described.output and "RETENTION FREES" in described.output
    bad = pspf("topic", "retention", topic, "--max-age", "soon")
    assert bad.exit_code == 2 and "invalid duration 'soon'" in bad.output
    assert pspf("topic", "retention", topic, "--clear").output.strip().endswith("none (never trimmed)")


def key_on(partition: int, partitions: int) -> str:
    """A key of that partition."""
    return next(f"k{i}" for i in range(1000) if partition_for(f"k{i}".encode(), partitions) == partition)


def total(service: Service, app: str, key: str) -> int:
    try:
        return int(service.state_get(app, key).get("total", 0))
    except NotFound:  # the worker has not registered the app yet, or the key has no state
        return 0


def test_a_quiet_partition_trimmed_empty_by_retention_stops_nothing(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An emptied stream keeps its last generated id: its reads are empty, not gone back."""
    monkeypatch.setattr(lease_round, "TRIM_EVERY_S", 0.0)
    topic, app = make_topic(2), names.app()
    quiet, busy = key_on(0, 2), key_on(1, 2)
    service.topics.set_retention(topic, Retention(max_age_ms=300))
    produce(topic, [(quiet, {"n": 1})] * 50)
    # bursts of one full batch: the next read is sent ahead (lua/read.lua) and comes back empty
    with WorkerThread(summing_app(app, topic), make_settings(PSPF_BATCH_SIZE=10)) as runner:
        wait_until(lambda: rclient.xlen(stream_key(topic, 0)) == 0, 15, "the quiet partition trimmed empty")
        sent = 0
        for burst in range(8):  # empty reads of both partitions come between the bursts
            produce(topic, [(busy, {"n": burst * 10 + i}) for i in range(10)])
            sent += sum(burst * 10 + i for i in range(10))
            time.sleep(0.15)
            runner.check()
        produce(topic, [(quiet, {"n": 1000})])
        wait_until(lambda: runner.check() or total(service, app, quiet) == 1050, 15, "the later entry")
        wait_until(lambda: total(service, app, busy) == sent, 15, "the busy partition")
        runner.check()
        assert runner.alive()


def test_trimming_a_quiet_partition_empty_from_the_cli_under_a_running_worker(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    produce_n(produce, topic, 0, 40)
    with WorkerThread(summing_app(app, topic), make_settings()) as runner:
        wait_until(lambda: total(service, app, "k0") == sum(range(0, 40, 5)), 15, "the first entries")
        time.sleep(0.2)
        done = CliRunner().invoke(cli, ["topic", "trim", topic, "--max-age", "100ms", "--broker", redis_url])
        assert done.exit_code == 0 and f"trimmed 40 entries from topic {topic}" in done.output, done.output
        time.sleep(0.5)  # several empty reads of the emptied stream
        runner.check()
        produce_n(produce, topic, 40, 10)
        wait_until(lambda: runner.check() or total(service, app, "k0") == sum(range(0, 50, 5)), 15, "later")
        assert runner.alive()


def test_a_stream_deleted_and_created_again_empty_under_a_worker_is_still_refused(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    service: Service,
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Its last generated id is 0-0, below the checkpoint: new entries could land below it."""
    topic, app = make_topic(1), names.app()
    stream = stream_key(topic, 0)
    produce_n(produce, topic, 0, 20)
    with WorkerThread(summing_app(app, topic), make_settings()) as runner:
        wait_until(lambda: total(service, app, "k0") == sum(range(0, 20, 5)), 15, "the first entries")
        with rclient.pipeline(transaction=True) as pipe:
            pipe.delete(stream)
            pipe.xgroup_create(stream, app, id="0", mkstream=True)
            pipe.execute()
        wait_until(lambda: not runner.alive(), 15, "the worker to stop")
    assert isinstance(runner.error, BrokerError), runner.error
    message = str(runner.error)
    assert "its last generated id 0-0 is below the app's checkpoint" in message, message
    checkpoint = message.split("checkpoint ")[1].split(" ")[0]
    assert f"`XSETID {stream} {checkpoint}`" in message
    # the advice works on the empty stream: after it a worker takes the partition and goes on
    rclient.execute_command("XSETID", stream, checkpoint)
    produce_n(produce, topic, 20, 5)
    run_until_idle(app, topic, make_settings())
    assert total(service, app, "k0") == sum(range(0, 25, 5))
