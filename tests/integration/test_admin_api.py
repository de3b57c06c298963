"""The admin HTTP API against a real server: the same data and effects as the CLI.

Each read is compared with what ``pspf ... --json`` prints for the same data, each write with
what the CLI does to Redis; then the status mapping, the bearer-token rules and the audit log.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from litestar.testing import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from pspf import App, Context, NonRetryableError, Settings, Worker
from pspf.admin_api import create_app
from pspf.cli import cli
from pspf.embedded import LocalRedis, free_port
from pspf.keys import dlq_key, stream_key, topic_key
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names, RedisServer, pspf_command, server_binary_under_test, subprocess_env

pytestmark = pytest.mark.integration

TOKEN = "tok-8f41c2e0a9d6-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENTRIES = 40
PARTITIONS = 2


def order_app(name: str, topic: str, fixed: bool = False) -> App:
    """Sums amounts per key; orders marked bad go to the DLQ at once unless ``fixed``."""
    app = App(name)

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        if order["bad"] and not fixed:
            raise NonRetryableError(f"order {order['n']} is marked bad")
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


@dataclass
class World:
    """A topic an app has run over: some entries applied, the bad ones dead-lettered."""

    topic: str
    app: str
    records: list[tuple[str, dict[str, Any]]]

    @property
    def bad(self) -> int:
        return sum(1 for _, value in self.records if value["bad"])

    @property
    def totals(self) -> dict[str, dict[str, int]]:
        found: dict[str, dict[str, int]] = {}
        for key, value in self.records:
            if not value["bad"]:
                state = found.setdefault(key, {"total": 0, "count": 0})
                state["total"] += value["amount"]
                state["count"] += 1
        return found


@pytest.fixture
def api(service: Service) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(service, token=TOKEN)) as client:
        yield client


@pytest.fixture
def run_app(settings: Settings) -> Callable[..., int]:
    """Run the order app over ``world`` until idle; the entries it dead-lettered."""

    def run(world: World, fixed: bool = False) -> int:
        summary = Worker(order_app(world.app, world.topic, fixed), settings).run(until_idle=True)
        return summary.dead_lettered

    return run


@pytest.fixture
def make_world(
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    run_app: Callable[..., int],
) -> Callable[[], World]:
    def make() -> World:
        topic, app = make_topic(PARTITIONS), names.app()
        records = [(f"u{n % 5}", {"n": n, "amount": n, "bad": n % 4 == 0}) for n in range(ENTRIES)]
        produce(topic, records)
        world = World(topic, app, records)
        assert run_app(world) == world.bad
        return world

    return make


@pytest.fixture
def world(make_world: Callable[[], World]) -> World:
    return make_world()


@pytest.fixture
def cli_json(redis_url: str, settings: Settings) -> Callable[..., Any]:
    """Run ``pspf ARGS --json`` in-process against the same broker and state directory."""
    env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(settings.state.dir)}

    def run(*args: str) -> Any:
        result = CliRunner().invoke(cli, [*args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    return run


def dlq_length(rclient: redis.Redis, topic: str) -> int:
    return sum(int(rclient.xlen(dlq_key(topic, p))) for p in range(PARTITIONS))


def stream_length(rclient: redis.Redis, topic: str) -> int:
    return sum(int(rclient.xlen(stream_key(topic, p))) for p in range(PARTITIONS))


def error_of(response: Any, status: int) -> str:
    """The one-line error of a response that must have ``status``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert "\n" not in body["error"] and "Traceback" not in body["error"]
    return str(body["error"])


# -- reads ----------------------------------------------------------------------------------------


