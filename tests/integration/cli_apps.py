"""Apps the CLI tests run by module path; the topic comes from the environment."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pspf import App, Context


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
