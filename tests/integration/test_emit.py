"""``ctx.emit`` against a real server: outputs published once, in order, with their source."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, Settings, Worker
from pspf.broker import Broker, PublishCall
from pspf.errors import BrokerError
from pspf.keys import producers_key, stream_key
from pspf.outbox.emit import (
    SOURCE_APP_HEADER,
    SOURCE_ID_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
)
from pspf.outbox.rows import RowState, rows_in_store
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names, pspf_command, subprocess_env

pytestmark = pytest.mark.integration


class Order(msgspec.Struct):
    user: str
    amount: int


@pytest.fixture
def services() -> Iterator[Callable[[Settings], Service]]:
    """Services over given settings, closed after the test."""
    made: list[Service] = []

    def make(settings: Settings) -> Service:
        made.append(Service(settings))
        return made[-1]

    yield make
    for service in made:
        service.close()


@pytest.fixture
def brokers() -> Iterator[Callable[[str], Broker]]:
    made: list[Broker] = []

    def make(url: str) -> Broker:
        made.append(Broker(Settings.load({"PSPF_BROKER": url}, environ={}).redis))
        return made[-1]

    yield make
    for broker in made:
        broker.close()


def forwarding_app(name: str, source: str, target: str) -> App:
    """An app that emits each entry of ``source`` to ``target``, under the entry's key."""
    app = App(name)

    @app.handler(source)
    def forward(value: dict[str, Any], ctx: Context) -> None:
        ctx.emit(target, value, key=ctx.key or None)

    return app


def outputs(rclient: redis.Redis, topic: str, partitions: int) -> list[dict[str, Any]]:
    """Every entry of a topic: key, decoded value, headers, and the partition it is in."""
    found = []
    for p in range(partitions):
        for _, fields in rclient.xrange(stream_key(topic, p)):
            found.append(
                {
                    "partition": p,
                    "key": fields.get(b"key", b"").decode(),
                    "value": json.loads(fields[b"value"]),
                    "headers": json.loads(fields.get(b"headers", b"{}")),
                }
            )
    return found


def rows(settings: Settings, app: str, partitions: int) -> list[Any]:
    found = []
    for p in range(partitions):
        with open_store(settings.state.engine, settings.state.dir, app, p, readonly=True) as store:
            found += rows_in_store(store, app, p)
    return found