def test_reads_return_what_the_cli_prints(
    api: TestClient[Any], world: World, cli_json: Callable[..., Any]
) -> None:
    topics = api.get("/topics").json()
    assert topics == cli_json("topic", "list")
    assert {"name": world.topic, "partitions": PARTITIONS} in topics

    described = api.get(f"/topics/{world.topic}").json()
    assert described == cli_json("topic", "describe", world.topic)
    assert described["length"] == ENTRIES

    lag = api.get(f"/apps/{world.app}/lag").json()
    assert lag == cli_json("lag", world.app)
    assert lag["dead_letters"] == world.bad and lag["lag"] == 0
    assert all(d["checkpoint"] is not None for d in lag["detail"])

    ours = [g for g in api.get("/groups").json() if g["app"] == world.app]
    assert ours == [g for g in cli_json("groups") if g["app"] == world.app] == [lag]

    listed = api.get(f"/topics/{world.topic}/dlq").json()
    assert listed == cli_json("dlq", "list", world.topic)
    assert len(listed) == world.bad
    filtered = api.get(f"/topics/{world.topic}/dlq", params={"limit": 3, "app": world.app}).json()
    assert filtered == cli_json("dlq", "list", world.topic, "--limit", "3", "--app", world.app)
    assert len(filtered) == 3
    by_type = api.get(f"/topics/{world.topic}/dlq", params={"error_type": "KeyError"}).json()
    assert by_type == cli_json("dlq", "list", world.topic, "--error-type", "KeyError") == []

    dlq_id = listed[1]["dlq_id"]
    shown = api.get(f"/topics/{world.topic}/dlq/{dlq_id}").json()
    assert shown == cli_json("dlq", "show", world.topic, dlq_id)
    assert shown["value"]["bad"] is True and "marked bad" in shown["message"]

    for key, expected in world.totals.items():
        state = api.get(f"/apps/{world.app}/state/{key}").json()
        assert state == expected == cli_json("state", "get", world.app, key)


def test_health_and_openapi_document(api: TestClient[Any], rclient: redis.Redis) -> None:
    health = api.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["latency_ms"] >= 0
    info = rclient.info("server")
    # The server's own version: Valkey's valkey_version, not the Redis one it is compatible with
    assert body["redis_version"] == info.get("valkey_version", info["redis_version"])
    assert body["server"] == ("Valkey" if "valkey_version" in info else "Redis")

    document = api.get("/schema/openapi.json").json()
    operations = {(method.upper(), path) for path, item in document["paths"].items() for method in item}
    assert operations == {
        ("GET", "/health"),
        ("GET", "/topics"),
        ("GET", "/topics/{topic}"),
        ("GET", "/topics/{topic}/entries"),
        ("GET", "/topics/{topic}/dlq"),
        ("GET", "/topics/{topic}/dlq/{dlq_id}"),
        ("GET", "/groups"),
        ("GET", "/apps/{app}/lag"),
        ("GET", "/apps/{app}/state/{key}"),
        ("GET", "/apps/{app}/state/{key}/windows"),
        ("GET", "/apps/{app}/tables/{table}/{key}"),
        ("GET", "/metrics"),
        ("POST", "/topics/{topic}/dlq/redrive"),
        ("POST", "/topics/{topic}/dlq/purge"),
        ("POST", "/apps/{app}/replay"),
        ("GET", "/apps/{app}/outbox"),
        ("GET", "/apps/{app}/outbox/{row_id}"),
        ("POST", "/apps/{app}/outbox/replay"),
        ("POST", "/apps/{app}/reset"),
        ("POST", "/apps/{app}/delete"),
        ("POST", "/topics/{topic}/delete"),
        ("POST", "/topics/{topic}/repartition"),
        ("POST", "/topics/{topic}/entries"),
        ("GET", "/topics/{topic}/schema"),
        ("GET", "/topics/{topic}/schema/history"),
        ("POST", "/topics/{topic}/schema"),
        ("GET", "/apps/{app}/asyncapi"),
        ("GET", "/apps/{app}/savepoints"),
        ("POST", "/apps/{app}/savepoints"),
        ("DELETE", "/apps/{app}/savepoints/{name}"),
        ("POST", "/apps/{app}/restore"),
    }
    # The service's own records are the response schemas; validation failures are 422, not 400.
    schemas = document["components"]["schemas"]
    assert set(schemas["AppLag"]["properties"]) >= {"app", "lag", "pending", "dead_letters", "detail"}
    for path, item in document["paths"].items():
        for operation in item.values():
            assert "400" not in operation["responses"]
            assert ("422" in operation["responses"]) is (path != "/metrics")
    redrive = document["paths"]["/topics/{topic}/dlq/redrive"]["post"]
    assert redrive["security"] == [{"bearer": []}] and {"401", "403"} <= set(redrive["responses"])
    reset = document["paths"]["/apps/{app}/reset"]["post"]
    assert reset["security"] == [{"bearer": []}] and {"401", "403", "404", "409"} <= set(reset["responses"])
    # Every body refuses unknown fields, and says so.
    bodies = [name for name in schemas if name.endswith("Request")]
    assert len(bodies) == 11 and all(schemas[name]["additionalProperties"] is False for name in bodies)
    entries = document["paths"]["/topics/{topic}/entries"]["get"]
    assert {p["name"] for p in entries["parameters"]} == {"topic", "partition", "from", "count"}


