"""The admin API's topic read and app reset routes against a real server, checked as the CLI does.

``GET /topics/{topic}/entries`` is ``pspf topic read`` without ``--follow``; ``POST
/apps/{app}/reset`` is ``pspf app reset``. Each answer is compared with the CLI's ``--json`` for
the same data, and each reset is checked in Redis and in what the app does when it runs again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
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

TOKEN = "tok-ops-7d2a91"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PARTITIONS = 2
ENTRIES = 40
KEYS = 5


@pytest.fixture
def api(service: Service) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(service, token=TOKEN)) as client:
        yield client


@pytest.fixture
def cli_json(redis_url: str, settings: Settings) -> Callable[..., Any]:
    """``pspf ARGS --json`` in-process on the same broker and state dir; JSON Lines as a list."""
    env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(settings.state.dir)}

    def run(*args: str) -> Any:
        result = CliRunner().invoke(cli, [*args, "--json"], env=env)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        return (
            [json.loads(line) for line in lines]
            if args[:2] == ("topic", "read")
            else json.loads(result.stdout)
        )

    return run


def error_of(response: Any, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and "\n" not in body["error"], body
    return str(body["error"])


def totals(count: int) -> dict[str, dict[str, int]]:
    """What the summing app holds after the entries n = 0 .. count-1 with keys k0 .. k4."""
    return {f"k{k}": {"total": sum(range(k, count, KEYS))} for k in range(KEYS)}


def send(redis_url: str, topic: str, numbers: range, note: str | None = None) -> None:
    """Produce ``{"n": n}`` with key ``k{n % 5}`` and a header; with ``note``, that in the value too."""
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={})) as producer:
        for n in numbers:
            value: dict[str, Any] = {"n": n} if note is None else {"n": n, "note": note}
            producer.send(topic, value, key=f"k{n % KEYS}", headers={"seq": str(n)})


def stream_id(text: str | bytes) -> tuple[int, int]:
    ms, _, seq = (text.decode() if isinstance(text, bytes) else text).partition("-")
    return int(ms), int(seq)


def caught_up(service: Service, app: str) -> bool:
    """Whether a worker of ``app`` owns every partition and has read everything."""
    try:
        lag = service.apps.lag(app)
    except NotFound:  # not registered yet
        return False
    return bool(lag.detail) and all(d.owner for d in lag.detail) and lag.lag == 0


# -- reading a topic ------------------------------------------------------------------------------


def test_entries_are_the_latest_decoded_oldest_first_as_topic_read_prints_them(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    cli_json: Callable[..., Any],
) -> None:
    topic = make_topic(PARTITIONS)
    send(redis_url, topic, range(ENTRIES), note="<b>x</b>")
    path = f"/topics/{topic}/entries"

    latest = api.get(path).json()
    assert len(latest) == 20  # the default count
    assert latest == cli_json("topic", "read", topic, "--count", "20")
    ids = [(*stream_id(e["id"]), e["partition"]) for e in latest]
    assert ids == sorted(ids)  # oldest first: the newest entry is the last
    everything = sorted(
        (*stream_id(entry_id), p)
        for p in range(PARTITIONS)
        for entry_id, _ in rclient.xrange(stream_key(topic, p))
    )
    assert ids == everything[-20:]  # the latest 20 of both partitions
    first = latest[0]
    n = first["value"]["n"]
    assert first == {
        "id": first["id"],
        "partition": first["partition"],
        "key": f"k{n % KEYS}",
        "value": {"n": n, "note": "<b>x</b>"},
        "encoding": "json",
        "headers": {"seq": str(n)},
    }

    three = api.get(path, params={"count": 3}).json()
    assert three == latest[-3:]

    one = api.get(path, params={"partition": 1, "count": 5}).json()
    newest = rclient.xrevrange(stream_key(topic, 1), count=5)
    assert [e["id"] for e in one] == [entry_id.decode() for entry_id, _ in reversed(newest)]
    assert {e["partition"] for e in one} == {1}

    # From an entry id, or from a time: the first entries at or after it.
    start = latest[5]["id"]
    after = api.get(path, params={"from": start, "count": 4}).json()
    assert after == cli_json("topic", "read", topic, "--from", start, "--count", "4")
    # Both partitions' entries at or after the id: another partition may hold the same id.
    at_or_after = [e for e in everything if e[:2] >= stream_id(start)][:4]
    assert [(*stream_id(e["id"]), e["partition"]) for e in after] == at_or_after
    assert after == [e for e in latest if (*stream_id(e["id"]), e["partition"]) in at_or_after]
    ms = start.split("-")[0]  # a time in unix ms: the entries from that millisecond on
    from_time = api.get(path, params={"from": ms, "count": 1000}).json()
    assert from_time[-len(latest[5:]) :] == latest[5:]
    assert all(int(e["id"].split("-")[0]) >= int(ms) for e in from_time)
    assert len(api.get(path, params={"from": "0", "count": 1000}).json()) == ENTRIES


def test_entries_of_an_unknown_topic_are_404_and_bad_parameters_422(
    api: TestClient[Any], make_topic: Callable[[int], str], names: Names, redis_url: str
) -> None:
    topic = make_topic(PARTITIONS)
    send(redis_url, topic, range(3))
    path = f"/topics/{topic}/entries"
    assert api.get(path).status_code == 200
    missing = names.topic()
    assert missing in error_of(api.get(f"/topics/{missing}/entries"), 404)
    # Invalid requests are 422 across the API (Litestar's 400 included).
    assert "partitions 0 to 1, not 2" in error_of(api.get(path, params={"partition": 2}), 422)
    error_of(api.get(path, params={"partition": -1}), 422)
    assert "count" in error_of(api.get(path, params={"count": 0}), 422)
    assert "count" in error_of(api.get(path, params={"count": 1001}), 422)
    assert "count" in error_of(api.get(path, params={"count": "many"}), 422)
    assert "'from'" in error_of(api.get(path, params={"from": "yesterday"}), 422)
    assert "'from'" in error_of(api.get(path, params={"from": "9" * 25}), 422)  # no stream id that late


# -- resetting an app -----------------------------------------------------------------------------


def test_reset_dry_run_changes_nothing_then_reset_starts_the_app_afresh(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    names: Names,
    settings: Settings,
    service: Service,
    redis_url: str,
    cli_json: Callable[..., Any],
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    send(redis_url, topic, range(ENTRIES))
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == ENTRIES
    path = f"/apps/{app}/reset"
    assert api.get(f"/apps/{app}/state/k1").json() == totals(ENTRIES)["k1"]

    error_of(api.post(path, json={"to": "start", "dry_run": True}), 401)  # a write: token required
    dry = api.post(path, json={"to": "start", "dry_run": True}, headers=AUTH)
    assert dry.status_code == 200, dry.text
    assert dry.json() == cli_json("app", "reset", app, "--dry-run")
    assert dry.json()["entries_to_process"] == ENTRIES and dry.json()["entries_skipped"] == 0
    assert dry.json()["state_reset"] is True and dry.json()["dry_run"] is True
    assert api.get(f"/apps/{app}/state/k1").json() == totals(ENTRIES)["k1"]  # nothing changed
    assert api.get(f"/apps/{app}/lag").json()["lag"] == 0

    done = api.post(path, json={"to": "start"}, headers=AUTH)
    assert done.json() == {**dry.json(), "dry_run": False}
    assert done.json()["stores_here"] == [0, 1]
    error_of(api.get(f"/apps/{app}/state/k1"), 404)  # the backup's state is gone
    assert api.get(f"/apps/{app}/lag").json()["lag"] == ENTRIES  # the groups are at the start
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == ENTRIES
    assert {key: service.state_get(app, key) for key in totals(ENTRIES)} == totals(ENTRIES)

    # To the end keeping the state: the backlog is skipped, the state stays.
    send(redis_url, topic, range(ENTRIES, ENTRIES + 10))
    body = {"to": "end", "keep_state": True}
    skipping = api.post(path, json={**body, "dry_run": True}, headers=AUTH).json()
    assert skipping["entries_skipped"] == 10 and skipping["state_reset"] is False
    assert api.get(f"/apps/{app}/lag").json()["lag"] == 10
    assert api.post(path, json=body, headers=AUTH).json() == {**skipping, "dry_run": False}
    assert api.get(f"/apps/{app}/lag").json()["lag"] == 0
    assert api.get(f"/apps/{app}/state/k1").json() == totals(ENTRIES)["k1"]

    # A reset names where it goes; a body it cannot take is refused, and nothing moves.
    assert "to" in error_of(api.post(path, json={}, headers=AUTH), 422)
    error_of(api.post(path, json={"to": "middle"}, headers=AUTH), 422)
    error_of(api.post(path, json={"to": "start", "keepstate": True}, headers=AUTH), 422)
    assert api.get(f"/apps/{app}/state/k1").json() == totals(ENTRIES)["k1"]


def test_reset_and_delete_are_409_while_a_worker_runs_and_404_for_an_unknown_app(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    names: Names,
    settings: Settings,
    service: Service,
    redis_url: str,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    send(redis_url, topic, range(3))
    with WorkerThread(summing_app(app, topic), settings):
        wait_until(lambda: caught_up(service, app), 10, "the worker to own the partition and read it")
        before = rclient.xinfo_groups(stream_key(topic, 0))
        reset = api.post(f"/apps/{app}/reset", json={"to": "start"}, headers=AUTH)
        assert "stop it first" in error_of(reset, 409)
        deleted = api.post(f"/apps/{app}/delete", json={}, headers=AUTH)
        assert "stop" in error_of(deleted, 409)
        assert rclient.xinfo_groups(stream_key(topic, 0)) == before  # the group did not move
    assert service.state_get(app, "k1") == {"total": 1}

    unknown = names.app()
    assert unknown in error_of(api.post(f"/apps/{unknown}/reset", json={"to": "end"}, headers=AUTH), 404)
    assert "invalid app name" in error_of(
        api.post("/apps/.hidden/reset", json={"to": "end"}, headers=AUTH), 422
    )


def test_a_reset_whose_state_is_out_of_reach_is_refused_with_409(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    tmp_path: Any,
) -> None:
    """The backup is off and the API's state dir holds no store of the app: nothing can reset it."""
    topic, app = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})])
    off = make_settings(PSPF_STATE_DIR=str(tmp_path / "elsewhere"), PSPF_STATE_BACKUP="off")
    Worker(summing_app(app, topic), off).run(until_idle=True)
    refused = api.post(f"/apps/{app}/reset", json={"to": "start"}, headers=AUTH)
    assert refused.status_code == 409, refused.text
    assert "no state backup of partitions [0]" in refused.text