def test_each_handled_entry_emits_once_with_its_source(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    orders, enriched = make_topic(2), make_topic(3)
    app = App(names.app())

    @app.handler(orders)
    def enrich(order: Order, ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        ctx.emit(enriched, {"user": order.user, "n": ctx.state["n"]}, key=order.user)

    produce(orders, [(f"u{i % 7}", {"user": f"u{i % 7}", "amount": i}) for i in range(300)])
    settings = make_settings(PSPF_BATCH_SIZE=40)
    summary = Worker(app, settings).run(until_idle=True)

    got = outputs(rclient, enriched, 3)
    assert summary.published == 300
    assert len(got) == 300
    sources = Counter((o["headers"][SOURCE_PARTITION_HEADER], o["headers"][SOURCE_ID_HEADER]) for o in got)
    assert len(sources) == 300 and set(sources.values()) == {1}
    for out in got:
        assert out["headers"][SOURCE_APP_HEADER] == app.name
        assert out["headers"][SOURCE_TOPIC_HEADER] == orders
        assert out["key"] == out["value"]["user"]
    # Per key the handler's order: n counts up without a gap.
    per_user: dict[str, list[int]] = {}
    for out in got:
        per_user.setdefault(out["key"], []).append(out["value"]["n"])
    assert all(ns == list(range(1, len(ns) + 1)) for ns in per_user.values())
    assert {r.state for r in rows(settings, app.name, 2)} == {RowState.PUBLISHED}


def test_a_failing_handler_emits_nothing_and_a_dead_entry_publishes_nothing(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source, target = make_topic(1), make_topic(1)
    app = App(names.app())

    @app.handler(source)
    def flaky(value: dict[str, Any], ctx: Context) -> None:
        ctx.emit(target, {"i": value["i"], "attempt": ctx.delivery_count})
        if value["i"] == 3 and ctx.delivery_count < 2:
            raise RuntimeError("first attempt fails after emitting")
        if value["i"] == 5:
            raise RuntimeError("always fails after emitting")

    produce(source, [(None, {"i": i}) for i in range(8)])
    summary = Worker(app, make_settings(PSPF_MAX_RETRIES=2)).run(until_idle=True)

    got = outputs(rclient, target, 1)
    assert sorted(o["value"]["i"] for o in got) == [0, 1, 2, 3, 4, 6, 7]
    assert next(o for o in got if o["value"]["i"] == 3)["value"]["attempt"] == 2
    assert rclient.xlen(f"{stream_key(source, 0)}:dlq") == 1
    assert summary.published == 7


def test_an_entry_redriven_from_the_dlq_emits_once_when_it_succeeds(
    services: Callable[[Settings], Service],
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source, target = make_topic(1), make_topic(1)
    app = App(names.app())
    fixed = False

    @app.handler(source)
    def picky(value: dict[str, Any], ctx: Context) -> None:
        ctx.emit(target, value)
        if value["i"] == 2 and not fixed:
            raise ValueError("a bug, fixed later")

    produce(source, [(None, {"i": i}) for i in range(4)])
    settings = make_settings(PSPF_MAX_RETRIES=1)
    Worker(app, settings).run(until_idle=True)
    assert sorted(o["value"]["i"] for o in outputs(rclient, target, 1)) == [0, 1, 3]
    fixed = True
    assert services(settings).dlq.dlq_redrive(source, all_entries=True).changed == 1
    Worker(app, settings).run(until_idle=True)
    assert sorted(o["value"]["i"] for o in outputs(rclient, target, 1)) == [0, 1, 2, 3]


def test_emitting_to_a_missing_topic_fails_the_entry_with_a_clear_error(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source = make_topic(1)
    app = App(names.app())

    @app.handler(source)
    def lost(value: dict[str, Any], ctx: Context) -> None:
        ctx.emit("no-such-topic", value)

    produce(source, [(None, {"i": 1})])
    Worker(app, make_settings(PSPF_MAX_RETRIES=1)).run(until_idle=True)
    (dead,) = rclient.xrange(f"{stream_key(source, 0)}:dlq")
    fields = dead[1]
    assert fields[b"error_type"] == b"EmitError"
    assert b"no-such-topic" in fields[b"message"] and b"does not exist" in fields[b"message"]


def test_a_repeated_publish_adds_nothing(
    brokers: Callable[[str], Broker], redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    broker = brokers(redis_url)
    rows_ = [(seq, {b"value": str(seq).encode()}) for seq in range(1, 6)]
    assert broker.publishing.publish(topic, 0, "app/0", rows_[:3]) == 3
    assert broker.publishing.publish(topic, 0, "app/0", rows_) == 2  # 1-3 again: skipped
    assert broker.publishing.publish(topic, 0, "app/0", rows_) == 0
    assert broker.publishing.publish(topic, 0, "other/0", rows_[:1]) == 1  # another producer counts apart
    assert [f[b"value"] for _, f in rclient.xrange(stream_key(topic, 0))] == [
        b"1",
        b"2",
        b"3",
        b"4",
        b"5",
        b"1",
    ]
    assert rclient.hget(producers_key(topic, 0), "app/0") == b"5"


def test_a_call_whose_earlier_call_did_not_run_adds_nothing_and_headers_are_made_on_the_server(
    brokers: Callable[[str], Broker], redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    """A step's calls to one target are pipelined: the second names the last row of the first, and
    runs only if that one did (else the target would take rows 3-4 and refuse 1-2 as seen)."""
    topic = make_topic(1)
    broker = brokers(redis_url)
    head = b'{"src":"'
    first = PublishCall(
        (topic, 0), 0, "1:2", (b"key", b"value", b"headers"), head, [b"a", b"1", b"9-1", b"b", b"2", b"9-2"]
    )
    second = PublishCall((topic, 0), 2, "3:1,7:1", (b"value", b"headers"), b"", [b"3", b"{}", b"4", b"{}"])
    (gap,) = broker.publishing.send_publish("app/0", [second]).replies()
    assert isinstance(gap, BrokerError) and "GAP" in str(gap)
    assert rclient.xlen(stream_key(topic, 0)) == 0 and rclient.hget(producers_key(topic, 0), "app/0") is None
    assert [reply[0] for reply in broker.publishing.send_publish("app/0", [first, second]).replies()] == [
        2,
        2,
    ]
    entries = [fields for _, fields in rclient.xrange(stream_key(topic, 0))]
    assert entries == [
        {b"key": b"a", b"value": b"1", b"headers": b'{"src":"9-1"}'},
        {b"key": b"b", b"value": b"2", b"headers": b'{"src":"9-2"}'},
        {b"value": b"3", b"headers": b"{}"},
        {b"value": b"4", b"headers": b"{}"},
    ]
    assert rclient.hget(producers_key(topic, 0), "app/0") == b"7"
    # Sent again (a relay that never read the replies): nothing new.
    assert [reply[0] for reply in broker.publishing.send_publish("app/0", [first, second]).replies()] == [
        0,
        0,
    ]


def test_a_target_of_the_wrong_type_refuses_before_writing(
    brokers: Callable[[str], Broker], redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    rclient.delete(stream_key(topic, 0))
    rclient.set(stream_key(topic, 0), "not a stream")
    broker = brokers(redis_url)
    with pytest.raises(Exception, match="WRONGTYPE"):
        broker.publishing.publish(topic, 0, "app/0", [(1, {b"value": b"1"})])
    assert rclient.hget(producers_key(topic, 0), "app/0") is None


def test_rows_to_a_broken_target_die_and_replay_publishes_each_once(
    services: Callable[[Settings], Service],
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    source, target = make_topic(2), make_topic(1)
    rclient.delete(stream_key(target, 0))
    rclient.set(stream_key(target, 0), "in the way")  # WRONGTYPE for every publish
    app = forwarding_app(names.app(), source, target)

    produce(source, [(f"k{i}", {"i": i}) for i in range(20)])
    settings = make_settings(
        PSPF_OUTBOX_MAX_ATTEMPTS=3, PSPF_OUTBOX_RETRY_BASE_MS=10, PSPF_OUTBOX_RETRY_MAX_MS=50
    )
    summary = Worker(app, settings).run(until_idle=True)
    assert summary.published == 0 and summary.publish_failed >= 20 * 3

    service = services(settings)
    dead = service.outbox.outbox_list(app.name, "dead")
    assert len(dead) == 20
    assert all(r.attempts == 3 and r.last_error and "WRONGTYPE" in r.last_error for r in dead)
    detail = service.outbox.outbox_show(app.name, dead[0].row_id)
    assert json.loads(detail.value)["i"] in range(20) and detail.headers[SOURCE_APP_HEADER] == app.name

    rclient.delete(stream_key(target, 0))  # repaired
    preview = service.outbox.outbox_replay(app.name, dead=True, dry_run=True)
    assert sorted(preview.selected) == sorted(r.row_id for r in dead) and not preview.replayed

    worker = Worker(app, settings)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        result = service.outbox.outbox_replay(app.name, dead=True, wait_s=20)
        assert sorted(result.replayed) == sorted(r.row_id for r in dead) and result.waiting == []
        wait_for(lambda: rclient.xlen(stream_key(target, 0)) == 20, 20)
        wait_for(lambda: len(service.outbox.outbox_list(app.name, "published")) == 20, 20)
        # Replaying the same rows again publishes them once more, and only once.
        again = service.outbox.outbox_replay(app.name, ids=[dead[0].row_id], wait_s=20)
        assert again.replayed == [dead[0].row_id]
        wait_for(lambda: rclient.xlen(stream_key(target, 0)) == 21, 20)
        time.sleep(0.5)
    finally:
        worker.stop()
        thread.join()
    twice = json.loads(service.outbox.outbox_show(app.name, dead[0].row_id).value)["i"]
    counts = Counter(o["value"]["i"] for o in outputs(rclient, target, 1))
    assert counts == Counter({**dict.fromkeys(range(20), 1), twice: 2})


def test_a_replay_no_worker_applies_stays_queued_and_the_cli_says_so(
    services: Callable[[Settings], Service],
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    source, target = make_topic(1), make_topic(1)
    app = forwarding_app(names.app(), source, target)

    produce(source, [(None, {"i": 1})])
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    (row,) = services(settings).outbox.outbox_list(app.name, "published")
    done = subprocess.run(
        pspf_command(
            "outbox", "replay", app.name, row.row_id, "--yes", "--wait", "0.3", "--broker", redis_url
        ),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 7, done.stderr
    assert "stays queued" in done.stderr and "replayed 0 of 1" in done.stdout
    # The next worker of the app applies it: the row is published a second time.
    Worker(app, settings).run(until_idle=True)
    wait_for(lambda: rclient.xlen(stream_key(target, 0)) == 2, 10)
    listed = subprocess.run(
        pspf_command("outbox", "list", app.name, "--json", "--broker", redis_url),
        capture_output=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert listed.returncode == 0, listed.stderr
    assert [r["state"] for r in json.loads(listed.stdout)] == ["published"]
    bad = subprocess.run(
        pspf_command("outbox", "show", app.name, "zero", "--broker", redis_url),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "expected PARTITION:ROW" in bad.stderr and "Traceback" not in bad.stderr


def wait_for(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_admin_api_lists_shows_and_replays_outbox_rows(
    services: Callable[[Settings], Service],
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
) -> None:
    from litestar.testing import TestClient

    from pspf.admin_api import create_app

    source, target = make_topic(2), make_topic(1)
    app = forwarding_app(names.app(), source, target)

    produce(source, [(f"k{i}", {"i": i}) for i in range(6)])
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    service = services(settings)
    with TestClient(app=create_app(service, token="secret")) as api:
        listed = api.get(f"/apps/{app.name}/outbox", params={"state": "published"})
        assert listed.status_code == 200, listed.text
        assert listed.json() == msgspec.to_builtins(service.outbox.outbox_list(app.name, "published"))
        assert len(listed.json()) == 6
        row_id = listed.json()[0]["row_id"]
        shown = api.get(f"/apps/{app.name}/outbox/{row_id}")
        assert shown.status_code == 200 and shown.json()["row_id"] == row_id
        assert api.get(f"/apps/{app.name}/outbox/{row_id.split(':')[0]}:999").status_code == 404
        assert api.get(f"/apps/{app.name}/outbox", params={"state": "lost"}).status_code == 422
        body = {"ids": [row_id], "dry_run": True}
        assert api.post(f"/apps/{app.name}/outbox/replay", json=body).status_code == 401
        dry = api.post(
            f"/apps/{app.name}/outbox/replay", json=body, headers={"Authorization": "Bearer secret"}
        )
        assert dry.status_code == 200 and dry.json()["selected"] == [row_id] and dry.json()["dry_run"]


def test_published_rows_are_pruned_after_the_retention_and_metrics_count_the_outbox(
    services: Callable[[Settings], Service],
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    import urllib.request

    source, target = make_topic(1), make_topic(2)
    app = forwarding_app(names.app(), source, target)

    produce(source, [(f"k{i}", {"i": i}) for i in range(40)])
    settings = make_settings(PSPF_OUTBOX_RETENTION_S=0.5, PSPF_METRICS_PORT=0)
    service = services(settings)
    worker = Worker(app, settings)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: sum(rclient.xlen(stream_key(target, p)) for p in range(2)) == 40, 20)
        address = None
        while address is None:
            address = worker.metrics_address
        host, port = address

        def metrics() -> str:
            return str(urllib.request.urlopen(f"http://{host}:{port}/metrics").read().decode())

        # The rows are marked published once the relay reads its calls' replies: the next cycle.
        wait_for(lambda: f'pspf_outbox_published_total{{app="{app.name}"}} 40.0' in metrics(), 10)
        text = metrics()
        assert "pspf_outbox_publish_latency_seconds_count" in text
        # Published rows go once they are older than the retention, from the store and the backup.
        wait_for(lambda: service.outbox.outbox_list(app.name) == [], 20)
        text = metrics()
        assert f'pspf_outbox_rows{{app="{app.name}",partition="0",state="published"}} 0.0' in text
    finally:
        worker.stop()
        thread.join()
    with open_store(settings.state.engine, settings.state.dir, app.name, 0, readonly=True) as store:
        assert rows_in_store(store, app.name, 0) == []
    # One sequence record per producer on each target partition, whatever was published.
    assert {rclient.hlen(producers_key(target, p)) for p in range(2)} == {1}
