"""What `pspf state export` writes: the app's state by default, its internal namespaces with --all.

The app's state is what its code wrote or declared: state values, open windows, table rows,
scheduled callbacks and the time they run on. The bookkeeping (outbox, consumers, retries, ...)
comes only with ``--all``. Both kinds of export import again: a complete one as it is; one of
the app's state only keeps the partitions' bookkeeping from their backups.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import App, Context, Settings, Worker, windows
from pspf.cli import cli
from pspf.keys import stream_key
from pspf.state_stores import open_store
from tests.conftest import Names
from tests.integration.test_tables import xadd

pytestmark = pytest.mark.integration

PARTITIONS = 2
KEYS = 10
#: the namespaces of the app's state: what a default export writes, and nothing else
APP_STATE = {"state", "__windows", "__tables", "__schedules", "__time"}
#: bookkeeping this app's run leaves, which only --all exports
INTERNAL = {"__outbox", "__outbox_meta", "__consumers"}


class Topics:
    def __init__(self, make_topic: Callable[[int], str]) -> None:
        self.orders, self.clicks, self.customers = (make_topic(PARTITIONS) for _ in range(3))
        self.out = make_topic(1)


def make_app(name: str, topics: Topics) -> App:
    """State per key, a table, a daily window, a schedule 30 days ahead and an emit per order."""
    app = App(name)
    app.table(topics.customers)

    @app.handler(topics.orders)
    def order(value: dict[str, int], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + value["n"]
        ctx.emit(topics.out, {"key": ctx.key, "n": value["n"]}, key=ctx.key)
        ctx.schedule(timedelta(days=30), "remind")

    @app.on_schedule("remind")
    def remind(payload: Any, ctx: Context) -> None:
        ctx.state["reminded"] = True

    @app.window(topics.clicks, windows.tumbling(timedelta(days=1)), timestamp="ts", emit_to=topics.out)
    def clicks(total: int | None, value: dict[str, Any]) -> int:
        return (total or 0) + 1

    return app


def run_app(
    name: str, topics: Topics, rclient: redis.Redis, produce: Callable[..., int], settings: Settings
) -> None:
    for c in range(4):
        xadd(rclient, topics.customers, PARTITIONS, f"c{c}", {"tier": "gold"})
    produce(topics.orders, [(f"k{i % KEYS}", {"n": i}) for i in range(100)])
    # Tomorrow's first seconds: one open window per user (the orders' times are earlier).
    day = 86_400_000
    tomorrow = (time.time_ns() // 1_000_000 // day + 1) * day
    produce(topics.clicks, [(f"u{i % 3}", {"ts": tomorrow + i}) for i in range(30)])
    Worker(make_app(name, topics), settings).run(until_idle=True)


@pytest.fixture(autouse=True)
def broker(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command of these tests talks to the test server."""
    monkeypatch.setenv("PSPF_BROKER", redis_url)