def test_metrics_report_lag_pending_age_and_dead_letters_per_partition(
    api: TestClient[Any], world: World, produce: Callable[..., int], rclient: redis.Redis, service: Service
) -> None:
    produce(world.topic, [(f"u{n}", {"n": n, "amount": 1, "bad": False}) for n in range(12)])
    # A consumer of the app's group takes two entries and never acknowledges them.
    rclient.xreadgroup(world.app, "stray", {stream_key(world.topic, 0): ">"}, count=2)
    time.sleep(0.01)

    response = api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, s.labels.get("app"), s.labels.get("topic"), s.labels.get("partition")): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    assert samples[("pspf_broker_up", None, None, None)] == 1
    expected = service.apps.lag(world.app)
    assert expected.pending == 2 and expected.lag == 12
    for d in expected.detail:
        labels = (world.app, world.topic, str(d.partition))
        assert samples[("pspf_group_lag_entries", *labels)] == d.lag
        assert samples[("pspf_group_pending_entries", *labels)] == d.pending
        assert samples[("pspf_dlq_entries", *labels)] == d.dead_letters
        age = samples.get(("pspf_group_oldest_pending_age_seconds", *labels))
        if d.pending:
            assert age is not None and age > 0
        else:
            assert age is None
    assert sum(samples[("pspf_dlq_entries", world.app, world.topic, str(p))] for p in range(2)) == world.bad
    # Only broker-level names here, none of the worker's, and nothing in the default registry.
    names = {name for name, *_ in samples}
    assert not any(n.startswith(("pspf_entries_", "pspf_partition_")) for n in names)
    assert REGISTRY.get_sample_value("pspf_broker_up") is None


