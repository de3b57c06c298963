"""Network cuts for the crash tests: a server and worker hosts in network namespaces of the test's own.

The server runs in one namespace, reached over a veth pair by worker processes in another
("the host"), and over a Unix socket by the test itself and by workers that must not be cut off.
``cut`` takes the server's end of the pair down for a while, so the host's packets are dropped
(TCP retransmits them, as after a real cut) and nothing is refused. Only addresses inside the
namespaces made here are used; both namespaces (and the pair with them) are deleted at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pspf.embedded import free_port
from tests.conftest import server_binary_under_test, subprocess_env
from tests.crash.support import APP_TARGET, WorkerProcess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class NetLab:
    """A server namespace and a host namespace joined by a veth pair, and a server in the first."""

    def __init__(self, tmp_path: Path) -> None:
        tag = f"{os.getpid() % 10_000}{int(time.monotonic() * 1000) % 100}"
        self.server_ns, self.host_ns = f"pspfs{tag}", f"pspfh{tag}"
        self.server_dev, self.host_dev = f"pspfs{tag}", f"pspfh{tag}"
        subnet = f"10.{200 + os.getpid() % 50}.{int(tag) % 250}"
        self.server_ip, self.host_ip = f"{subnet}.1", f"{subnet}.2"
        self.tmp_path = tmp_path
        self.port = free_port()
        self.socket = tmp_path / "redis.sock"
        self.url = f"redis://{self.server_ip}:{self.port}/0"  # the host's way to the server
        self.local_url = f"unix://{self.socket}"  # the test's own, never cut
        self.server: subprocess.Popen[bytes] | None = None
        self.workers: list[WorkerProcess] = []

    def start(self) -> None:
        _ip("netns", "add", self.server_ns)
        _ip("netns", "add", self.host_ns)
        _ip("link", "add", self.server_dev, "type", "veth", "peer", "name", self.host_dev)
        for ns, dev, address in (
            (self.server_ns, self.server_dev, self.server_ip),
            (self.host_ns, self.host_dev, self.host_ip),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        directory = self.tmp_path / "redis"
        directory.mkdir()
        command = [server_binary_under_test(), "--port", str(self.port), "--bind", self.server_ip]
        command += ["--unixsocket", str(self.socket), "--unixsocketperm", "777", "--dir", str(directory)]
        command += [
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "no",
        ]
        self.server = subprocess.Popen(
            ["ip", "netns", "exec", self.server_ns, *command],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("the server in the network namespace did not start") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket))

    def cut(self, seconds: float) -> None:
        """Drop every packet between the host and the server for ``seconds``, then heal the link."""
        _ip("-n", self.server_ns, "link", "set", self.server_dev, "down")
        try:
            time.sleep(seconds)
        finally:
            _ip("-n", self.server_ns, "link", "set", self.server_dev, "up")

    def worker(
        self, label: str, topic: str, app: str, *args: str, on_host: bool = True, **env: str
    ) -> WorkerProcess:
        """``pspf run`` of the crash app: on the host (over the veth pair) or beside the test."""
        url = self.url if on_host else self.local_url
        state_dir = self.tmp_path / f"state-{label}"
        extra = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app, **env}
        worker = WorkerProcess(
            self.tmp_path / f"{label}.log",
            ["--broker", url, "--state-dir", str(state_dir), "--consumer", label, *args],
            subprocess_env(**extra),
            cwd=self.tmp_path,
            target=APP_TARGET,
            prefix=("ip", "netns", "exec", self.host_ns) if on_host else (),
        )
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.kill9()
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        for ns in (self.server_ns, self.host_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "cutting a network link needs root (ip netns, veth pairs)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"pspfprobe{os.getpid() % 100_000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=10)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.decode(errors='replace').strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@pytest.fixture
def netlab(tmp_path: Path) -> Iterator[NetLab]:
    """A server in a network namespace of its own and a host namespace whose link can be cut."""
    why = _unavailable()
    if why is not None:
        pytest.skip(why)
    lab = NetLab(tmp_path)
    try:
        lab.start()
        yield lab
    finally:
        lab.close()