def pspf(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def lines_of(result: Result) -> list[dict[str, Any]]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def namespaces(lines: list[dict[str, Any]]) -> Counter[str]:
    return Counter(line["namespace"] for line in lines if line["kind"] == "value")


def test_export_writes_the_apps_state_by_default_and_the_internal_namespaces_with_all(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    names: Names,
) -> None:
    topics, app = Topics(make_topic), names.app()
    run_app(app, topics, rclient, produce, make_settings())
    assert rclient.xlen(stream_key(topics.out, 0)) == 100  # the emits were published

    default = lines_of(pspf("state", "export", app))
    found = namespaces(default)
    assert set(found) == APP_STATE, found
    # The count of lines: per partition its checkpoints, then the keys' values, one open window
    # per clicking user, the table's rows, one schedule per key, and each partition's stream time.
    assert found == {
        "state": KEYS,
        "__windows": 3,
        "__tables": 4,
        "__schedules": KEYS,
        "__time": PARTITIONS,
    }
    assert len(default) == PARTITIONS + KEYS + 3 + 4 + KEYS + PARTITIONS
    checkpoints = [line for line in default if line["kind"] == "checkpoints"]
    assert [line["internal"] for line in checkpoints] == [False] * PARTITIONS

    everything = lines_of(pspf("state", "export", app, "--all"))
    found_all = namespaces(everything)
    assert set(found_all) >= INTERNAL, found_all
    assert {ns: n for ns, n in found_all.items() if ns in APP_STATE} == found
    assert [line for line in everything if line["kind"] == "value" and line["namespace"] in APP_STATE] == [
        line for line in default if line["kind"] == "value"
    ]
    assert all(line["internal"] for line in everything if line["kind"] == "checkpoints")

    one = lines_of(pspf("state", "export", app, "--partition", "1"))
    assert {line["partition"] for line in one} == {1} and set(namespaces(one)) <= APP_STATE


def store_rows(state_dir: Path, app: str) -> dict[int, dict[str, list[tuple[str, bytes]]]]:
    """Every namespace's rows of each partition's store under ``state_dir`` (none: the backup mark)."""
    rows: dict[int, dict[str, list[tuple[str, bytes]]]] = {}
    for p in range(PARTITIONS):
        with open_store("sqlite", state_dir, app, p, readonly=True) as store:
            found = {ns: list(store.items(ns)) for ns in (*APP_STATE, *INTERNAL, "__failures", "__dead")}
            rows[p] = {ns: items for ns, items in found.items() if items}
            rows[p]["checkpoints"] = sorted((t, str(c).encode()) for t, c in store.checkpoints().items())
    return rows


def test_both_exports_import_again_and_the_default_one_keeps_the_bookkeeping_of_the_backups(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    names: Names,
    tmp_path: Path,
) -> None:
    topics, app = Topics(make_topic), names.app()
    run_app(app, topics, rclient, produce, make_settings(PSPF_STATE_DIR=str(tmp_path / "a")))
    source = store_rows(tmp_path / "a", app)
    assert set(source[0]) | set(source[1]) >= INTERNAL
    (tmp_path / "all.ndjson").write_bytes(pspf("state", "export", app, "--all").stdout_bytes)
    (tmp_path / "app.ndjson").write_bytes(pspf("state", "export", app).stdout_bytes)
    expected = {f"k{k}": json.loads(pspf("state", "get", app, f"k{k}", "--json").output) for k in range(KEYS)}

    # With --all: every namespace as it was.
    complete = pspf(
        "state", "import", app, "--file", str(tmp_path / "all.ndjson"), "--state-dir", str(tmp_path / "b")
    )
    assert complete.exit_code == 0, complete.output
    assert "kept" not in complete.output
    assert store_rows(tmp_path / "b", app) == source
    for k, value in expected.items():
        got = pspf("state", "get", app, k, "--json", "--state-dir", str(tmp_path / "b"))
        assert json.loads(got.output) == value
    # The import dropped the backups; a worker on the imported stores uploads them again.
    Worker(make_app(app, topics), make_settings(PSPF_STATE_DIR=str(tmp_path / "b"))).run(until_idle=True)

    # The app's state only: the bookkeeping it lacks is kept from the partitions' backups.
    partial = pspf(
        "state", "import", app, "--file", str(tmp_path / "app.ndjson"), "--state-dir", str(tmp_path / "c")
    )
    assert partial.exit_code == 0, partial.output
    bookkeeping = sum(len(rows) for p in source.values() for ns, rows in p.items() if ns in INTERNAL)
    assert f"imported {2 * KEYS + 3 + 4 + PARTITIONS} values into 2 partitions" in partial.output
    assert f"kept {bookkeeping} values of bookkeeping from the backups" in partial.output
    assert store_rows(tmp_path / "c", app) == source
    for k, value in expected.items():
        got = pspf("state", "get", app, k, "--json", "--state-dir", str(tmp_path / "c"))
        assert json.loads(got.output) == value

    # That import dropped the backups: the same export a second time has no bookkeeping to keep.
    again = pspf(
        "state", "import", app, "--file", str(tmp_path / "app.ndjson"), "--state-dir", str(tmp_path / "d")
    )
    assert again.exit_code == 2 and "an import dropped it" in again.output, again.output

    # The imported state is live: the app goes on from it, its emits numbered after the old ones.
    produce(topics.orders, [("k1", {"n": 1000})])
    Worker(make_app(app, topics), make_settings(PSPF_STATE_DIR=str(tmp_path / "c"))).run(until_idle=True)
    assert (
        json.loads(pspf("state", "get", app, "k1", "--json").output)["total"]
        == expected["k1"]["total"] + 1000
    )
    assert rclient.xlen(stream_key(topics.out, 0)) == 101


def test_an_export_of_the_apps_state_is_refused_where_the_backup_moved_on_and_imports_into_a_new_app(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    names: Names,
    tmp_path: Path,
) -> None:
    topics, app = Topics(make_topic), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    run_app(app, topics, rclient, produce, settings)
    (tmp_path / "app.ndjson").write_bytes(pspf("state", "export", app).stdout_bytes)
    produce(topics.orders, [(f"k{k}", {"n": 1}) for k in range(KEYS)])
    Worker(make_app(app, topics), settings).run(until_idle=True)

    refused = pspf(
        "state", "import", app, "--file", str(tmp_path / "app.ndjson"), "--state-dir", str(tmp_path / "b")
    )
    assert refused.exit_code == 2, refused.output
    message = refused.output.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert "--all" in message and "partition 0" in message, message

    # An app the server does not know has no bookkeeping to keep: the app's state alone.
    other = names.app()
    alone = pspf(
        "state", "import", other, "--file", str(tmp_path / "app.ndjson"), "--state-dir", str(tmp_path / "c")
    )
    assert alone.exit_code == 0, alone.output
    assert "kept" not in alone.output
    rows = store_rows(tmp_path / "c", other)
    assert {ns for p in rows.values() for ns in p} == APP_STATE | {"checkpoints"}
