"""A password in the broker URL, in any form redis-py accepts, never reaches the CLI's output.

The commands run as subprocesses with full verbosity too (``-vv``: DEBUG logs and tracebacks),
so a secret in a log record or an exception's chain would show.
"""

from __future__ import annotations

import subprocess

import pytest

from pspf.embedded import free_port
from tests.conftest import Names, RedisServer, pspf_command, subprocess_env

pytestmark = pytest.mark.integration

SECRET = "hunter2-pspf-secret"

#: Every place a URL can carry a credential that redis-py reads.
URL_FORMS = [
    "redis://127.0.0.1:{port}/0?password={secret}",
    "redis://127.0.0.1:{port}/0?username=default&password={secret}",
    "redis://:{secret}@127.0.0.1:{port}/0",
    "redis://default:{secret}@127.0.0.1:{port}/0",
]

COMMANDS = [
    ("topic", "list"),
    ("produce", "orders", "--key", "u1", '{"amount": 3}'),
    ("run", "tests.integration.cli_apps:make", "--until-idle"),
]


def pspf(url: str, names: Names, *args: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env(PSPF_BROKER=url, PSPF_TEST_TOPIC=names.topic(), PSPF_TEST_APP=names.app())
    return subprocess.run(pspf_command(*args), env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("verbosity", [(), ("-vv",)], ids=["quiet", "verbose"])
@pytest.mark.parametrize("args", COMMANDS, ids=[c[0] for c in COMMANDS])
@pytest.mark.parametrize("form", URL_FORMS)
def test_unreachable_broker_exits_3_without_the_password(
    form: str, args: tuple[str, ...], verbosity: tuple[str, ...], names: Names
) -> None:
    url = form.format(port=free_port(), secret=SECRET)
    done = pspf(url, names, *verbosity, *args)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output
    assert "cannot reach Redis" in done.stderr
    assert SECRET not in output


@pytest.mark.parametrize("args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_refused_password_exits_3_without_the_password(
    own_server: RedisServer, args: tuple[str, ...], names: Names
) -> None:
    """redis-py's own error text, which the broker's message carries, names no password."""
    client = own_server.client()
    client.config_set("requirepass", "the-right-one")
    client.close()
    url = f"redis://127.0.0.1:{own_server.port}/0?password={SECRET}"
    done = pspf(url, names, "-vv", *args)
    output = done.stdout + done.stderr
    assert done.returncode == 3, output
    assert "invalid username-password pair" in done.stderr
    assert SECRET not in output
