"""A worker's Prometheus metrics and health endpoint, scraped over HTTP while it runs."""

from __future__ import annotations

import json
import queue
import random
import re
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pspf import App, Context, Producer, Settings, Worker
from pspf.keys import REDRIVE_APP_HEADER, partition_for, stream_key
from pspf.service import Service
from tests.conftest import ROOT, Names, RedisServer, pspf_command, subprocess_env
from tests.integration.failures_support import WorkerThread
from tests.support import wait_until

pytestmark = pytest.mark.integration

Samples = dict[str, list[tuple[dict[str, str], float]]]


class Order(msgspec.Struct):
    n: int
    fail: bool = False


def order_app(name: str, topic: str) -> App:
    """Adds up ``n`` per key; an order marked ``fail`` fails every attempt."""
    app = App(name)

    @app.handler(topic)
    def add(order: Order, ctx: Context) -> None:
        if order.fail:
            raise RuntimeError(f"order {order.n} always fails")
        ctx.state["sum"] = ctx.state.get("sum", 0) + order.n

    return app


def get(address: tuple[str, int], path: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of a GET; 4xx and 5xx answers are returned, not raised."""
    url = f"http://{address[0]}:{address[1]}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def scrape(address: tuple[str, int]) -> Samples:
    """Every sample of ``/metrics`` by sample name, parsed the way Prometheus would."""
    status, content_type, body = get(address, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of a sample's values over the series matching ``labels``."""
    return sum(
        value for got, value in samples.get(name, []) if all(got.get(k) == v for k, v in labels.items())
    )


def health(address: tuple[str, int]) -> tuple[int, dict[str, Any]]:
    status, content_type, body = get(address, "/healthz")
    assert content_type == "application/json"
    return status, json.loads(body)


def scrape_when(address: tuple[str, int], name: str, value: float, timeout: float) -> Samples:
    """Scrape until the sum of ``name`` is ``value``; the samples then."""

    def check() -> Samples | None:
        samples = scrape(address)
        return samples if total(samples, name) == value else None

    samples: Samples = wait_until(check, timeout, f"{name} to reach {value}")
    return samples


def health_when(
    address: tuple[str, int], status: str, timeout: float, worker: WorkerThread
) -> dict[str, Any]:
    """Poll ``/healthz`` until it reports ``status`` (failing early if the worker died)."""

    def check() -> dict[str, Any] | None:
        worker.check()
        _, body = health(address)
        return body if body["status"] == status else None

    body: dict[str, Any] = wait_until(check, timeout, f"/healthz to say {status}")
    return body


def refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_counters_and_gauges_equal_what_the_worker_did(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
) -> None:
    topic, app_name = make_topic(2), names.app()
    app = order_app(app_name, topic)
    # 300 entries processed by a first run, then delivered again below the checkpoint.
    done = [(f"k{i % 40}", {"n": i}) for i in range(300)]
    assert produce(topic, done) == 300
    assert Worker(app, make_settings()).run(until_idle=True).handled == 300
    for partition in range(2):
        rclient.xgroup_setid(stream_key(topic, partition), app_name, "0")

    # 700 new ones: 20 always fail, 5 cannot be decoded, 10 were redriven for another app.
    kinds = ["fail"] * 20 + ["undecodable"] * 5 + ["other-app"] * 10 + ["ok"] * 665
    random.Random(7).shuffle(kinds)
    expected: dict[str, Counter[int]] = {kind: Counter() for kind in set(kinds)}
    # Batches of 100: the first reads hold only entries already done (nothing to commit).
    settings = make_settings(
        PSPF_MAX_RETRIES=3, PSPF_RETRY_BASE_MS=5, PSPF_METRICS_PORT=0, PSPF_BATCH_SIZE=100
    )
    with Producer(settings=settings) as producer:
        for i, kind in enumerate(kinds, start=300):
            key = f"k{i % 40}"
            expected[kind][partition_for(key.encode(), 2)] += 1
            if kind == "undecodable":
                producer.send(topic, {"n": "not a number"}, key=key)
            elif kind == "other-app":
                producer.send(topic, {"n": i}, key=key, headers={REDRIVE_APP_HEADER: "another-app"})
            else:
                producer.send(topic, {"n": i, "fail": kind == "fail"}, key=key)
    skipped_by_partition = Counter(partition_for(key.encode(), 2) for key, _ in done)

    with WorkerThread(app, settings) as running:
        address = wait_until(lambda: running.worker.metrics_address, 10, "the metrics server")
        assert address[0] == "127.0.0.1" and address[1] > 0

        def finished() -> Samples | None:
            running.check()
            samples = scrape(address)
            lag = samples.get("pspf_partition_lag_entries", [])
            drained = len(lag) == 2 and all(value == 0 for _, value in lag)
            done_all = total(samples, "pspf_entries_dead_lettered_total") == 25
            return samples if drained and done_all else None

        samples = wait_until(finished, 20, "every entry processed or dead-lettered")
        status, body = health(address)
        summary = running.stop()

    labels = {"app": app_name, "topic": topic}
    for p in range(2):
        part = {**labels, "partition": str(p)}
        fails, undecodable = expected["fail"][p], expected["undecodable"][p]
        assert total(samples, "pspf_entries_processed_total", **part) == expected["ok"][p]
        assert total(samples, "pspf_entries_skipped_total", **part) == (
            skipped_by_partition[p] + expected["other-app"][p]
        )
        assert total(samples, "pspf_entries_failed_total", **part) == 3 * fails + undecodable
        assert total(samples, "pspf_entries_retried_total", **part) == 2 * fails
        assert total(samples, "pspf_entries_dead_lettered_total", **part) == fails + undecodable
        assert total(samples, "pspf_partition_lag_entries", **part) == 0
        assert total(samples, "pspf_partition_pending_entries", **part) == 0
    assert total(samples, "pspf_entries_processed_total") == 665 == summary.handled
    assert total(samples, "pspf_entries_skipped_total") == 310 == summary.skipped
    assert total(samples, "pspf_entries_failed_total") == 65 == summary.failed
    assert total(samples, "pspf_entries_retried_total") == 40 == summary.retried
    assert total(samples, "pspf_entries_dead_lettered_total") == 25 == summary.dead_lettered
    assert sum(rclient.xlen(f"{stream_key(topic, p)}:dlq") for p in range(2)) == 25

    assert total(samples, "pspf_partitions_owned", app=app_name) == 2
    assert total(samples, "pspf_last_commit_timestamp_seconds", app=app_name) > 0
    assert total(samples, "pspf_batch_size_entries_count", app=app_name) > 0
    # Every entry was read at least once (the failing ones again for their retries).
    assert total(samples, "pspf_batch_size_entries_sum", app=app_name) >= 1000
    assert total(samples, "pspf_commit_duration_seconds_count", app=app_name) > 0
    assert total(samples, "pspf_ack_duration_seconds_count", app=app_name) > 0

    assert status == 200
    assert body["status"] == "ok" and body["partitions_owned"] == 2 and body["lag"] == 0
    assert body["last_commit_age_s"] is not None and body["last_commit_age_s"] >= 0
    assert refused(address), "the metrics server still listens after run returned"


def test_healthz_reports_a_stuck_ordered_retry_and_a_healthy_standby(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    topic, app_name = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1, "fail": True}), ("k", {"n": 2}), ("k", {"n": 3})])
    app = order_app(app_name, topic)
    # The first retry waits 5-10 s: no commit while three entries wait behind the failing one.
    stuck = make_settings(
        PSPF_METRICS_PORT=0,
        PSPF_MAX_RETRIES=10,
        PSPF_RETRY_BASE_MS=10_000,
        PSPF_STUCK_AFTER_S=0.3,
        PSPF_CONSUMER="first",
    )
    with WorkerThread(app, stuck) as owner:
        address = wait_until(lambda: owner.worker.metrics_address, 10, "the metrics server")
        health_when(address, "stuck", 10, owner)
        status, body = health(address)
        assert status == 503 and body["status"] == "stuck"
        assert body["partitions_owned"] == 1 and body["lag"] == 3
        assert body["last_commit_age_s"] >= 0.3  # the failed attempt was the last commit
        samples = scrape(address)
        assert total(samples, "pspf_entries_failed_total") == 1
        assert total(samples, "pspf_entries_retried_total") == 1
        assert total(samples, "pspf_entries_processed_total") == 0
        assert total(samples, "pspf_partition_pending_entries") == 3

        standby_settings = make_settings(PSPF_METRICS_PORT=0, PSPF_STUCK_AFTER_S=0.3, PSPF_CONSUMER="second")
        with WorkerThread(app, standby_settings) as standby:
            standby_address = wait_until(lambda: standby.worker.metrics_address, 10, "the standby's server")
            assert standby_address != address
            wait_until(lambda: scrape(standby_address).get("pspf_partitions_owned"), 10, "a scrape")
            status, body = health(standby_address)
            assert (status, body) == (
                200,
                {"status": "ok", "partitions_owned": 0, "last_commit_age_s": None, "lag": 0},
            )
            assert "pspf_partition_lag_entries" not in scrape(standby_address)
            assert health(address)[1]["status"] == "stuck"


