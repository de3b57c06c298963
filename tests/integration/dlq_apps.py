"""An app whose handler rejects orders marked bad, until the fix is switched on."""

from __future__ import annotations

import os
from typing import Any

from pspf import App, Context, NonRetryableError


def make() -> App:
    app = App(os.environ["PSPF_TEST_APP"])

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: dict[str, Any], ctx: Context) -> None:
        if order.get("bad") and os.environ.get("PSPF_TEST_FIXED") != "1":
            raise NonRetryableError(f"order {order['n']} is marked bad")
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app
