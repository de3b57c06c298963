"""App operations run one at a time: ``app reset``, ``app delete`` and ``replay`` hold the app's lease."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import Settings, Worker
from pspf.broker import Broker
from pspf.keys import app_key
from pspf.ownership.operation_lease import exclusive, operation_key
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import KEYS, state_of, summing_app, totals

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "operation",
    [
        ("app", "reset", "{app}"),
        ("app", "delete", "{app}"),
        ("replay", "{app}", "--topic", "{topic}", "--from-start"),
    ],
    ids=["reset", "delete", "replay"],
)
def test_an_operation_is_refused_while_another_holds_the_app(
    operation: tuple[str, ...],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(2), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(500)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    args = [a.format(app=app, topic=topic) for a in operation]
    command = [*args, "--state-dir", str(tmp_path)] if operation[1] != "delete" else args
    broker = Broker(settings.redis)

    def run() -> subprocess.CompletedProcess[str]:
        line = pspf_command(*command, "--yes", "--broker", redis_url)
        return subprocess.run(line, env=subprocess_env(), capture_output=True, text=True, timeout=120)

    with exclusive(broker, app, "app reset", 5000):
        refused = run()
        assert refused.returncode == 6, refused
        assert len(refused.stderr.strip().splitlines()) == 1 and "app reset by" in refused.stderr
        assert rclient.exists(app_key(app)) and state_of(Service(make_settings()), app) == totals(500)
    assert not rclient.exists(operation_key(app))
    assert run().returncode == 0