def test_healthz_reports_a_lost_redis_and_its_return(own_server: RedisServer, tmp_path: Path) -> None:
    settings = Settings.load(
        {
            "PSPF_BROKER": own_server.url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": 100,
            "PSPF_LEASE_TTL_MS": 2000,
            "PSPF_METRICS_PORT": 0,
        },
        environ={},
    )
    Service(settings).create_topic("orders", 1)
    with Producer(settings=settings) as producer:
        for n in range(10):
            producer.send("orders", {"n": n}, key=f"k{n}")
    app = order_app("lost-redis", "orders")
    with WorkerThread(app, settings) as running:
        address = wait_until(lambda: running.worker.metrics_address, 10, "the metrics server")
        scrape_when(address, "pspf_entries_processed_total", 10, 10)
        status, body = health(address)
        assert status == 200 and body["status"] == "ok" and body["lag"] == 0
        assert body["partitions_owned"] == 1

        own_server.stop()
        health_when(address, "broker_unavailable", 10, running)
        status, body = health(address)
        assert status == 503 and body["status"] == "broker_unavailable" and body["lag"] is None
        samples = scrape(address)  # still answers, without what only Redis can say
        assert "pspf_partition_lag_entries" not in samples
        assert total(samples, "pspf_entries_processed_total") == 10

        own_server.start()
        health_when(address, "ok", 15, running)
        assert health(address)[0] == 200
        running.stop()


