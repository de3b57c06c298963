"""Operating tables: a row through ``pspf state get --table`` and the admin API, and ``pspf lag``
showing how far each worker's global tables are behind (with the worker's metric)."""

from __future__ import annotations

import json
import shutil
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

from pspf import App, Context, Settings, Worker
from pspf.admin_api import create_app
from pspf.cli import cli
from pspf.errors import NotFound
from pspf.keys import GLOBAL_TABLES_NAMESPACE, StreamId, partition_for, stream_key, table_key
from pspf.ownership import membership
from pspf.service import Service
from pspf.state_stores import open_globals_store
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


def error_line(result: Result, exit_code: int) -> str:
    """The one line a failed command prints; it must have exited with ``exit_code``."""
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def enrichment_app(name: str, orders: str, customers: str | None, products: str | None) -> App:
    app = App(name)
    if customers is not None:
        app.table(customers)
    if products is not None:
        app.global_table(products)

    @app.handler(orders)
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["orders"] = ctx.state.get("orders", 0) + 1

    return app


def test_a_table_row_from_the_backup_through_the_cli_and_the_admin_api(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
    invoke: Callable[..., Result],
    api: TestClient[Any],
) -> None:
    orders, customers = make_topic(2), make_topic(2)
    xadd(rclient, customers, 2, "c1", {"tier": "gold", "since": 2021})
    xadd(rclient, customers, 2, "c2", {"tier": "silver"})
    xadd(rclient, customers, 2, "c2", {"tier": "bronze"})
    xadd(rclient, customers, 2, "c3", {"tier": "gold"})
    xadd(rclient, customers, 2, "c3", None)  # deleted
    xadd(rclient, customers, 2, "c4", 7)  # a row need not be an object
    xadd(rclient, orders, 2, "c1", {"n": 1})
    app = enrichment_app(names.app(), orders, customers, None)
    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).handled == 7  # the table's entries too
    # Read from the backup in Redis: the stores here are gone.
    shutil.rmtree(settings.state.dir)

    got = invoke("state", "get", app.name, "c1", "--table", customers, "--json")
    assert got.exit_code == 0, got.output
    assert json.loads(got.output) == {"tier": "gold", "since": 2021}
    assert invoke("state", "get", app.name, "c2", "--table", customers).output == 'tier: "bronze"\n'
    assert invoke("state", "get", app.name, "c4", "--table", customers).output == "7\n"
    for key, row in [("c1", {"tier": "gold", "since": 2021}), ("c2", {"tier": "bronze"}), ("c4", 7)]:
        answer = api.get(f"/apps/{app.name}/tables/{customers}/{key}")
        assert answer.status_code == 200 and answer.json() == row

    deleted = error_line(invoke("state", "get", app.name, "c3", "--table", customers), 4)
    assert f"table {customers!r} of app {app.name!r} has no row for key 'c3'" in deleted
    missing = api.get(f"/apps/{app.name}/tables/{customers}/c3")
    assert missing.status_code == 404 and missing.json()["error"] in deleted

    unknown = error_line(invoke("state", "get", app.name, "c1", "--table", "nope"), 4)
    assert f"app {app.name!r} has no table 'nope'" in unknown and customers in unknown
    answer = api.get(f"/apps/{app.name}/tables/nope/c1")
    assert answer.status_code == 404 and "has no table 'nope'" in answer.json()["error"]
    # The service knows no more than Redis holds: a topic the app reads has rows or none.
    assert "no row for key 'c9'" in api.get(f"/apps/{app.name}/tables/{orders}/c9").json()["error"]

    never = error_line(invoke("state", "get", "never-ran", "c1", "--table", customers), 4)
    assert "never-ran" in never
    assert "invalid table name" in error_line(invoke("state", "get", app.name, "c1", "--table", "a/b"), 2)
    both = invoke("state", "get", app.name, "c1", "--table", customers, "--window")
    assert both.exit_code == 2 and "--window or --table" in both.output


def test_a_global_table_row_is_read_from_a_workers_store_under_the_state_dir(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
    invoke: Callable[..., Result],
    tmp_path: Path,
) -> None:
    orders, products = make_topic(2), make_topic(3)
    xadd(rclient, products, 3, "p1", {"price": 3})
    xadd(rclient, products, 3, "p2", {"price": 5})
    xadd(rclient, products, 3, "p2", None)
    xadd(rclient, orders, 2, "c1", {"n": 1})
    app = enrichment_app(names.app(), orders, None, products)
    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).handled == 1
    state_dir, elsewhere = str(settings.state.dir), str(tmp_path / "elsewhere")

    def row(key: str, where: str, *more: str) -> Result:
        return invoke("state", "get", app.name, key, "--table", products, "--state-dir", where, *more)

    got = row("p1", state_dir, "--json")
    assert got.exit_code == 0, got.output
    assert json.loads(got.output) == {"price": 3}
    gone = error_line(row("p2", state_dir), 4)
    assert f"global table {products!r} of app {app.name!r} has no row for key 'p2'" in gone
    # No worker runs: the app's record says it has this global table, which a typo is not.
    assert error_line(row("p1", elsewhere), 4) == (
        f"Error: {products!r} is a global table of app {app.name!r}: its rows are read from a worker's "
        f"store of it, and none is under {elsewhere}: pass a worker's --state-dir "
        "(or run a worker with this one)"
    )
    typo = invoke("state", "get", app.name, "p1", "--table", "nope", "--state-dir", state_dir)
    assert error_line(typo, 4) == (
        f"Error: app {app.name!r} has no table 'nope': it is none of the app's topics ({orders}) "
        f"nor of its global tables ({products})"
    )

    # Workers sharing the state dir hold a copy each: the one that read furthest answers.
    with (
        open_globals_store("sqlite", state_dir, app.name),  # the worker's: the next one is another
        open_globals_store("sqlite", state_dir, app.name) as copy,
        copy.transaction() as tx,
    ):
        tx.set_checkpoint(f"{products}/0", StreamId(2**50, 0))
        tx.put(GLOBAL_TABLES_NAMESPACE, {table_key(products, "p1"): msgspec.msgpack.encode({"price": 4})})
    assert json.loads(row("p1", state_dir, "--json").output) == {"price": 4}


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
    tmp_path: Path,
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
        try:
            members = service.apps.lag(app.name).members
        except NotFound:  # the worker serves its metrics before it registers the app
            return None
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
    member = service.apps.lag(app.name).members[0].id
    shown = invoke("lag", app.name)
    assert shown.exit_code == 0, shown.output
    assert [member, products, "4"] in [line.split() for line in shown.output.splitlines()]
    assert api.get(f"/apps/{app.name}/lag").json()["members"][0]["global_tables"] == {products: 4}

    # The worker follows the table again: nothing behind, in the lag and the metric.
    wait_until(lambda: behind() == {products: 0}, 10, "nothing behind")
    assert total(scrape(address), "pspf_global_table_lag_entries", table=products) == 0

    # A running worker follows it: the admin API, started with its state dir, reads its store.
    held = api.get(f"/apps/{app.name}/tables/{products}/p1")
    assert held.status_code == 200 and held.json() == {"price": 1}
    elsewhere = str(tmp_path / "elsewhere")
    here = error_line(
        invoke("state", "get", app.name, "p1", "--table", products, "--state-dir", elsewhere), 4
    )
    assert here == (
        f"Error: {products!r} is a global table of app {app.name!r}: its rows are read from a worker's "
        f"store of it, and none is under {elsewhere}: pass a worker's --state-dir"
    )
