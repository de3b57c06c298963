"""Apps the CLI tests run by module path; the topic comes from the environment."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import timedelta
from typing import Any

import msgspec

from pspf import App, Context, windows


def make() -> App:
    app = App(os.environ["PSPF_TEST_APP"])

    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    for topic in os.environ["PSPF_TEST_TOPIC"].split(","):  # one topic, or several
        app.handler(topic)(add)

    return app


def state_keys() -> App:
    """Orders that say ``"state_key"`` also write ``ctx.state`` under that key, maybe not a string.

    ``{"state_key": 1}`` writes ``ctx.state[1]``, ``{"state_key": "b:x"}`` ``ctx.state[b"x"]``,
    ``{"state_key": "nested"}`` a dict with int and bytes keys under the string key ``"nested"``.
    """
    app = App(os.environ["PSPF_TEST_APP"])

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        name = order.get("state_key")
        if name == "nested":
            ctx.state["nested"] = {1: "one", b"two": 2}
        elif isinstance(name, str) and name.startswith("b:"):
            ctx.state[name[2:].encode()] = order["amount"]
        elif name is not None:
            ctx.state[name] = order["amount"]

    return app


def needs_arguments(name: str) -> App:
    return App(name)


def broken_factory() -> App:
    raise RuntimeError("database password missing")


not_an_app = 42


def slow() -> App:
    """Orders that say ``"sleep_s"`` take that long; ``PSPF_TEST_ASYNC=1`` makes the handler async."""
    app = App(os.environ["PSPF_TEST_APP"])
    topic = os.environ["PSPF_TEST_TOPIC"]

    def count(ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    if os.environ.get("PSPF_TEST_ASYNC") == "1":

        @app.handler(topic)
        async def handle_async(order: dict[str, Any], ctx: Context) -> None:
            await asyncio.sleep(order.get("sleep_s", 0))
            count(ctx)

    else:

        @app.handler(topic)
        def handle(order: dict[str, Any], ctx: Context) -> None:
            time.sleep(order.get("sleep_s", 0))
            count(ctx)

    return app


#: Attempts per entry id of ``flaky`` (the CLI tests run it in their own process).
attempts: dict[str, int] = {}


def flaky() -> App:
    """Orders that say ``"fail": N`` fail their first N attempts; ``"fail": "always"`` every one."""
    app = App(os.environ["PSPF_TEST_APP"])

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: dict[str, Any], ctx: Context) -> None:
        attempts[ctx.id] = attempt = attempts.get(ctx.id, 0) + 1
        fail = order.get("fail", 0)
        if fail == "always" or attempt <= fail:
            raise RuntimeError(f"attempt {attempt} fails")
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


MINUTE = timedelta(minutes=1)
GRACE = timedelta(seconds=10)


class Click(msgspec.Struct):
    ts: int
    n: int = 1
    fail: bool = False


def counts_and_sums(
    name: str,
    topic: str,
    counts_to: str,
    sums_to: str,
    work_s: float = 0.0,
    handler: bool = True,
    total: bool = True,
) -> App:
    """A handler and two windows on one topic, each entry one attempt for the three.

    ``seen`` counts each key's clicks in ``ctx.state["count"]`` and raises for a click that says
    ``"fail": true``; window ``count`` counts them in tumbling minutes (to ``counts_to``), window
    ``total`` sums their ``n`` in two-minute windows every minute (to ``sums_to``, a value type of
    its own); both over the ``ts`` field with a grace of ten seconds. ``work_s``: busy work per
    entry (the crash tests' kills then land mid-stream). Without ``handler`` or ``total``, the
    app has not that one (with neither, the topic has one consumer, as it had to before).
    """
    app = App(name)

    @app.window(topic, windows.tumbling(MINUTE, grace=GRACE), timestamp="ts", emit_to=counts_to)
    def count(total: int | None, click: Click) -> int:
        return (total or 0) + 1

    def seen(click: Click, ctx: Context) -> None:
        if work_s:
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:
                pass
        if click.fail:
            raise ValueError(f"click {ctx.id} fails")
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    def add_n(acc: int | None, click: dict[str, Any]) -> int:
        return (acc or 0) + click.get("n", 1)

    if handler:
        app.handler(topic)(seen)
    if total:
        hopping = windows.hopping(2 * MINUTE, MINUTE, grace=GRACE)
        app.window(topic, hopping, timestamp="ts", emit_to=sums_to, name="total")(add_n)
    return app


def windowed() -> App:
    """``counts_and_sums`` on ``PSPF_TEST_TOPIC``, its results to ``PSPF_TEST_TARGET`` (both windows)."""
    target = os.environ["PSPF_TEST_TARGET"]
    return counts_and_sums(os.environ["PSPF_TEST_APP"], os.environ["PSPF_TEST_TOPIC"], target, target)


def clashing_windows() -> App:
    """Two windows named ``count``, on two topics."""
    app = App(os.environ["PSPF_TEST_APP"])

    @app.window("clicks", windows.tumbling(MINUTE), emit_to="counts")
    def count(acc: int | None, click: Any) -> int:
        return (acc or 0) + 1

    app.window("views", windows.tumbling(MINUTE), emit_to="counts")(count)
    return app


def enrich() -> App:
    """Orders (``PSPF_TEST_TOPIC``) looked up in a table (``PSPF_TEST_TABLE``): the customer's tier."""
    app = App(os.environ["PSPF_TEST_APP"])
    table = os.environ["PSPF_TEST_TABLE"]
    app.table(table)

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def order(value: dict[str, Any], ctx: Context) -> None:
        row = ctx.table(table)
        ctx.state["tier"] = None if row is None else row["tier"]

    return app


def misspelled_table() -> App:
    """Orders that look up ``custmers`` (a typo) while the app declares ``PSPF_TEST_TABLE``."""
    app = App(os.environ["PSPF_TEST_APP"])
    app.table(os.environ["PSPF_TEST_TABLE"])

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["tier"] = ctx.table("custmers")

    return app
