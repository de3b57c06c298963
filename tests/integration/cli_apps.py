"""Apps the CLI tests run by module path; the topic comes from the environment."""

from __future__ import annotations

import os
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


def needs_arguments(name: str) -> App:
    return App(name)


def broken_factory() -> App:
    raise RuntimeError("database password missing")


not_an_app = 42
