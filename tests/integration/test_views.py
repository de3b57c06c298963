"""Views against a real server: the key holds what the committed batches wrote, and goes with the app."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.cli import cli
from pspf.errors import ConfigError
from pspf.service import Service
from pspf.worker import RunSummary
from tests.conftest import Names

pytestmark = pytest.mark.integration


def _app(name: str, topic: str, totals: str, board: str) -> App:
    app = App(name)
    app.view(totals)
    app.view(board, kind="zset")

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        state = ctx.state
        state["total"] = state.get("total", 0) + order["amount"]
        if order["amount"] == 0:  # a zero order closes the account: gone from the views
            del ctx.view(totals)[ctx.key]
            ctx.view(board).remove(ctx.key)
        else:
            ctx.view(totals)[ctx.key] = state["total"]
            ctx.view(board).add(ctx.key, state["total"])
        if order["amount"] < 0:
            raise ValueError("refunds go elsewhere")

    return app


def test_a_view_equals_the_state_export_and_app_delete_removes_it(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app_name = make_topic(3), names.app()
    totals, board = f"shop:{app_name}:totals", f"{{{app_name}}}:board"
    orders = [(f"u{i % 17}", {"amount": (i % 5) + 1}) for i in range(600)]
    orders += [("u3", {"amount": 0}), ("u4", {"amount": -2})]  # u3 closed; u4's refund fails to the DLQ
    produce(topic, orders)
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "state"), PSPF_MAX_RETRIES=1)

    Worker(_app(app_name, topic, totals, board), settings).run(until_idle=True)

    service = Service(settings)
    lines = [json.loads(line) for line in service.state.state_export(app_name)]
    exported = {line["key"]: line["state"]["total"] for line in lines if line.get("namespace") == "state"}
    expected = {f"u{k}": sum((i % 5) + 1 for i in range(600) if i % 17 == k) for k in range(17)}
    assert exported == expected
    held = {k.decode(): json.loads(v) for k, v in rclient.hgetall(totals).items()}
    assert held == {k: v for k, v in exported.items() if k != "u3"}
    scores = {m.decode(): s for m, s in rclient.zrange(board, 0, -1, withscores=True)}
    assert scores == {k: float(v) for k, v in exported.items() if k != "u3"}

    result = CliRunner().invoke(cli, ["app", "delete", app_name, "--broker", redis_url, "--yes"])
    assert result.exit_code == 0, result.output
    assert not rclient.exists(totals) and not rclient.exists(board)
    service.close()


def test_a_view_whose_key_holds_another_type_stops_the_worker_before_it_reads(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app_name = make_topic(1), names.app()
    taken = f"{app_name}:list"
    rclient.rpush(taken, "someone else's")
    produce(topic, [("u1", {"amount": 1})])
    with pytest.raises(ConfigError, match=f"view '{taken}': the key holds a list, not a hash"):
        Worker(_app(app_name, topic, taken, f"{app_name}:board"), make_settings()).run(until_idle=True)
    assert rclient.lrange(taken, 0, -1) == [b"someone else's"]


def test_a_chain_writes_a_view_readable_by_any_client(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app_name = make_topic(2), names.app()
    latest = f"{app_name}:latest-item"
    app = App(app_name)
    app.view(latest)
    app.stream(topic).filter(lambda o: o["qty"] > 0).to_view(latest, field="user", value="item")
    produce(
        topic, [(f"u{i % 4}", {"user": f"u{i % 4}", "item": f"item-{i}", "qty": i % 3}) for i in range(40)]
    )

    Worker(app, make_settings()).run(until_idle=True)

    last_kept = {f"u{i % 4}": f"item-{i}" for i in range(40) if i % 3 > 0}
    assert {k.decode(): v.decode() for k, v in rclient.hgetall(latest).items()} == last_kept


def test_a_worker_stopped_mid_stream_writes_its_views_before_it_lets_its_partitions_go(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, app_name = make_topic(2), names.app()
    totals = f"{app_name}:totals"
    app = App(app_name)
    app.view(totals)

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        time.sleep(0.0002)  # slow enough to be stopped halfway
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.view(totals)[ctx.key] = ctx.state["total"]

    produce(topic, [(f"u{i % 200}", {"amount": 1}) for i in range(20_000)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "state"))
    worker = Worker(app, settings)
    done: list[RunSummary] = []
    thread = threading.Thread(target=lambda: done.append(worker.run()), daemon=True)
    thread.start()
    time.sleep(1.5)
    worker.stop()
    thread.join(30)
    assert done and 0 < done[0].handled < 20_000, "stopped halfway"

    service = Service(settings)
    lines = [json.loads(line) for line in service.state.state_export(app_name)]
    service.close()
    state = {line["key"]: line["state"]["total"] for line in lines if line.get("namespace") == "state"}
    assert sum(state.values()) == done[0].handled
    held = {k.decode(): json.loads(v) for k, v in rclient.hgetall(totals).items()}
    assert held == state


def test_a_batch_keeps_the_view_writes_of_the_entries_that_returned_async_and_past_a_deadline(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """In one batch: failing entries' writes are cut out between those of entries that returned.

    An async handler's chains run at once; a sync handler past its deadline runs on and writes
    after it: neither reaches the view.
    """
    async_topic, sync_topic, app_name = make_topic(1), make_topic(1), names.app()
    view = f"{app_name}:seen"
    late = threading.Event()
    app = App(app_name)
    app.view(view)

    @app.handler(async_topic, non_retryable=(ValueError,))
    async def seen_async(order: dict[str, Any], ctx: Context) -> None:
        ctx.view(view)[f"a:{order['n']}"] = order["n"]
        await asyncio.sleep(0)  # the other keys' chains run here
        if order["n"] % 7 == 3:
            raise ValueError("unlucky")
        ctx.view(view)[f"a:{order['n']}:done"] = 1

    deadline = RetryPolicy(timeout_ms=50, max_retries=1, base_delay_ms=1)

    @app.handler(sync_topic, non_retryable=(ValueError,), retry=deadline)
    def seen_sync(order: dict[str, Any], ctx: Context) -> None:
        ctx.view(view)[f"s:{order['n']}"] = order["n"]
        if order["n"] == 5:  # past its deadline: its attempt fails, the function runs on
            time.sleep(0.1)
            ctx.view(view)["s:late"] = 1
            late.set()
        elif order["n"] % 7 == 3:
            raise ValueError("unlucky")
        elif order["n"] > 5:
            time.sleep(0.002)  # the batch is still running when the late write happens

    produce(async_topic, [(f"k{n % 4}", {"n": n}) for n in range(60)])
    produce(sync_topic, [(f"k{n % 4}", {"n": n}) for n in range(120)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "state"), PSPF_BATCH_SIZE=500)

    Worker(app, settings).run(until_idle=True)

    assert late.wait(5)
    held = {k.decode() for k in rclient.hgetall(view)}
    ok_async = [n for n in range(60) if n % 7 != 3]
    ok_sync = [n for n in range(120) if n % 7 != 3 and n != 5]
    assert held == {f"a:{n}" for n in ok_async} | {f"a:{n}:done" for n in ok_async} | {
        f"s:{n}" for n in ok_sync
    }


def test_view_values_reach_redis_exactly_whatever_their_type_and_count(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Ints beyond a double's exact range and at a store row's 64-bit edges, scores needing 17
    digits, JSON, bytes that are not UTF-8, and a batch of thousands of fields."""
    topic, app_name = make_topic(1), names.app()
    kept, board, raw = f"{app_name}:kept", f"{app_name}:board", f"{app_name}:raw"
    raw_board = f"{app_name}:raw-board"
    values: dict[str, Any] = {
        "small": 42,
        "neg": -7,
        "edge": 2**53,
        "nedge": -(2**53),
        "big": 2**53 + 1,
        "huge": -(10**30),
        "top": 2**63 - 1,
        "past": 2**63,
        "bottom": -(2**63),
        "below": -(2**63) - 1,
        "text": "héllo",
        "utf8": b"ok",
        "json": {"a": [1, 2.5]},
        "float": 0.1,
        "bool": True,
        "gone": "x",
    }
    scores = {"third": 1 / 3, "large": 1e300, "neg": -0.5, "int": 2**53 + 1, "inf": float("inf"), "gone": 1}
    app = App(app_name)
    app.view(kept)
    app.view(board, kind="zset")
    app.view(raw)
    app.view(raw_board, kind="zset")

    @app.handler(topic)
    def write(order: dict[str, Any], ctx: Context) -> None:
        n = order["n"]
        if n == 0:
            for field, value in values.items():
                ctx.view(kept)[field] = value
            for member, score in scores.items():
                ctx.view(board).add(member, score)
            ctx.view(raw)[b"\xff-field"] = b"\x00\xfe"
            ctx.view(raw)["text"] = "plain"
            ctx.view(raw_board).add(b"\xfe-member", 1.5)
            ctx.view(raw_board).add("text", 2)
        elif n == 1:
            del ctx.view(kept)["gone"]
            ctx.view(board).remove("gone")
        else:
            ctx.view(kept)[f"many:{n}"] = n

    many = 8_000
    produce(topic, [("k", {"n": n}) for n in range(many)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "state"), PSPF_BATCH_SIZE=10_000)

    Worker(app, settings).run(until_idle=True)

    held = {k.decode(): v.decode() for k, v in rclient.hgetall(kept).items()}
    assert {k: v for k, v in held.items() if not k.startswith("many:")} == {
        "small": "42",
        "neg": "-7",
        "edge": str(2**53),
        "nedge": str(-(2**53)),
        "big": str(2**53 + 1),
        "huge": str(-(10**30)),
        "top": str(2**63 - 1),
        "past": str(2**63),
        "bottom": str(-(2**63)),
        "below": str(-(2**63) - 1),
        "text": "héllo",
        "utf8": "ok",
        "json": '{"a":[1,2.5]}',
        "float": "0.1",
        "bool": "true",
    }
    assert {k: int(v) for k, v in held.items() if k.startswith("many:")} == {
        f"many:{n}": n for n in range(2, many)
    }
    assert {m.decode(): s for m, s in rclient.zrange(board, 0, -1, withscores=True)} == {
        member: float(score) for member, score in scores.items() if member != "gone"
    }
    assert rclient.hgetall(raw) == {b"\xff-field": b"\x00\xfe", b"text": b"plain"}
    assert rclient.zrange(raw_board, 0, -1, withscores=True) == [(b"\xfe-member", 1.5), (b"text", 2.0)]
