"""``pspf app reset``: a stopped app starts afresh at the start or the end of its topics, once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner, Result

from pspf import App, Context, Settings, Worker, windows
from pspf.cli import cli
from pspf.errors import NotFound
from pspf.keys import stream_key
from pspf.service import Service
from tests.conftest import Names
from tests.integration.failures_support import WorkerThread, summing_app
from tests.integration.test_tables import xadd
from tests.support import wait_until

pytestmark = pytest.mark.integration


def reset(redis_url: str, app: str, state_dir: Path, *args: str) -> Result:
    command = ["app", "reset", app, "--broker", redis_url, "--state-dir", str(state_dir), "--yes"]
    return CliRunner().invoke(cli, [*command, *args])


def totals(service: Service, app: str, keys: int) -> dict[str, Any]:
    return {f"k{k}": service.state_get(app, f"k{k}") for k in range(keys)}


def test_reset_to_start_rebuilds_the_state_once_whether_the_stores_are_here_or_elsewhere(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(2), names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{i % 5}", {"n": i}) for i in range(100)])
    expected = {f"k{k}": {"total": sum(range(k, 100, 5))} for k in range(5)}
    first = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    Worker(summing_app(app, topic), first).run(until_idle=True)
    assert totals(service, app, 5) == expected

    # The stores are elsewhere (dir a): the backups are reset, and dir a's stores restore from them.
    elsewhere = reset(redis_url, app, tmp_path / "empty", "--json")
    assert elsewhere.exit_code == 0, elsewhere.output
    report = json.loads(elsewhere.output)
    assert report["to"] == "start" and report["entries_to_process"] == 100
    assert report["state_reset"] is True and report["stores_here"] == []
    with pytest.raises(NotFound):  # the backup's state is gone
        service.state_get(app, "k0")
    summary = Worker(summing_app(app, topic), first).run(until_idle=True)
    assert summary.handled == 100
    assert totals(service, app, 5) == expected, "applied once more from an empty state: not doubled"

    # The stores are here: they are reset in place, and a third state dir restores the same.
    here = reset(redis_url, app, tmp_path / "a", "--json")
    assert here.exit_code == 0, here.output
    assert json.loads(here.output)["stores_here"] == [0, 1]
    third = make_settings(PSPF_STATE_DIR=str(tmp_path / "c"))
    assert Worker(summing_app(app, topic), third).run(until_idle=True).handled == 100
    assert totals(service, app, 5) == expected
    assert Worker(summing_app(app, topic), first).run(until_idle=True).handled == 0


def test_reset_to_end_keeping_the_state_skips_the_backlog_and_to_start_keeping_it_applies_again(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(2), names.app()
    service = Service(make_settings())
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    produce(topic, [(f"k{i % 5}", {"n": 1}) for i in range(50)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    produce(topic, [(f"k{i % 5}", {"n": 1000}) for i in range(30)])  # the backlog to skip

    dry = reset(redis_url, app, tmp_path / "a", "--to-end", "--keep-state", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["entries_skipped"] == 30
    skipped = reset(redis_url, app, tmp_path / "a", "--to-end", "--keep-state")
    assert skipped.exit_code == 0, skipped.output
    assert "30 unhandled entries skipped" in skipped.output and "the state was kept" in skipped.output
    produce(topic, [(f"k{i % 5}", {"n": 1}) for i in range(10)])
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 10
    assert totals(service, app, 5) == {f"k{k}": {"total": 12} for k in range(5)}

    # From the start, keeping the state: every entry still in the streams is applied again onto it.
    again = reset(redis_url, app, tmp_path / "a", "--keep-state", "--json")
    assert json.loads(again.output)["entries_to_process"] == 90
    Worker(summing_app(app, topic), make_settings(PSPF_STATE_DIR=str(tmp_path / "b"))).run(until_idle=True)
    assert totals(service, app, 5) == {f"k{k}": {"total": 12 + 12 + 6000} for k in range(5)}


def windowed_app(name: str, source: str, target: str) -> App:
    app = App(name)

    @app.window(source, windows.tumbling(timedelta(seconds=10)), timestamp="ts", emit_to=target)
    def count(total: int | None, value: dict[str, Any]) -> int:
        return (total or 0) + 1

    return app


@pytest.mark.parametrize("command", [["app", "reset"], ["replay", "--from-start"]])
def test_reset_to_start_deletes_windows_and_stream_time_so_the_same_windows_close_again(
    command: list[str],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    source, target, app = make_topic(1), make_topic(1), names.app()
    # 40 entries per key over 4 windows; the last entry's time closes the first three.
    produce(source, [(f"u{i % 2}", {"ts": i * 500}) for i in range(80)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))

    def emitted() -> Counter[tuple[str, int, int]]:
        found: Counter[tuple[str, int, int]] = Counter()
        for _, fields in rclient.xrange(stream_key(target, 0)):
            window = msgspec.json.decode(fields[b"value"])
            found[(window["key"], window["start"], window["value"])] += 1
        return found

    Worker(windowed_app(app, source, target), settings).run(until_idle=True)
    first = emitted()
    assert first and set(first.values()) == {1}
    args = [*command, app, "--broker", redis_url, "--state-dir", str(tmp_path / "a"), "--yes"]
    if command[0] == "replay":
        args += ["--topic", source]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    Worker(windowed_app(app, source, target), settings).run(until_idle=True)
    # Every window closed again with the same count: none late (stream time went too), none doubled.
    assert emitted() == Counter({window: 2 for window in first})


def test_reset_to_end_rebuilds_a_table_from_its_first_entry_before_the_new_entries(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    orders, customers, app_name = make_topic(2), make_topic(2), names.app()

    def make_app() -> App:
        app = App(app_name)
        app.table(customers)

        @app.handler(orders)
        def order(value: dict[str, Any], ctx: Context) -> None:
            row = ctx.table(customers)
            ctx.state["seen"] = [*ctx.state.get("seen", []), [value["n"], row and row["tier"]]]

        return app

    xadd(rclient, customers, 2, "c1", {"tier": "gold"})
    xadd(rclient, orders, 2, "c1", {"n": 1})
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    Worker(make_app(), settings).run(until_idle=True)
    service = Service(make_settings())
    assert service.state_get(app_name, "c1") == {"seen": [[1, "gold"]]}
    xadd(rclient, orders, 2, "c1", {"n": 2})  # skipped by the reset

    done = reset(redis_url, app_name, tmp_path / "a", "--to-end", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["tables_rebuilt"] == [customers] and report["entries_skipped"] == 1
    xadd(rclient, orders, 2, "c1", {"n": 3})
    Worker(make_app(), settings).run(until_idle=True)
    assert service.state_get(app_name, "c1") == {"seen": [[3, "gold"]]}


def test_reset_is_refused_while_the_app_runs_and_where_a_partitions_state_cannot_be_reached(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(1), names.app()
    produce(topic, [("k", {"n": 1})])
    with WorkerThread(summing_app(app, topic), make_settings()):
        wait_until(lambda: bool(rclient.exists(f"pspf:app:{{{app}}}:members")), 10, "the worker to join")
        wait_until(
            lambda: bool(
                rclient.xpending(stream_key(topic, 0), app)["pending"] == 0
                and rclient.xinfo_groups(stream_key(topic, 0))[0]["last-delivered-id"] != b"0-0"
            ),
            10,
            "the entry",
        )
        running = reset(redis_url, app, tmp_path / "x")
        assert running.exit_code == 6, running.output
        assert "stop it first" in running.output and "Traceback" not in running.output

    quiet, off = make_topic(1), names.app()
    produce(quiet, [("k", {"n": 1})])
    no_backup = make_settings(PSPF_STATE_DIR=str(tmp_path / "off"), PSPF_STATE_BACKUP="off")
    Worker(summing_app(off, quiet), no_backup).run(until_idle=True)
    elsewhere = reset(redis_url, off, tmp_path / "other")
    assert elsewhere.exit_code == 5, elsewhere.output
    assert "no state backup of partitions [0]" in elsewhere.output
    assert reset(redis_url, off, tmp_path / "off").exit_code == 0
    assert Worker(summing_app(off, quiet), no_backup).run(until_idle=True).handled == 1
