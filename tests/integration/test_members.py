"""The members of an app, as pspf lag, the service (so the admin API) and the metrics show them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from pspf import App, Context, Settings, Worker
from pspf.cli import cli
from pspf.service import Service
from tests.conftest import Names

pytestmark = pytest.mark.integration


def test_members_their_partitions_and_the_rebalance_metrics(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic = make_topic(4)
    app = App(names.app())

    @app.handler(topic)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    def worker(name: str) -> Worker:
        settings = make_settings(
            PSPF_CONSUMER=name,
            PSPF_STATE_DIR=str(tmp_path / name),
            PSPF_METRICS_PORT=0,
            PSPF_LEASE_TTL_MS=900,
        )
        found = Worker(app, settings)
        found.start()
        return found

    first = worker("first")
    first.lease_round.step()
    assert sorted(first.processor.owned) == [0, 1, 2, 3]
    second = worker("second")
    second.lease_round.step()
    assert not second.processor.owned  # it counts once it has been a member for a lease round
    time.sleep(0.35)
    first.lease_round.step()  # releases the newcomer's share
    second.lease_round.step()  # and the newcomer takes it
    assert len(first.processor.owned) == 2
    assert len(second.processor.owned) == 2 and not set(first.processor.owned) & set(second.processor.owned)
    try:
        service = Service(make_settings())
        members = service.apps.lag(app.name).members
        assert [m.consumer for m in members] == ["first", "second"]  # oldest first
        assert [m.partitions for m in members] == [
            sorted(first.processor.owned),
            sorted(second.processor.owned),
        ]
        assert all(m.since <= m.last_heartbeat for m in members)
        service.close()

        shown = CliRunner().invoke(cli, ["lag", app.name, "--broker", redis_url])
        assert shown.exit_code == 0, shown.output
        assert "MEMBER" in shown.output and first.membership.member in shown.output
        listed = CliRunner().invoke(cli, ["groups", "--broker", redis_url])
        assert "MEMBERS" in listed.output

        assert first.metrics is not None and second.metrics is not None
        sample = first.metrics.registry.get_sample_value
        assert sample("pspf_members", {"app": app.name}) == 2
        assert sample("pspf_rebalances_total", {"app": app.name}) == 2  # all four, then two
    finally:
        first.shutdown()
        second.shutdown()
    # Both left: no member remains.
    service = Service(make_settings())
    assert service.apps.lag(app.name).members == []
    service.close()