def test_pspf_run_serves_metrics_through_the_cli(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app_name = make_topic(2), names.app()
    produce(topic, [(f"u{i % 7}", {"amount": i}) for i in range(50)])
    env = subprocess_env(PSPF_TEST_APP=app_name, PSPF_TEST_TOPIC=topic, PSPF_METRICS_HOST="127.0.0.1")
    args = ["--broker", redis_url, "--state-dir", str(tmp_path / "state"), "--block-ms", "100"]
    proc = subprocess.Popen(
        pspf_command("run", "tests.integration.cli_apps:make", *args, "--metrics-port", "0"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr
    reader = threading.Thread(target=lambda: [lines.put(line.decode()) for line in stderr], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=20)
            seen.append(line)
            found = re.search(r"serving metrics on http://([\d.]+):(\d+)/metrics", line)
            if found:
                break
        address = (found.group(1), int(found.group(2)))
        assert address[0] == "127.0.0.1"
        samples = scrape_when(address, "pspf_entries_processed_total", 50, 20)
        assert total(samples, "pspf_partitions_owned", app=app_name) == 2
        assert total(samples, "pspf_entries_processed_total", app=app_name, topic=topic) == 50
        assert health(address)[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    stderr.close()
    while not lines.empty():
        seen.append(lines.get())
    assert any("processed 50 entries" in line for line in seen), "".join(seen)
