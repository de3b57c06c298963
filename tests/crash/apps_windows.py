"""The windowed app the crash tests run in worker subprocesses (``pspf run tests.crash.apps_windows:counts``).

Tumbling one-minute windows with a grace of ten seconds over the ``ts`` field (epoch ms) of each
entry: each window's result is the number of the key's entries in it, emitted to the target when
the window closes (the same app as ``tests.integration.test_windows``' ``counting_app``).

Configured by environment variables, read when ``counts`` is called:

- ``PSPF_TEST_TOPIC``, ``PSPF_TEST_APP``: the topic to read and the app (consumer group) name;
- ``PSPF_TEST_TARGET``: the topic the results go to;
- ``PSPF_TEST_WORK_US``: microseconds of busy work per entry, so kills land mid-stream;
- ``PSPF_TEST_SUMS``: where ``shared``'s second window sends its results.

``shared`` is a handler and two windows on the topic, each entry one attempt for the three
(``tests.integration.cli_apps.counts_and_sums``: the same window ``count``, a hopping sum, and the
handler counting each key's clicks in its state).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import msgspec

from pspf import App, windows
from tests.integration.cli_apps import counts_and_sums

MINUTE = timedelta(minutes=1)
GRACE = timedelta(seconds=10)


class Click(msgspec.Struct):
    ts: int


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def counts() -> App:
    app = App(os.environ["PSPF_TEST_APP"])
    work_s = int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6

    @app.window(
        os.environ["PSPF_TEST_TOPIC"],
        windows.tumbling(MINUTE, grace=GRACE),
        timestamp="ts",
        emit_to=os.environ["PSPF_TEST_TARGET"],
    )
    def count(total: int | None, click: Click) -> int:
        if work_s:
            _busy(work_s)
        return (total or 0) + 1

    return app


def shared() -> App:
    return counts_and_sums(
        os.environ["PSPF_TEST_APP"],
        os.environ["PSPF_TEST_TOPIC"],
        os.environ["PSPF_TEST_TARGET"],
        os.environ["PSPF_TEST_SUMS"],
        work_s=int(os.environ.get("PSPF_TEST_WORK_US", "0")) / 1e6,
    )
