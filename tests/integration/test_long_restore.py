"""A takeover whose restore from the backup outlasts the lease TTL keeps its lease and goes on."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pspf import App, Context, Settings, Worker
from pspf.broker import Acknowledging
from pspf.partition import backup
from pspf.service import Service
from tests.conftest import Names

pytestmark = pytest.mark.integration


def test_a_restore_longer_than_the_lease_renews_it_and_the_takeover_completes(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = make_topic(1)
    produce(topic, [(f"k{i}", {"n": 1}) for i in range(600)])
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["count"] = ctx.state.get("count", 0) + value["n"]

    first = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_LEASE_TTL_MS=600, PSPF_CONSUMER="a")
    assert Worker(app, first).run(until_idle=True).handled == 600
    produce(topic, [("k0", {"n": 1})] * 10)

    # A new machine restores 600 values in pages of about 10, each page slow to read: about 2 s,
    # three lease TTLs.
    monkeypatch.setattr(backup, "CHUNK", 10)
    scan = Acknowledging.backup_values
    pages = 0

    def slow_scan(self: Acknowledging, *args: Any, **kwargs: Any) -> Iterator[list[tuple[bytes, bytes]]]:
        nonlocal pages
        for page in scan(self, *args, **kwargs):
            time.sleep(0.04)
            pages += 1
            yield page

    monkeypatch.setattr(Acknowledging, "backup_values", slow_scan)
    second = make_settings(PSPF_STATE_DIR=str(tmp_path / "b"), PSPF_LEASE_TTL_MS=600, PSPF_CONSUMER="b")
    summary = Worker(app, second).run(until_idle=True)

    assert pages >= 40  # the restore outlasted two lease TTLs at least
    assert summary.handled == 10
    local = Service(second, local_state=True)
    assert local.state_get(app.name, "k0") == {"count": 11}
    assert local.state_get(app.name, "k599") == {"count": 1}
