"""``pspf app delete``: a retired app leaves the server, and stops holding the topic's retention."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Settings, Worker
from pspf.cli import cli
from pspf.keys import stream_key
from pspf.service import Service
from pspf.worker.retention import Retention
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration


def delete(redis_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["app", "delete", *args, "--broker", redis_url])


def keys_naming(rclient: redis.Redis, app: str) -> list[bytes]:
    return [name for name in rclient.scan_iter(match=f"*{app}*", count=1000)]


def test_a_deleted_app_frees_retention_and_leaves_no_key_while_a_live_app_stays_exact(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    old, live = names.app(), names.app()
    service = Service(make_settings())
    service.topics.set_retention(topic, Retention(max_len=10))
    produce(topic, [(f"k{i % 5}", {"n": i}) for i in range(200)])
    Worker(summing_app(old, topic), make_settings(PSPF_STATE_DIR=str(tmp_path / "old"))).run(until_idle=True)
    produce(topic, [(f"k{i % 5}", {"n": i}) for i in range(200, 400)])
    live_settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "live"))
    Worker(summing_app(live, topic), live_settings).run(until_idle=True)
    held = service.topics.trim_topic(topic, dry_run=True)
    assert {p.held_by for p in held.partitions} == {f"group {old}"}
    assert keys_naming(rclient, old), "the retired app holds keys in the server"

    dry = delete(redis_url, old, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert len(planned["groups"]) == 2 and planned["dry_run"] is True
    assert keys_naming(rclient, old), "a dry run removes nothing"

    done = delete(redis_url, old, "--yes")
    assert done.exit_code == 0, done.output
    assert f"removed app {old}" in done.output
    assert keys_naming(rclient, old) == []
    assert old not in service.broker.apps.list_apps()
    for partition in range(2):
        assert old not in service.broker.topics.stream_info(stream_key(topic, partition)).groups

    trimmed = service.topics.trim_topic(topic)
    assert trimmed.removed > 0
    assert all(rclient.xlen(stream_key(topic, p)) <= 10 for p in range(2))
    # The live app reads on and stays exact.
    produce(topic, [(f"k{i % 5}", {"n": i}) for i in range(400, 450)])
    Worker(summing_app(live, topic), live_settings).run(until_idle=True)
    for k in range(5):
        assert service.state_get(live, f"k{k}") == {"total": sum(range(k, 450, 5))}


def test_deleting_an_app_with_a_live_worker_is_refused_and_an_unknown_app_not_found(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
) -> None:
    topic = make_topic(1)
    app = names.app()
    produce(topic, [("k", {"n": 1})])
    with WorkerThread(summing_app(app, topic), make_settings()):
        wait_until(lambda: bool(rclient.exists(f"pspf:app:{{{app}}}:members")), 10, "the worker to join")
        refused = delete(redis_url, app, "--yes")
        assert refused.exit_code == 6, refused.output
        assert "stop" in refused.output and "Traceback" not in refused.output
        assert keys_naming(rclient, app)
    unknown = delete(redis_url, names.app(), "--yes")
    assert unknown.exit_code == 4 and "never run" in unknown.output


def test_a_topic_is_deleted_only_once_no_app_reads_it(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
) -> None:
    topic, app = make_topic(3), names.app()
    produce(topic, [(f"k{i}", {"n": i}) for i in range(30)])
    Worker(summing_app(app, topic), make_settings()).run(until_idle=True)
    runner = CliRunner()
    refused = runner.invoke(cli, ["topic", "delete", topic, "--yes", "--broker", redis_url])
    assert refused.exit_code == 6 and f"pspf app delete {app}" in refused.output
    assert all(rclient.exists(stream_key(topic, p)) for p in range(3))

    assert delete(redis_url, app, "--yes").exit_code == 0
    done = runner.invoke(cli, ["topic", "delete", topic, "--yes", "--broker", redis_url, "--json"])
    assert done.exit_code == 0, done.output
    assert stream_key(topic, 0) in json.loads(done.output)["keys"]
    assert keys_naming(rclient, topic) == []
    assert topic not in [t.name for t in Service(make_settings()).topics.list_topics()]
    gone = runner.invoke(cli, ["topic", "delete", topic, "--yes", "--broker", redis_url])
    assert gone.exit_code == 4 and "does not exist" in gone.output


def test_without_a_terminal_and_without_yes_nothing_is_deleted(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
) -> None:
    topic, app = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})])
    Worker(summing_app(app, topic), make_settings()).run(until_idle=True)
    asked = CliRunner().invoke(cli, ["app", "delete", app, "--broker", redis_url], input="")
    assert asked.exit_code == 2 and "pass --yes" in asked.output
    assert keys_naming(rclient, app)