def test_a_topic_is_deleted_through_the_api_only_once_no_app_reads_it(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    produce(topic, [(f"k{i}", {"n": i}) for i in range(10)])
    Worker(summing_app(app, topic), make_settings()).run(until_idle=True)
    path = f"/topics/{topic}/delete"
    refused = api.post(path, json={"dry_run": True}, headers=AUTH)
    assert refused.status_code == 409 and f"pspf app delete {app}" in refused.text
    assert api.post(path, json={}).status_code == 401
    assert api.post(f"/apps/{app}/delete", json={}, headers=AUTH).status_code == 200
    dry = api.post(path, json={"dry_run": True}, headers=AUTH)
    assert dry.status_code == 200 and dry.json()["dry_run"] is True
    assert stream_key(topic, 1) in dry.json()["keys"]
    assert all(rclient.exists(stream_key(topic, p)) for p in range(2)), "a dry run removes nothing"
    done = api.post(path, json={}, headers=AUTH)
    assert done.status_code == 200 and done.json()["partitions"] == 2
    assert not any(rclient.exists(stream_key(topic, p)) for p in range(2))
    assert api.get(f"/topics/{topic}").status_code == 404
    assert api.post(path, json={}, headers=AUTH).status_code == 404


def test_a_topic_is_repartitioned_through_the_api_after_a_dry_run(
    api: TestClient[Any],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    produce(topic, [(f"k{i % 9}", {"n": i}) for i in range(60)])
    Worker(summing_app(app, topic), make_settings()).run(until_idle=True)
    produce(topic, [(f"k{i % 9}", {"n": i}) for i in range(60, 80)])
    path = f"/topics/{topic}/repartition"
    dry = api.post(path, json={"partitions": 5, "dry_run": True}, headers=AUTH)
    assert dry.status_code == 200, dry.text
    assert dry.json()["to_handle"] == {app: 20} and dry.json()["entries"] == 80
    assert rclient.hget(f"pspf:topic:{{{topic}}}", "partitions") == b"2", "a dry run changes nothing"
    assert api.post(path, json={"partitions": 5}).status_code == 401
    with WorkerThread(summing_app(app, topic), make_settings()):
        wait_until(lambda: bool(rclient.exists(f"pspf:app:{{{app}}}:members")), 10, "the worker to join")
        assert api.post(path, json={"partitions": 5}, headers=AUTH).status_code == 409
    done = api.post(path, json={"partitions": 5}, headers=AUTH)
    assert done.status_code == 200 and done.json()["partitions_after"] == 5
    assert api.post(path, json={"resume": True}, headers=AUTH).status_code == 404  # nothing to resume
