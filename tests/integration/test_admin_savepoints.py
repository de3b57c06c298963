"""The admin API's savepoint routes against a real server, checked as the CLI and the service do.

``GET|POST /apps/{app}/savepoints`` is ``pspf app savepoints|savepoint``, ``DELETE
/apps/{app}/savepoints/{name}`` is ``pspf app savepoint --delete``, ``POST /apps/{app}/restore``
is ``pspf app restore``. Each change is checked in what the app or its fork does when it runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from litestar.testing import TestClient

from pspf import Producer, Settings, Worker
from pspf.admin_api import create_app
from pspf.cli import cli
from pspf.errors import NotFound
from pspf.keys import stream_key
from pspf.service import Service
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration

TOKEN = "tok-savepoints-41c7e2"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PARTITIONS = 2
KEYS = 5


@pytest.fixture
def api(service: Service) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(service, token=TOKEN)) as client:
        yield client


def error_of(response: Any, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and "\n" not in body["error"], body
    return str(body["error"])


def send(redis_url: str, topic: str, numbers: range) -> None:
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={})) as producer:
        for n in numbers:
            producer.send(topic, {"n": n}, key=f"k{n % KEYS}")


def totals(numbers: range) -> dict[str, dict[str, int]]:
    """What the summing app holds after the entries ``numbers``."""
    return {f"k{k}": {"total": sum(n for n in numbers if n % KEYS == k)} for k in range(KEYS)}


def state_of(service: Service, app: str) -> dict[str, dict[str, int]]:
    return {f"k{k}": service.state_get(app, f"k{k}") for k in range(KEYS)}


def caught_up(service: Service, app: str) -> bool:
    try:
        lag = service.apps.lag(app)
    except NotFound:  # not registered yet
        return False
    return bool(lag.detail) and all(d.owner for d in lag.detail) and lag.lag == 0


def test_a_savepoint_is_taken_listed_restored_as_a_fork_after_a_dry_run_and_deleted(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    redis_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pspf.audit")
    topic, app, fork = make_topic(PARTITIONS), names.app(), names.app()
    send(redis_url, topic, range(40))
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    listing = f"/apps/{app}/savepoints"
    assert api.get(listing).json() == []

    # Taking one is a write: refused without the token, and nothing is written.
    body = {"to": str(tmp_path / "sp"), "name": "before-v2"}
    error_of(api.post(listing, json=body), 401)
    assert not (tmp_path / "sp").exists() and api.get(listing).json() == []
    taken = api.post(listing, json=body, headers=AUTH)
    assert taken.status_code == 200, taken.text
    path = str(tmp_path / "sp" / "before-v2")
    found = taken.json()
    assert found["path"] == path and (tmp_path / "sp" / "before-v2" / "manifest.json").exists()
    assert (found["app"], found["name"], found["partitions"], found["keys"]) == (app, "before-v2", 2, KEYS)
    assert found["stopped"] is True and found["resumed"] is False

    listed = api.get(listing).json()
    assert [(e["name"], e["path"], e["state"], e["keys"]) for e in listed] == [
        ("before-v2", path, "complete", KEYS)
    ]
    printed = CliRunner().invoke(cli, ["app", "savepoints", app, "--json", "--broker", redis_url])
    assert printed.exit_code == 0, printed.output
    assert json.loads(printed.stdout) == listed  # the CLI's JSON, field for field

    # The app goes on past the cut; a fork from the savepoint handles what came after it.
    send(redis_url, topic, range(40, 70))
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    restore = f"/apps/{app}/restore"
    dry = api.post(restore, json={"from": path, "as": fork, "dry_run": True}, headers=AUTH)
    assert dry.status_code == 200, dry.text
    preview = dry.json()
    assert (preview["app"], preview["target"], preview["fork"], preview["mode"]) == (app, fork, True, "same")
    assert preview["entries_to_handle"] == 30 and preview["keys"] == KEYS and preview["dry_run"] is True
    error_of(api.get(f"/apps/{fork}/lag"), 404)  # a dry run changes nothing
    done = api.post(restore, json={"from": path, "as": fork}, headers=AUTH)
    assert done.status_code == 200, done.text
    assert {**done.json(), "seconds": 0} == {**preview, "dry_run": False, "seconds": 0}
    assert api.get(f"/apps/{fork}/lag").json()["lag"] == 30
    fork_settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "fork"))
    assert Worker(summing_app(fork, topic), fork_settings).run(until_idle=True).handled == 30
    assert state_of(service, fork) == state_of(service, app) == totals(range(70))

    # The app itself back at the cut: a dry run says what it would handle again.
    rollback = api.post(restore, json={"from": path, "dry_run": True}, headers=AUTH).json()
    assert rollback["fork"] is False and rollback["target"] == app and rollback["entries_to_handle"] == 30

    # Deleting: a write; the dry run names the savepoint and removes nothing.
    one = f"{listing}/before-v2"
    error_of(api.delete(one), 401)
    kept = api.delete(one, params={"dry_run": "true"}, headers=AUTH)
    assert kept.status_code == 200 and kept.json() == listed[0]
    assert (tmp_path / "sp" / "before-v2").exists() and len(api.get(listing).json()) == 1
    gone = api.delete(one, headers=AUTH)
    assert gone.status_code == 200 and gone.json() == listed[0]
    assert not (tmp_path / "sp" / "before-v2").exists() and api.get(listing).json() == []
    assert "has no savepoint named 'before-v2'" in error_of(api.delete(one, headers=AUTH), 404)

    audited = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pspf.audit"]
    actions = [(r["action"], r["status"]) for r in audited]
    assert ("app.savepoint", 200) in actions and ("app.savepoint.delete", 404) in actions
    assert [r["params"] for r in audited if r["action"] == "app.restore"][-1] == {
        "from": path,
        "as": None,
        "partitions": None,
        "dry_run": True,
        "resume": False,
    }
    assert TOKEN not in caplog.text


def test_refusals_answer_404_409_and_422_as_the_errors_map_and_change_nothing(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    service: Service,
    redis_url: str,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, app, other = make_topic(PARTITIONS), names.app(), names.app()
    send(redis_url, topic, range(20))
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    Worker(summing_app(other, topic), settings).run(until_idle=True)
    listing, restore = f"/apps/{app}/savepoints", f"/apps/{app}/restore"
    path = api.post(listing, json={"to": str(tmp_path / "sp"), "name": "one"}, headers=AUTH).json()["path"]

    # 404: no savepoint at the path; an app that never ran here; no savepoint of that name.
    nowhere = str(tmp_path / "nowhere")
    assert "holds no savepoint" in error_of(api.post(restore, json={"from": nowhere}, headers=AUTH), 404)
    unknown = names.app()
    taking = {"to": str(tmp_path / "sp")}
    assert "never run" in error_of(api.post(f"/apps/{unknown}/savepoints", json=taking, headers=AUTH), 404)
    error_of(api.delete(f"{listing}/none-such", headers=AUTH), 404)

    # 422: a fork named as an existing app; a name taken; the topics' count; the body itself.
    refused = api.post(restore, json={"from": path, "as": other}, headers=AUTH)
    assert f"app '{other}' exists: a fork gets a new name" in error_of(refused, 422)
    again = api.post(listing, json={"to": str(tmp_path / "sp"), "name": "one"}, headers=AUTH)
    assert "has a savepoint named 'one' already" in error_of(again, 422)
    counted = api.post(restore, json={"from": path, "partitions": 3, "dry_run": True}, headers=AUTH)
    assert "have 2 partitions now, not 3" in error_of(counted, 422)
    assert "'from'" in error_of(api.post(restore, json={}, headers=AUTH), 422)  # the field, not a flag
    assert "'to'" in error_of(api.post(listing, json={}, headers=AUTH), 422)
    error_of(api.post(restore, json={"source": path}, headers=AUTH), 422)  # unknown field
    error_of(api.post(restore, json={"from": path, "partitions": 0}, headers=AUTH), 422)
    bad_name = api.post(restore, json={"from": path, "as": ".x"}, headers=AUTH)
    assert "invalid app name" in error_of(bad_name, 422)

    # 409: the app runs (a savepoint of it is taken all the same); the entries after the cut trimmed.
    with WorkerThread(summing_app(app, topic), settings):
        wait_until(lambda: caught_up(service, app), 20, "the worker to own its partitions")
        running = api.post(restore, json={"from": path}, headers=AUTH)
        assert "stop it first" in error_of(running, 409)
        live = api.post(listing, json={"to": str(tmp_path / "sp"), "name": "live"}, headers=AUTH)
        assert live.status_code == 200 and live.json()["stopped"] is False
    send(redis_url, topic, range(20, 40))
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    last = rclient.xrevrange(stream_key(topic, 1), count=1)[0][0]
    rclient.xtrim(stream_key(topic, 1), minid=last.decode(), approximate=False)  # retention past the cut
    trimmed = error_of(api.post(restore, json={"from": path}, headers=AUTH), 409)
    assert "partition 1 no longer holds the entries after the savepoint's position" in trimmed
    assert state_of(service, app) == totals(range(40))  # nothing was restored
    assert [e["name"] for e in api.get(listing).json()] == ["one", "live"]


def test_the_openapi_document_shows_the_savepoint_routes_with_their_bodies(api: TestClient[Any]) -> None:
    document = api.get("/schema/openapi.json").json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    assert set(paths["/apps/{app}/savepoints"]) == {"get", "post"}
    listed = paths["/apps/{app}/savepoints"]["get"]
    assert "security" not in listed  # a read
    assert listed["responses"]["200"]["content"]["application/json"]["schema"]["items"] == {
        "$ref": "#/components/schemas/SavepointEntry"
    }
    writes = [
        paths["/apps/{app}/savepoints"]["post"],
        paths["/apps/{app}/savepoints/{name}"]["delete"],
        paths["/apps/{app}/restore"]["post"],
    ]
    for operation in writes:
        assert operation["security"] == [{"bearer": []}]
        assert {"200", "401", "403", "404", "409", "422"} <= set(operation["responses"])
        assert "400" not in operation["responses"]
    deleting = paths["/apps/{app}/savepoints/{name}"]["delete"]
    assert {p["name"] for p in deleting["parameters"]} == {"app", "name", "dry_run"}
    assert set(schemas["SavepointRequest"]["properties"]) == {"to", "name", "resume", "stop", "timeout_s"}
    assert set(schemas["RestoreRequest"]["properties"]) == {"from", "as", "partitions", "dry_run", "resume"}
    assert schemas["RestoreRequest"]["additionalProperties"] is False
    assert {"SavepointTaken", "SavepointRestored", "SavepointEntry"} <= set(schemas)
