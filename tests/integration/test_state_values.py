"""State values PSPF could not read back: refused when a handler writes them, reported (never a
traceback) when `pspf state get/list/export` meet one already in a store."""

from __future__ import annotations

import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, NonRetryableError, Settings, Worker, errors
from pspf.keys import STATE_NAMESPACE, partition_for
from pspf.service import Service
from pspf.state_stores import open_store
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import dead_letters

pytestmark = pytest.mark.integration


def _pspf(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        pspf_command(*args), env=subprocess_env(**env), capture_output=True, text=True, timeout=120
    )


def _one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    return lines[0]


def test_a_write_the_app_cannot_read_back_fails_its_entry_once_and_the_key_goes_on(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    redis_url: str,
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(2), names.app()
    orders: list[tuple[str | None, dict[str, Any]]] = []
    for key, bad in [("u1", 1), ("u2", "b:x"), ("u3", "nested")]:
        orders += [(key, {"amount": 1}), (key, {"amount": 10, "state_key": bad}), (key, {"amount": 2})]
    orders.append(("u4", {"amount": 7}))
    produce(topic, orders)

    ran = _pspf(
        "run",
        "tests.integration.cli_apps:state_keys",
        "--until-idle",
        env={
            "PSPF_BROKER": redis_url,
            "PSPF_STATE_DIR": str(tmp_path / "state"),
            "PSPF_BLOCK_MS": "100",
            "PSPF_RETRY_BASE_MS": "20",
            "PSPF_TEST_APP": app,
            "PSPF_TEST_TOPIC": topic,
        },
    )
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr

    # The two entries that wrote a key of ctx.state that is not a string are dead-lettered after
    # ONE attempt; the one with int and bytes keys one level down is applied (the app reads it).
    dead = {record.key: record for record in dead_letters(rclient, topic, 2)}
    assert set(dead) == {"u1", "u2"}, {k: (r.error_type, r.message) for k, r in dead.items()}
    for key, bad_name in [("u1", "1 (int)"), ("u2", "b'x' (bytes)")]:
        record = dead[key]
        assert (record.error_type, record.attempts) == ("StateValueError", 1), record
        assert f"state of key {key!r}" in record.message and bad_name in record.message, record.message
        assert json.loads(record.original[b"value"])["amount"] == 10

    # The failed entry's writes were dropped; later entries of the same key applied normally.
    settings = Settings.load(
        {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state")}, environ={}
    )
    service = Service(settings)
    assert service.state_get(app, "u1") == {"total": 3, "count": 2}
    assert service.state_get(app, "u2") == {"total": 3, "count": 2}
    assert service.state_get(app, "u3") == {"total": 13, "count": 3, "nested": {"1": "one", "dHdv": 2}}
    assert service.state_get(app, "u4") == {"total": 7, "count": 1}
    assert issubclass(errors.StateValueError, errors.StateError)
    assert issubclass(errors.StateValueError, NonRetryableError)


def test_a_typed_app_refuses_a_value_its_state_type_rejects(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The check is the app's own read: a typed app's decoder also rejects nested int keys.

    A state msgspec cannot encode at all fails its entry the same way.
    """
    topic = make_topic(1)
    app = App(names.app(), state_type=dict[str, int])

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        totals = ctx.state.get("totals", {"total": 0})
        ctx.state["totals"] = {"total": totals["total"] + order["amount"]}
        if order.get("wrong") == "type":
            ctx.state["note"] = "a str where the type wants dict[str, int]"
        elif order.get("wrong") == "nested":
            ctx.state["by_day"] = {20261123: 1}
        elif order.get("wrong") == "object":
            ctx.state["by_day"] = {"today": object()}

    produce(
        topic,
        [
            ("k", {"amount": 1}),
            ("k", {"amount": 5, "wrong": "type"}),
            ("k", {"amount": 5, "wrong": "nested"}),
            ("k", {"amount": 5, "wrong": "object"}),
            ("k", {"amount": 2}),
        ],
    )
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)

    dead = dead_letters(rclient, topic, 1)
    messages = [d.message for d in dead]
    assert [(d.error_type, d.attempts) for d in dead] == [("StateValueError", 1)] * 3, messages
    assert "ctx.state['note']" in messages[0] and "ctx.state['by_day']" in messages[1]
    assert "state of key 'k' cannot be encoded" in messages[2]
    assert Service(settings).state_get(app.name, "k") == {"totals": {"total": 3}}


def test_state_get_list_export_report_a_stored_value_they_cannot_read(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    app = App(names.app())

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]

    produce(topic, [("a", {"amount": 1}), ("z", {"amount": 2})])
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    # Values written by hand (or by a version before the write-side check): not msgpack, not a
    # map, a map with an int key, and one that decodes but JSON cannot show (a None map key).
    unreadable = {
        "bad-bytes": b"\xc1",
        "bad-list": msgspec.msgpack.encode([1, 2]),
        "bad-int-key": msgspec.msgpack.encode({1: 2}),
        "bad-none-key": msgspec.msgpack.encode({"m": {None: 1}}),
    }
    assert {partition_for(k.encode(), 1) for k in unreadable} == {0}
    with open_store("sqlite", settings.state.dir, app.name, 0) as store:
        tx = store.transaction()
        for key, raw in unreadable.items():
            tx.set(STATE_NAMESPACE, key, raw)
        tx.commit()

    env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(settings.state.dir)}
    for key in unreadable:
        got = _pspf("state", "get", app.name, key, env=env)
        assert got.returncode == 5, got.stderr
        assert f"key {key!r}" in _one_error_line(got)
    good = _pspf("state", "get", app.name, "z", "--json", env=env)
    assert good.returncode == 0 and json.loads(good.stdout) == {"total": 2}, good.stderr

    listed = _pspf("state", "list", app.name, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == sorted(["a", "z", *unreadable])

    # Export goes on past them and keeps them exactly (state null, error why), so the export
    # is still complete; each is named on stderr.
    exported = _pspf("state", "export", app.name, env=env)
    assert exported.returncode == 0, exported.stderr
    assert "Traceback" not in exported.stderr, exported.stderr
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    values = {line["key"]: line for line in lines if line["kind"] == "value" and line["namespace"] == "state"}
    assert set(values) == {"a", "z", *unreadable}
    assert values["a"]["state"] == {"total": 1} and "error" not in values["a"]
    warnings = exported.stderr.strip().splitlines()
    assert len(warnings) == len(unreadable), exported.stderr
    for key, raw in unreadable.items():
        assert values[key]["state"] is None and values[key]["error"], values[key]
        assert base64.b64decode(values[key]["value"]) == raw
        assert sum(f"key {key!r}" in w for w in warnings) == 1, exported.stderr

    (tmp_path / "state.ndjson").write_text(exported.stdout)
    target = tmp_path / "imported"
    imported = _pspf(
        "state",
        "import",
        app.name,
        "--file",
        str(tmp_path / "state.ndjson"),
        "--state-dir",
        str(target),
        env=env,
    )
    assert imported.returncode == 0, imported.stderr
    with (
        open_store("sqlite", settings.state.dir, app.name, 0, readonly=True) as a,
        open_store("sqlite", target, app.name, 0, readonly=True) as b,
    ):
        assert list(a.items(STATE_NAMESPACE)) == list(b.items(STATE_NAMESPACE))