def test_metrics_when_redis_is_down_say_so_instead_of_failing(make_settings: Callable[..., Settings]) -> None:
    service = Service(make_settings(PSPF_BROKER=f"redis://127.0.0.1:{free_port()}/0"))
    with TestClient(create_app(service, token=None)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert "pspf_broker_up 0.0" in response.text and "pspf_group_lag_entries{" not in response.text


# -- writes ---------------------------------------------------------------------------------------


def test_redrive_changes_redis_like_the_cli(
    api: TestClient[Any],
    make_world: Callable[[], World],
    cli_json: Callable[..., Any],
    rclient: redis.Redis,
    run_app: Callable[..., int],
    service: Service,
) -> None:
    by_api, by_cli = make_world(), make_world()
    body = {"error_type": "NonRetryableError", "limit": 4}

    dry = api.post(f"/topics/{by_api.topic}/dlq/redrive", json={**body, "dry_run": True}, headers=AUTH)
    assert dry.status_code == 200
    assert dry.json() == {"selected": 4, "changed": 0, "dry_run": True}
    assert dry.json() == cli_json(
        "dlq", "redrive", by_cli.topic, "--error-type", "NonRetryableError", "--limit", "4", "--dry-run"
    )
    assert dlq_length(rclient, by_api.topic) == by_api.bad

    moved = api.post(f"/topics/{by_api.topic}/dlq/redrive", json=body, headers=AUTH).json()
    assert moved == {"selected": 4, "changed": 4, "dry_run": False}
    assert moved == cli_json(
        "dlq", "redrive", by_cli.topic, "--error-type", "NonRetryableError", "--limit", "4", "--yes"
    )
    for world in (by_api, by_cli):
        assert dlq_length(rclient, world.topic) == world.bad - 4
        assert stream_length(rclient, world.topic) == ENTRIES + 4
        assert service.apps.lag(world.app).lag == 4

    # The rest by id, then all of it again: each entry moves once.
    rest = [d["dlq_id"] for d in api.get(f"/topics/{by_api.topic}/dlq").json()]
    again = api.post(f"/topics/{by_api.topic}/dlq/redrive", json={"ids": rest}, headers=AUTH).json()
    assert again == {"selected": by_api.bad - 4, "changed": by_api.bad - 4, "dry_run": False}
    empty = api.post(f"/topics/{by_api.topic}/dlq/redrive", json={"all": True}, headers=AUTH).json()
    assert empty == {"selected": 0, "changed": 0, "dry_run": False}
    assert dlq_length(rclient, by_api.topic) == 0

    # Fixed, the app applies every redriven entry once: the state counts every order.
    assert run_app(by_api, fixed=True) == 0
    for key in {k for k, _ in by_api.records}:
        every = [v["amount"] for k, v in by_api.records if k == key]
        state = api.get(f"/apps/{by_api.app}/state/{key}").json()
        assert state == {"total": sum(every), "count": len(every)}


def test_purge_changes_redis_like_the_cli(
    api: TestClient[Any], make_world: Callable[[], World], cli_json: Callable[..., Any], rclient: redis.Redis
) -> None:
    by_api, by_cli = make_world(), make_world()
    api_ids = [d["dlq_id"] for d in api.get(f"/topics/{by_api.topic}/dlq").json()[:2]]
    cli_ids = [d["dlq_id"] for d in cli_json("dlq", "list", by_cli.topic)[:2]]

    deleted = api.post(f"/topics/{by_api.topic}/dlq/purge", json={"ids": api_ids}, headers=AUTH).json()
    assert deleted == {"selected": 2, "changed": 2, "dry_run": False}
    assert deleted == cli_json("dlq", "purge", by_cli.topic, *cli_ids, "--yes")
    for world in (by_api, by_cli):
        assert dlq_length(rclient, world.topic) == world.bad - 2
    for dlq_id in api_ids:
        error_of(api.get(f"/topics/{by_api.topic}/dlq/{dlq_id}"), 404)

    fresh = api.post(f"/topics/{by_api.topic}/dlq/purge", json={"older_than": "1h"}, headers=AUTH).json()
    assert fresh == {"selected": 0, "changed": 0, "dry_run": False}
    assert fresh == cli_json("dlq", "purge", by_cli.topic, "--older-than", "1h", "--yes")

    dry = api.post(f"/topics/{by_api.topic}/dlq/purge", json={"all": True, "dry_run": True}, headers=AUTH)
    assert dry.json() == {"selected": by_api.bad - 2, "changed": 0, "dry_run": True}
    assert dry.json() == cli_json("dlq", "purge", by_cli.topic, "--all", "--dry-run")
    assert dlq_length(rclient, by_api.topic) == by_api.bad - 2

    gone = api.post(f"/topics/{by_api.topic}/dlq/purge", json={"all": True}, headers=AUTH).json()
    assert gone == {"selected": by_api.bad - 2, "changed": by_api.bad - 2, "dry_run": False}
    assert gone == cli_json("dlq", "purge", by_cli.topic, "--all", "--yes")
    for world in (by_api, by_cli):
        assert dlq_length(rclient, world.topic) == 0
        assert stream_length(rclient, world.topic) == ENTRIES


def test_replay_then_running_again_gives_the_same_state(
    api: TestClient[Any], world: World, cli_json: Callable[..., Any], run_app: Callable[..., int]
) -> None:
    keys = sorted(world.totals)
    first = {key: api.get(f"/apps/{world.app}/state/{key}").json() for key in keys}
    assert first == world.totals

    body = {"topics": [world.topic], "from_start": True}
    dry = api.post(f"/apps/{world.app}/replay", json={**body, "dry_run": True}, headers=AUTH)
    assert dry.status_code == 200, dry.text
    assert dry.json() == cli_json("replay", world.app, "--topic", world.topic, "--from-start", "--dry-run")
    assert dry.json()["entries_to_replay"] == ENTRIES and dry.json()["state_reset"] is True
    assert api.get(f"/apps/{world.app}/state/{keys[0]}").json() == first[keys[0]]

    done = api.post(f"/apps/{world.app}/replay", json=body, headers=AUTH).json()
    assert done == {**dry.json(), "dry_run": False}
    error_of(api.get(f"/apps/{world.app}/state/{keys[0]}"), 404)  # reset until the app runs
    assert api.get(f"/apps/{world.app}/lag").json()["lag"] == ENTRIES

    assert run_app(world) == world.bad  # the bad ones fail again, into the DLQ again
    assert {key: api.get(f"/apps/{world.app}/state/{key}").json() for key in keys} == first


def test_app_delete_dry_run_then_delete_as_the_cli(
    api: TestClient[Any], world: World, cli_json: Callable[..., Any], rclient: redis.Redis
) -> None:
    path = f"/apps/{world.app}/delete"
    error_of(api.post(path, json={"dry_run": True}), 401)  # a write: the token is required
    dry = api.post(path, json={"dry_run": True}, headers=AUTH)
    assert dry.status_code == 200, dry.text
    assert dry.json() == cli_json("app", "delete", world.app, "--dry-run")
    assert dry.json()["groups"] and world.app in api.get("/groups").text
    done = api.post(path, json={}, headers=AUTH)
    assert done.json() == {**dry.json(), "dry_run": False}
    assert [name for name in rclient.scan_iter(match=f"*{world.app}*")] == []
    error_of(api.get(f"/apps/{world.app}/lag"), 404)
    error_of(api.post(path, json={}, headers=AUTH), 404)


# -- errors ---------------------------------------------------------------------------------------


def test_errors_map_to_statuses_with_one_line(
    api: TestClient[Any], world: World, names: Names, rclient: redis.Redis
) -> None:
    missing_topic, missing_app = names.topic(), names.app()
    assert missing_topic in error_of(api.get(f"/topics/{missing_topic}"), 404)
    error_of(api.get(f"/topics/{missing_topic}/dlq"), 404)
    error_of(api.get(f"/apps/{missing_app}/lag"), 404)
    error_of(api.get(f"/topics/{world.topic}/dlq/0:1-1"), 404)
    error_of(api.get(f"/topics/{world.topic}/dlq/9:1-1"), 404)
    error_of(api.get(f"/apps/{world.app}/state/nobody"), 404)
    error_of(api.post(f"/topics/{world.topic}/dlq/purge", json={"ids": ["0:1-1"]}, headers=AUTH), 404)
    other_topic = {"topics": ["other"], "from_start": True}
    error_of(api.post(f"/apps/{world.app}/replay", json=other_topic, headers=AUTH), 404)
    error_of(api.get("/no/such/route"), 404)

    redrive, purge = f"/topics/{world.topic}/dlq/redrive", f"/topics/{world.topic}/dlq/purge"
    assert "limit" in error_of(api.get(f"/topics/{world.topic}/dlq", params={"limit": 0}), 422)
    assert "limit" in error_of(api.get(f"/topics/{world.topic}/dlq", params={"limit": "many"}), 422)
    assert "path dlq_id" in error_of(api.get(f"/topics/{world.topic}/dlq/nope"), 422)
    # Ids Python would read as numbers but Redis cannot take (digits of other scripts, 2**64).
    error_of(api.get(f"/topics/{world.topic}/dlq/²:1-0"), 422)
    error_of(api.get(f"/topics/{world.topic}/dlq/0:99999999999999999999-0"), 422)
    assert "ids[0]" in error_of(api.post(purge, json={"ids": ["0:1_0-0"]}, headers=AUTH), 422)
    assert "invalid app name" in error_of(api.get("/apps/.hidden/lag"), 422)
    assert "nothing selected" in error_of(api.post(redrive, json={}, headers=AUTH), 422)
    assert "olderthan" in error_of(api.post(purge, json={"all": True, "olderthan": "1d"}, headers=AUTH), 422)
    assert "Expected `bool`" in error_of(api.post(purge, json={"all": "yes"}, headers=AUTH), 422)
    error_of(api.post(purge, content=b"{not json", headers={**AUTH, "content-type": "application/json"}), 422)
    assert "not both" in error_of(api.post(purge, json={"ids": ["0:1-1"], "all": True}, headers=AUTH), 422)
    assert "invalid duration" in error_of(api.post(purge, json={"older_than": "7 days"}, headers=AUTH), 422)
    replay = f"/apps/{world.app}/replay"
    two = {"topics": [world.topic], "from_start": True, "to_id": "0-1"}
    assert "exactly one" in error_of(api.post(replay, json=two, headers=AUTH), 422)
    error_of(api.post(replay, json={"topics": [], "from_start": True}, headers=AUTH), 422)
    error_of(api.post(replay, json={"topics": [world.topic], "to_time": "yesterday"}, headers=AUTH), 422)
    assert dlq_length(rclient, world.topic) == world.bad  # nothing changed on the way

    # A key that holds the wrong Redis type is the broker refusing, not the user's mistake.
    broken = names.topic()
    rclient.set(topic_key(broken), "not a hash")
    try:
        assert "wrong Redis type" in error_of(api.get(f"/topics/{broken}"), 502)
    finally:
        rclient.delete(topic_key(broken))


def test_running_app_and_locked_store_are_409(
    api: TestClient[Any], world: World, settings: Settings, service: Service
) -> None:
    replay = {"topics": [world.topic], "from_start": True}
    with open_store(settings.state.engine, settings.state.dir, world.app, 0):
        message = error_of(api.post(f"/apps/{world.app}/replay", json=replay, headers=AUTH), 409)
    assert "in use" in message

    worker = Worker(order_app(world.app, world.topic), settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not service.apps.lag(world.app).owners:
            assert time.monotonic() < deadline, "the worker never took its partitions"
            time.sleep(0.05)
        assert "is running" in error_of(api.post(f"/apps/{world.app}/replay", json=replay, headers=AUTH), 409)
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_a_wrong_broker_password_is_503_health_included(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """The server answers but refuses the login: no request can succeed, as when it is down."""
    server = LocalRedis(tmp_path / "secured", binary=server_binary_under_test(), password="right")
    with server:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        service = Service(make_settings(PSPF_BROKER=url))
        with TestClient(create_app(service, token=TOKEN)) as client:
            assert "authentication to Redis" in error_of(client.get("/health"), 503)
            error_of(client.get("/topics"), 503)
            error_of(client.get("/groups"), 503)
            error_of(client.post("/topics/t/dlq/purge", json={"all": True}, headers=AUTH), 503)


def test_unreachable_redis_is_503(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "stopped")
    server.start()
    server.stop()  # a port that had a server and has none now
    service = Service(make_settings(PSPF_BROKER=server.url))
    with TestClient(create_app(service, token=TOKEN)) as client:
        assert "cannot reach Redis" in error_of(client.get("/health"), 503)
        error_of(client.get("/topics"), 503)
        error_of(client.get("/groups"), 503)
        error_of(client.post("/topics/t/dlq/purge", json={"all": True}, headers=AUTH), 503)


# -- auth and audit -------------------------------------------------------------------------------


def test_writes_need_the_token_and_reads_do_not(
    api: TestClient[Any], world: World, service: Service, rclient: redis.Redis
) -> None:
    purge = f"/topics/{world.topic}/dlq/purge"
    everything = {"all": True}

    missing = api.post(purge, json=everything)
    error_of(missing, 401)
    assert missing.headers["www-authenticate"].startswith("Bearer")
    error_of(api.post(purge, json=everything, headers={"Authorization": f"Basic {TOKEN}"}), 401)
    error_of(api.post(purge, json=everything, headers={"Authorization": "Bearer"}), 401)
    wrong = api.post(purge, json=everything, headers={"Authorization": "Bearer guess"})
    assert "guess" not in error_of(wrong, 403)
    error_of(api.post(purge, json=everything, headers={"Authorization": f"Bearer {TOKEN}x"}), 403)
    # Refused before the body is read: an unauthenticated bad body is still 401, not 422.
    error_of(api.post(purge, content=b"{oops", headers={"content-type": "application/json"}), 401)
    assert dlq_length(rclient, world.topic) == world.bad

    with TestClient(create_app(service, token=None)) as read_only:
        assert read_only.get(f"/topics/{world.topic}/dlq").status_code == 200
        assert read_only.get(f"/apps/{world.app}/lag").status_code == 200
        for path in (purge, f"/topics/{world.topic}/dlq/redrive"):
            assert "read-only" in error_of(read_only.post(path, json=everything, headers=AUTH), 403)
        replay = {"topics": [world.topic], "from_start": True}
        error_of(read_only.post(f"/apps/{world.app}/replay", json=replay, headers=AUTH), 403)
    assert dlq_length(rclient, world.topic) == world.bad
    assert api.get(f"/apps/{world.app}/lag").json()["lag"] == 0


def test_each_write_is_audited_and_the_token_never_logged(
    api: TestClient[Any], world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    redrive = f"/topics/{world.topic}/dlq/redrive"
    assert api.post(redrive, json={"all": True, "dry_run": True}, headers=AUTH).status_code == 200
    assert api.post(redrive, json={"all": True}, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert api.post(redrive, json={"ids": ["0:1-1"]}, headers=AUTH).status_code == 404
    assert api.post(redrive, json={"all": True, "limit": 0}, headers=AUTH).status_code == 422
    assert api.get(f"/topics/{world.topic}/dlq").status_code == 200  # reads are not audited

    lines = [r for r in caplog.records if r.name == "pspf.audit"]
    assert len(lines) == 4
    records = [json.loads(r.getMessage()) for r in lines]
    assert all(r["action"] == "dlq.redrive" and r["target"] == {"topic": world.topic} for r in records)
    assert all(r["client"] for r in records)
    ok, refused, missing, invalid = records
    assert ok["status"] == 200 and ok["outcome"] == "ok"
    assert ok["params"]["all"] is True and ok["params"]["dry_run"] is True
    assert ok["result"] == {"selected": world.bad, "changed": 0, "dry_run": True}
    assert lines[0].levelno == logging.INFO
    assert refused["status"] == 403 and refused["outcome"] == "refused" and "params" not in refused
    assert missing["status"] == 404 and missing["params"]["ids"] == ["0:1-1"]
    assert missing["outcome"].startswith("failed: no DLQ entry")
    assert invalid["status"] == 422 and lines[3].levelno == logging.WARNING
    assert TOKEN not in caplog.text and "nope" not in caplog.text


# -- parameter errors name each face's own parameters ---------------------------------------------


def test_parameter_errors_name_the_api_fields_and_the_cli_flags(
    api: TestClient[Any],
    world: World,
    make_topic: Callable[[int], str],
    settings: Settings,
    redis_url: str,
) -> None:
    # An app that reads two topics: replaying one of them alone would lose the other's state.
    other = make_topic(PARTITIONS)
    two = App(f"{world.app}-two")
    two.handler(world.topic)(lambda value, ctx: None)
    two.handler(other)(lambda value, ctx: None)
    Worker(two, settings).run(until_idle=True)

    redrive, purge = f"/topics/{world.topic}/dlq/redrive", f"/topics/{world.topic}/dlq/purge"
    replay, outbox = f"/apps/{world.app}/replay", f"/apps/{world.app}/outbox"
    # (method, path, request, the fields the error must name, the CLI command and the flags it names)
    cases: list[tuple[str, str, dict[str, Any], list[str], list[str], list[str]]] = [
        ("post", redrive, {"json": {}}, ["ids", "all", "error_type", "app"],
         ["dlq", "redrive", world.topic], ["IDS", "--all", "--error-type", "--app"]),
        ("post", redrive, {"json": {"ids": ["0:1-1"], "error_type": "E"}}, ["ids", "error_type"],
         ["dlq", "redrive", world.topic, "0:1-1", "--error-type", "E"], ["IDS", "--error-type"]),
        ("post", purge, {"json": {}}, ["ids", "all", "older_than"],
         ["dlq", "purge", world.topic], ["IDS", "--all", "--older-than"]),
        ("post", purge, {"json": {"older_than": "7 days"}}, ["older_than"],
         ["dlq", "purge", world.topic, "--older-than", "7 days"], ["--older-than"]),
        ("post", replay, {"json": {"topics": [world.topic]}}, ["from_start", "to_id", "to_time"],
         ["replay", world.app, "--topic", world.topic], ["--from-start", "--to-id", "--to-time"]),
        ("post", replay, {"json": {"topics": [world.topic], "to_id": "soon"}}, ["to_id"],
         ["replay", world.app, "--topic", world.topic, "--to-id", "soon"], ["--to-id"]),
        ("post", replay, {"json": {"topics": [world.topic], "to_time": "yesterday"}}, ["to_time"],
         ["replay", world.app, "--topic", world.topic, "--to-time", "yesterday"], ["--to-time"]),
        ("post", f"/apps/{two.name}/replay", {"json": {"topics": [world.topic], "from_start": True}},
         ["topics", "keep_state"],
         ["replay", two.name, "--topic", world.topic, "--from-start"], ["--topic", "--keep-state"]),
        ("post", f"{outbox}/replay", {"json": {"dead": True, "all": True}}, ["ids", "dead", "all"],
         ["outbox", "replay", world.app, "--dead", "--all"], ["IDS", "--dead", "--all"]),
        ("get", outbox, {"params": {"state": "lost"}}, ["state"], [], []),
    ]  # fmt: skip
    env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(settings.state.dir)}
    for method, path, request, fields, command, flags in cases:
        message = error_of(getattr(api, method)(path, headers=AUTH, **request), 422)
        assert "--" not in message, message
        for name in fields:
            assert f"'{name}'" in message, (name, message)
        if command:
            result = CliRunner().invoke(cli, [*command, "--yes"], env=env)
            assert result.exit_code == 2, result.output
            line = result.stderr.strip()
            assert line.startswith("Error: ") and "\n" not in line, line
            for flag in flags:
                assert flag in line, (flag, line)
            assert not any(f"'{name}'" in line for name in fields), line


def test_the_page_and_swagger_ui_are_served_from_the_package(api: TestClient[Any]) -> None:
    home = api.get("/", follow_redirects=False)
    assert home.status_code in (301, 302, 307, 308) and home.headers["location"] == "/ui/"
    page = api.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in ("/ui/app.js", "/ui/app.css"):
        assert asset in page.text and api.get(asset).status_code == 200
    assert "http:" not in page.text and "https:" not in page.text
    assert "innerHTML" not in api.get("/ui/app.js").text  # values go in as text only

    swagger = api.get("/schema")
    assert swagger.status_code == 200 and "https://" not in swagger.text and "http://" not in swagger.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "swagger-ui-standalone-preset.js"):
        assert f"/schema-assets/{asset}" in swagger.text
        assert api.get(f"/schema-assets/{asset}").status_code == 200


def test_admin_serve_prints_the_operator_pages_address(redis_url: str) -> None:
    """With --port 0 too: the address printed is the one bound, and the page answers there."""
    process = subprocess.Popen(
        pspf_command("admin", "serve", "--port", "0", "--broker", redis_url),
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline() for _ in range(3)]
        page = [line.split(": ", 1)[1].strip() for line in lines if line.startswith("operator page: ")]
        assert page and page[0].endswith("/ui/") and ":0/" not in page[0], lines
        with urllib.request.urlopen(page[0], timeout=10) as response:
            assert response.status == 200 and b"<html" in response.read().lower()
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert process.returncode == 0, "SIGTERM is a clean stop"


def test_admin_serve_on_a_taken_port_is_one_line(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["admin", "serve", "--port", str(port), "--broker", redis_url])
    assert result.exit_code == 2, result.output
    error = f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert result.output.strip().splitlines()[-1] == error


def test_a_global_table_row_is_served_from_the_state_dir_the_api_was_started_with(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    settings: Settings,
    make_settings: Callable[..., Settings],
    api: TestClient[Any],
    tmp_path: Path,
) -> None:
    """The API's service reads the state dir the worker ran with; another dir names the remedy."""
    orders, products = make_topic(2), make_topic(3)
    produce(products, [("p1", {"price": 3}), ("p2", {"price": 5}), ("p2", None)])
    produce(orders, [("c1", {"n": 1})])
    app = App(names.app())
    app.global_table(products)
    app.handler(orders)(lambda value, ctx: None)
    assert Worker(app, settings).run(until_idle=True).handled == 1

    row = api.get(f"/apps/{app.name}/tables/{products}/p1")
    assert row.status_code == 200 and row.json() == {"price": 3}
    gone = api.get(f"/apps/{app.name}/tables/{products}/p2")
    assert gone.status_code == 404
    assert f"global table {products!r} of app {app.name!r} has no row for key 'p2'" in gone.json()["error"]

    service = Service(make_settings(PSPF_STATE_DIR=str(tmp_path / "elsewhere")))
    try:
        with TestClient(create_app(service, token=None)) as other:
            held = other.get(f"/apps/{app.name}/tables/{products}/p1")
    finally:
        service.close()
    assert held.status_code == 404
    assert held.json()["error"] == (
        f"{products!r} is a global table of app {app.name!r}: its rows are read from a worker's "
        f"store of it, and none is under {tmp_path / 'elsewhere'}: pass a worker's --state-dir "
        "(or run a worker with this one)"
    )


def test_schemas_are_set_with_the_token_shown_and_listed_like_the_cli(
    api: TestClient[Any], make_topic: Callable[[int], str]
) -> None:
    topic = make_topic(1)
    v1 = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert api.post(f"/topics/{topic}/schema", json={"schema": v1}).status_code == 401
    assert api.get(f"/topics/{topic}/schema").status_code == 404
    set_v1 = api.post(f"/topics/{topic}/schema", json={"schema": v1}, headers=AUTH)
    assert set_v1.status_code == 200 and set_v1.json()["version"] == 1
    v2 = {**v1, "required": ["n", "m"], "properties": {**v1["properties"], "m": {"type": "string"}}}
    refused = api.post(f"/topics/{topic}/schema", json={"schema": v2}, headers=AUTH)
    assert refused.status_code == 422 and "$.m" in refused.json()["error"]
    accepted = api.post(f"/topics/{topic}/schema", json={"schema": v2, "compat": "forward"}, headers=AUTH)
    assert accepted.status_code == 200 and accepted.json()["version"] == 2
    assert api.get(f"/topics/{topic}/schema").json()["schema"] == v2
    assert api.get(f"/topics/{topic}/schema", params={"version": 1}).json()["schema"] == v1
    history = api.get(f"/topics/{topic}/schema/history").json()
    assert [(v["version"], v["compat"]) for v in history] == [(1, "backward"), (2, "forward")]


def test_an_apps_asyncapi_document_is_what_its_worker_recorded(api: TestClient[Any], world: World) -> None:
    found = api.get(f"/apps/{world.app}/asyncapi")
    assert found.status_code == 200
    document = found.json()
    assert document["asyncapi"] == "3.0.0" and document["info"]["title"] == world.app
    assert document["channels"][world.topic]["address"] == world.topic
    assert f"receive.{world.topic}" in document["operations"]
    missing = api.get("/apps/never-ran/asyncapi")
    assert missing.status_code == 404 and "no AsyncAPI document yet" in missing.json()["error"]
