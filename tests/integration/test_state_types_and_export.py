"""Typed state, and moving state between engines with `pspf state export` / `import`."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner

from pspf import App, Context, Settings, Worker
from pspf.cli import cli
from pspf.errors import ConfigError, StateError
from pspf.keys import app_key, stream_key
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names

pytestmark = pytest.mark.integration


class Totals(msgspec.Struct):
    total: int = 0
    count: int = 0


def typed_app(name: str, topic: str) -> App:
    app = App(name, state_type=Totals)

    @app.handler(topic)
    def add(order: dict[str, int], ctx: Context) -> None:
        totals = ctx.state.get("totals", Totals())
        assert isinstance(totals, Totals)  # typed on the way out of the store too
        totals.total += order["amount"]
        totals.count += 1
        ctx.state["totals"] = totals

    return app


def test_typed_state_round_trips_and_a_mismatch_names_the_key(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(2)
    produce(topic, [(f"u{i % 10}", {"amount": i}) for i in range(500)])
    app = typed_app(names.app(), topic)
    settings = make_settings(PSPF_STORE="rocksdb")
    assert Worker(app, settings).run(until_idle=True).handled == 500
    assert Service(settings).state_get(app.name, "u3") == {
        "totals": {"total": sum(i for i in range(500) if i % 10 == 3), "count": 50}
    }

    # The app changes its declared type; the stored values no longer match it.
    class Other(msgspec.Struct):
        name: str

    changed = App(app.name, state_type=Other)
    seen: list[BaseException] = []

    @changed.handler(topic)
    def read(order: dict[str, int], ctx: Context) -> None:
        try:
            ctx.state.get("totals")
        except StateError as exc:
            seen.append(exc)
            raise

    produce(topic, [("u3", {"amount": 1})])
    # The app records its state type: a worker of the changed app refuses to start, in one line.
    with pytest.raises(
        ConfigError, match=r"cannot read the state its stores hold \(\$\.name: the reader requires"
    ):
        Worker(changed, settings).run(until_idle=True)
    # A store from before state types were recorded: the mismatch shows when a key is read, naming it.
    rclient.hdel(app_key(app.name), "state_schemas")
    Worker(changed, settings).run(until_idle=True)
    assert seen and "stored state of key 'u3' does not match" in str(seen[0])


def test_export_from_sqlite_import_into_rocksdb_gives_equal_state(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    redis_url: str,
    names: Names,
    tmp_path: Path,
) -> None:
    topic = make_topic(4)
    produce(topic, [(f"u{i % 40}", {"amount": i}) for i in range(4_000)])
    app = typed_app(names.app(), topic)
    source = Settings.load(
        {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "a"), "PSPF_BLOCK_MS": 100}, environ={}
    )
    Worker(app, source).run(until_idle=True)
    runner = CliRunner()
    base = {"PSPF_BROKER": redis_url}

    exported = runner.invoke(cli, ["state", "export", app.name, "--state-dir", str(tmp_path / "a")], env=base)
    assert exported.exit_code == 0, exported.output
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    assert sum(1 for line in lines if line["kind"] == "checkpoints") == 4
    values = [line for line in lines if line["kind"] == "value"]
    assert sum(1 for line in values if line["namespace"] == "state") == 40 == len(values)
    # With --all, besides the state, each store's consumer history (one worker: one name).
    everything = runner.invoke(
        cli, ["state", "export", app.name, "--all", "--state-dir", str(tmp_path / "a")], env=base
    )
    assert everything.exit_code == 0, everything.output
    values = [line for line in map(json.loads, everything.stdout.splitlines()) if line["kind"] == "value"]
    assert sum(1 for line in values if line["namespace"] == "__consumers") == 4 == len(values) - 40
    (tmp_path / "state.ndjson").write_text(exported.stdout)

    # The app's state alone: each partition's consumer history is kept from its backup.
    target = ["--state-dir", str(tmp_path / "b"), "--store", "rocksdb"]
    imported = runner.invoke(
        cli, ["state", "import", app.name, "--file", str(tmp_path / "state.ndjson"), *target], env=base
    )
    assert imported.exit_code == 0, imported.output
    assert "imported 40 values into 4 partitions, kept 4 values of bookkeeping" in imported.output
    again = runner.invoke(
        cli, ["state", "import", app.name, "--file", str(tmp_path / "state.ndjson"), *target], env=base
    )
    assert again.exit_code == 2 and "already has state" in again.output

    for p in range(4):
        with (
            open_store("sqlite", tmp_path / "a", app.name, p, readonly=True) as a,
            open_store("rocksdb", tmp_path / "b", app.name, p, readonly=True) as b,
        ):
            assert a.checkpoints() == b.checkpoints()
            for namespace in ("state", "__consumers"):
                assert list(a.items(namespace)) == list(b.items(namespace))
    # The imported state is live: the app goes on from the checkpoints with the other engine.
    produce(topic, [("u1", {"amount": 5})])
    target_settings = Settings.load(
        {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "b"), "PSPF_STORE": "rocksdb"}, environ={}
    )
    assert Worker(app, target_settings).run(until_idle=True).handled == 1
    got = Service(target_settings).state_get(app.name, "u1")["totals"]
    assert got == {"total": sum(i for i in range(4_000) if i % 40 == 1) + 5, "count": 101}

    bad = runner.invoke(cli, ["state", "import", names.app(), *target], input="{not an export}\n", env=base)
    assert bad.exit_code == 2 and "line 1" in bad.output


@pytest.mark.parametrize("engine", ["sqlite", "rocksdb"])
def test_export_of_a_running_app_is_a_consistent_snapshot(
    engine: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic = make_topic(2)
    produce(topic, [(f"k{i % 7}", {"n": 1}) for i in range(20_000)])
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + value["n"]

    settings = make_settings(PSPF_STORE=engine, PSPF_BATCH_SIZE=50)
    worker = Worker(app, settings)
    thread = threading.Thread(target=worker.run, kwargs={"until_idle": True})
    thread.start()
    service = Service(settings)
    snapshots = 0
    try:
        while thread.is_alive() and snapshots < 20:
            try:
                lines = [msgspec.json.decode(line) for line in service.state.state_export(app.name)]
            except Exception:
                continue  # a store may not exist yet
            snapshots += 1
            by_partition: dict[int, Any] = {}
            counts: Counter[int] = Counter()
            for line in lines:
                if line["kind"] == "checkpoints":
                    by_partition[line["partition"]] = line["checkpoints"].get(topic)
                elif line["namespace"] == "state":
                    counts[line["partition"]] += line["state"]["n"]
            for partition, checkpoint in by_partition.items():
                applied = 0
                if checkpoint is not None:
                    applied = len(rclient.xrange(stream_key(topic, partition), "-", checkpoint))
                assert counts[partition] == applied, "the export mixes two commits"
    finally:
        thread.join(timeout=60)
    assert snapshots > 0


def test_reading_a_rocksdb_state_dir_as_sqlite_names_both_engines(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    redis_url: str,
    names: Names,
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    produce(topic, [(f"u{i % 10}", {"amount": i}) for i in range(50)])
    app = typed_app(names.app(), topic)
    state_dir = tmp_path / "rocks"
    Worker(app, make_settings(PSPF_STORE="rocksdb", PSPF_STATE_DIR=str(state_dir))).run(until_idle=True)
    env = {"PSPF_BROKER": redis_url}
    hint = f"no sqlite state for app {app.name!r}"
    for command in (["list", app.name], ["export", app.name], ["get", app.name, "u3"]):
        read = CliRunner().invoke(cli, ["state", *command, "--state-dir", str(state_dir)], env=env)
        assert read.exit_code == 4, (command, read.output)
        assert hint in read.output and "a rocksdb store is there: add --store rocksdb" in read.output, (
            read.output
        )
    right = ["state", "get", app.name, "u3", "--state-dir", str(state_dir), "--store", "rocksdb", "--json"]
    read = CliRunner().invoke(cli, right, env=env)
    assert read.exit_code == 0 and json.loads(read.output)["totals"]["count"] == 5, read.output
