"""Operating tables: ``pspf lag`` showing how far each worker's global tables are behind (with the
worker's metric)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner, Result
from litestar.testing import TestClient

from pspf import App, Context, Settings, Worker, membership
from pspf.admin_api import create_app
from pspf.cli import cli
from pspf.keys import partition_for, stream_key
from pspf.service import Service
from tests.conftest import Names
from tests.integration.test_metrics import scrape, total
from tests.support import wait_until

pytestmark = pytest.mark.integration


def xadd(rclient: redis.Redis, topic: str, partitions: int, key: str, value: Any) -> bytes:
    stream = stream_key(topic, partition_for(key.encode(), partitions))
    return bytes(rclient.xadd(stream, {b"key": key.encode(), b"value": msgspec.json.encode(value)}))


@pytest.fixture
def invoke(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    """``pspf ARGS`` in-process against the test server; no state dir unless an argument names one."""
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR", "PSPF_STORE"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> Result:
        return CliRunner().invoke(cli, list(args), env={"PSPF_BROKER": redis_url})

    return run


@pytest.fixture
def api(service: Service) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(service, token=None)) as client:
        yield client


def test_lag_shows_each_workers_global_tables_behind_and_its_metric(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
    invoke: Callable[..., Result],
    api: TestClient[Any],
    service: Service,
    running: Callable[[Worker], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that waits keeps the worker from following: the entries added meanwhile are behind."""
    monkeypatch.setattr(membership, "GLOBAL_LAG_EVERY_S", 0.2)
    orders, products = make_topic(2), make_topic(2)
    xadd(rclient, products, 2, "p1", {"price": 1})
    entered, release = threading.Event(), threading.Event()
    app = App(names.app())
    app.global_table(products)

    @app.handler(orders)
    def order(value: dict[str, Any], ctx: Context) -> None:
        entered.set()
        assert release.wait(30)

    # Lease rounds every 2 s: the wait below outlasts one, so a round comes before the next read.
    worker = Worker(app, make_settings(PSPF_LEASE_TTL_MS=6000, PSPF_METRICS_PORT=0))
    running(worker)
    address = wait_until(lambda: worker.metrics_address, 10, "the metrics server")

    def behind() -> dict[str, int] | None:
        members = service.lag(app.name).members
        return members[0].global_tables if members else None

    assert wait_until(behind, 10, "the worker's first count") == {products: 0}
    xadd(rclient, orders, 2, "c1", {"n": 1})
    assert entered.wait(10)
    for n in range(4):
        xadd(rclient, products, 2, f"p{n}", {"price": n})
    time.sleep(2.2)
    release.set()
    wait_until(lambda: behind() == {products: 4}, 10, "4 entries behind")
    assert total(scrape(address), "pspf_global_table_lag_entries", table=products) == 4
    member = service.lag(app.name).members[0].id
    shown = invoke("lag", app.name)
    assert shown.exit_code == 0, shown.output
    assert [member, products, "4"] in [line.split() for line in shown.output.splitlines()]
    assert api.get(f"/apps/{app.name}/lag").json()["members"][0]["global_tables"] == {products: 4}

    # The worker follows the table again: nothing behind, in the lag and the metric.
    wait_until(lambda: behind() == {products: 0}, 10, "nothing behind")
    assert total(scrape(address), "pspf_global_table_lag_entries", table=products) == 0
