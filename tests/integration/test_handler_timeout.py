"""The run-wide handler deadline given as a flag or a variable (not only in code) is applied."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.keys import dlq_key
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import dead_letters

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("handler", ["sync", "async"])
@pytest.mark.parametrize("given_as", ["flag", "variable"])
def test_handler_timeout_from_the_command_line_or_the_environment(
    given_as: str,
    handler: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, app = make_topic(1), names.app()
    produce(topic, [("slow", {"sleep_s": 5}), ("fast", {})])
    env = subprocess_env(
        PSPF_TEST_TOPIC=topic, PSPF_TEST_APP=app, PSPF_TEST_ASYNC="1" if handler == "async" else "0"
    )
    args = ["run", "tests.integration.cli_apps:slow", "--broker", redis_url, "--until-idle"]
    args += ["--state-dir", str(tmp_path / "state"), "--max-retries", "1"]
    if given_as == "flag":
        args += ["--handler-timeout-ms", "100"]
    else:
        env["PSPF_HANDLER_TIMEOUT_MS"] = "100"
    started = time.monotonic()
    done = subprocess.run(pspf_command(*args), env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    (record,) = dead_letters(rclient, topic, 1)
    assert record.error_type == "HandlerTimeout", record.message
    assert "100 ms" in record.message
    assert rclient.xlen(dlq_key(topic, 0)) == 1
    # The 5 s handler did not hold the run up (a sync one runs on in a helper thread).
    print(f"run took {took:.1f}s")
