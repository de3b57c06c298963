"""Apps the failure crash tests run in worker subprocesses (``pspf run tests.crash.apps_failures:...``).

Configured by environment variables, read when a factory is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_WORK_US``: microseconds of sleep per entry (``slow``), so entries stay pending.

Both apps keep ``{"count": entries, "total": sum of amounts}`` per key, the state the helpers of
``tests.crash.support`` check (``assert_exact``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pspf import App, Context


def count_and_total(value: dict[str, Any], ctx: Context) -> None:
    state = ctx.state
    state["count"] = state.get("count", 0) + 1
    state["total"] = state.get("total", 0) + value["amount"]


def killer() -> App:
    """Entries whose value has ``"kill": true`` SIGKILL the worker process inside the handler.

    The kill comes after the entry's state update, so only an uncommitted change is lost with it.
    """
    app = App(os.environ["PSPF_TEST_APP"])

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def handle(value: dict[str, Any], ctx: Context) -> None:
        count_and_total(value, ctx)
        if value.get("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is delivered before this returns

    return app


def slow() -> App:
    """Every entry sleeps ``PSPF_TEST_WORK_US`` microseconds: a big batch stays pending for long."""
    app = App(os.environ["PSPF_TEST_APP"])
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def handle(value: dict[str, Any], ctx: Context) -> None:
        count_and_total(value, ctx)
        if work_s:
            time.sleep(work_s)

    return app
