"""Sentinel as secured deployments run it: TLS everywhere with client certificates, ACL users, a fail-over.

The master, the replica and the sentinels listen on TLS ports only and ask every client for a
certificate (``LocalSentinel(tls=...)``), so the CLI reaches nothing, neither the sentinels nor
the master they name, unless its TLS files reach both kinds of connection. The certificates and
the server binary are test_tls.py's: the tests skip when no binary serves TLS.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pspf import Producer, Settings
from pspf.embedded import LocalSentinel
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import all_state, backup_applied, expected_state, order_records
from tests.crash.test_sentinel_failover import PARTITIONS, caught_up, held_on
from tests.integration import test_tls
from tests.integration.test_acl import ACL_RULES, OPTIONAL_RULES
from tests.integration.test_tls import Certs, Pspf
from tests.integration.test_url_secrets import COMMANDS
from tests.support import wait_until

pytestmark = pytest.mark.integration

# test_tls.py's fixtures: the certificates, the binary that serves TLS (or a skip), the CLI runner.
certs = test_tls.certs
tls_binary = test_tls.tls_binary
pspf = test_tls.pspf

#: The default user's password on the servers and sentinels of ``secured_sentinel``.
ADMIN_PASSWORD = "admin-pw-of-the-deployment"
SECRET = "hunter2-pspf-secret"


def server_tls(certs: Certs) -> list[str]:
    """The servers' TLS options; client certificates are required (the servers' default)."""
    files = ["--tls-cert-file", str(certs.server), "--tls-key-file", str(certs.server_key)]
    return [*files, "--tls-ca-cert-file", str(certs.ca)]


def client_tls(certs: Certs, ca: Path | None = None) -> list[str]:
    """The CLI's TLS flags: the CA (``ca`` instead when given) and the client certificate."""
    client = ["--tls-cert-file", str(certs.client), "--tls-key-file", str(certs.client_key)]
    return ["--tls-ca-file", str(ca or certs.ca), *client]


def hosts(sentinel: LocalSentinel) -> str:
    return ",".join(f"127.0.0.1:{port}" for port in sentinel.sentinel_ports)


def start(sentinel: LocalSentinel) -> Iterator[LocalSentinel]:
    sentinel.start()
    try:
        yield sentinel
    finally:
        sentinel.stop()


@pytest.fixture(scope="module")
def tls_sentinel(
    tls_binary: str, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalSentinel]:
    """A master, a replica and 3 sentinels over mutual TLS, with no password."""
    directory = tmp_path_factory.mktemp("tls-sentinel")
    yield from start(LocalSentinel(directory, binary=tls_binary, tls=server_tls(certs)))


@pytest.fixture(scope="module")
def secured_sentinel(
    tls_binary: str, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalSentinel]:
    """The same over TLS, with ``ADMIN_PASSWORD`` on the default user of every server and sentinel."""
    directory = tmp_path_factory.mktemp("secured-sentinel")
    yield from start(
        LocalSentinel(directory, binary=tls_binary, tls=server_tls(certs), password=ADMIN_PASSWORD)
    )


def other_ca(tmp_path: Path) -> Certs:
    other = Certs(tmp_path / "other-ca")
    other.dir.mkdir()
    other.make()
    return other


def one_line(result_output: str) -> str:
    """The error: one line, besides the state dir that ``pspf run`` names as it starts."""
    lines = [line for line in result_output.strip().splitlines() if not line.startswith("state dir: ")]
    assert len(lines) == 1, result_output
    return lines[0]


def test_over_mutual_tls_produce_run_and_state_get_work_end_to_end_and_a_wrong_ca_is_one_line(
    tls_sentinel: LocalSentinel, certs: Certs, pspf: Pspf, tmp_path: Path
) -> None:
    assert tls_sentinel.url.startswith("rediss+sentinel://")
    pspf.end_to_end("--broker", tls_sentinel.url, *client_tls(certs))
    wrong = client_tls(certs, ca=other_ca(tmp_path).ca)
    for command in [("topic", "list"), ("run", "tests.integration.cli_apps:make", "--until-idle")]:
        result = pspf(*command, "--broker", tls_sentinel.url, *wrong)
        assert result.exit_code == 3, result.output
        line = one_line(result.output)
        assert "cannot reach Redis" in line and "certificate verify failed" in line, line


def test_the_tls_files_from_the_environment_reach_the_sentinels_and_the_master(
    tls_sentinel: LocalSentinel, certs: Certs, pspf: Pspf
) -> None:
    """Without a client certificate the sentinels refuse the CLI; the master does too, so the
    runs above that worked gave it their certificate as well."""
    env = {"PSPF_BROKER": tls_sentinel.url, "PSPF_TLS_CA_FILE": str(certs.ca)}
    refused = pspf("topic", "list", **env)
    assert refused.exit_code == 3, refused.output
    line = one_line(refused.output)
    # Each sentinel's reason, not redis-py's repr of its client (every option, the CA's path too).
    assert "cannot reach Redis" in line and f"sentinel 127.0.0.1:{tls_sentinel.sentinel_ports[0]}: " in line
    assert str(certs.ca) not in line, line
    master = tls_sentinel.master_port()
    assert master is not None
    without_cert = redis.Redis(
        host="127.0.0.1", port=master, ssl=True, ssl_ca_certs=str(certs.ca), retry=Retry(NoBackoff(), 0)
    )
    with pytest.raises(redis.ConnectionError):
        without_cert.ping()
    without_cert.close()
    files = {"PSPF_TLS_CERT_FILE": str(certs.client), "PSPF_TLS_KEY_FILE": str(certs.client_key)}
    accepted = pspf("topic", "create", pspf.topic, "--partitions", "1", **env, **files)
    assert accepted.exit_code == 0, accepted.output


@pytest.fixture(scope="module")
def acl_user(secured_sentinel: LocalSentinel) -> str:
    """A user limited to the documented rules on both data nodes (ACLs are not replicated)."""
    for node in (secured_sentinel.master, secured_sentinel.replica):
        with node.client() as admin:
            rules = [*ACL_RULES.split(), OPTIONAL_RULES]
            admin.execute_command("ACL", "SETUSER", "pspf", "reset", "on", ">pw-of-the-app", *rules)
    return "pspf"


def test_an_acl_user_behind_password_protected_sentinels_runs_an_app_end_to_end(
    secured_sentinel: LocalSentinel, acl_user: str, certs: Certs, pspf: Pspf
) -> None:
    url = (
        f"rediss+sentinel://{acl_user}:pw-of-the-app@{hosts(secured_sentinel)}/pspf/1"
        f"?sentinel_password={ADMIN_PASSWORD}"
    )
    pspf.end_to_end("--broker", url, *client_tls(certs))
    # The rules are a restriction: the same login may not touch keys outside pspf:.
    master = secured_sentinel.master_port()
    assert master is not None
    login = {**secured_sentinel.master.client_args, "username": acl_user, "password": "pw-of-the-app"}
    client = redis.Redis(host="127.0.0.1", port=master, **login)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("not-pspf", "1")
    client.close()


@pytest.mark.parametrize("who", ["user", "sentinel"])
def test_a_wrong_password_exits_3_with_one_line_and_without_the_password(
    secured_sentinel: LocalSentinel, acl_user: str, certs: Certs, names: Names, who: str
) -> None:
    """The standalone test's assertions (test_url_secrets.py), for the master's user and the
    sentinels' password, for each of its commands; ``-vv`` (DEBUG logs, tracebacks) shows no
    password either."""
    user_password, sentinel_password = (
        (SECRET, ADMIN_PASSWORD) if who == "user" else ("pw-of-the-app", SECRET)
    )
    url = (
        f"rediss+sentinel://{acl_user}:{user_password}@{hosts(secured_sentinel)}/pspf"
        f"?sentinel_password={sentinel_password}"
    )
    env = subprocess_env(PSPF_BROKER=url, PSPF_TEST_TOPIC=names.topic(), PSPF_TEST_APP=names.app())
    for args, verbosity in itertools.product(COMMANDS, [(), ("-vv",)]):
        done = subprocess.run(
            pspf_command(*verbosity, *args, *client_tls(certs)),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 3, output
        assert "invalid username-password pair" in done.stderr, output
        assert SECRET not in output and ADMIN_PASSWORD not in output, output
        if not verbosity:
            line = one_line(output)
            assert "authentication to Redis at rediss+sentinel://" in line and " failed: " in line, line
            # Which side refused: the sentinels (each named) or, found through them, the master.
            assert ("No master found for 'pspf'; sentinel 127.0.0.1:" in line) == (who == "sentinel"), line


@pytest.fixture
def failing_over(tls_binary: str, certs: Certs, tmp_path: Path) -> Iterator[LocalSentinel]:
    """A TLS deployment of the test's own: the test kills its master."""
    yield from start(LocalSentinel(tmp_path / "servers", binary=tls_binary, tls=server_tls(certs)))


def test_a_sigkilled_master_fails_over_and_the_worker_goes_on_over_tls(
    failing_over: LocalSentinel, certs: Certs, tmp_path: Path, names: Names
) -> None:
    """The worker finds the promoted replica through the sentinels and reconnects over TLS;
    its state is exactly what the new master's streams hold (the pattern of
    tests/crash/test_sentinel_failover.py, which also makes the replica lag)."""
    sentinel = failing_over
    topic, app = names.topic(), names.app()
    config = Settings.load(
        {
            "PSPF_BROKER": sentinel.url,
            "PSPF_TLS_CA_FILE": str(certs.ca),
            "PSPF_TLS_CERT_FILE": str(certs.client),
            "PSPF_TLS_KEY_FILE": str(certs.client_key),
        },
        environ={},
    )
    Service(config).create_topic(topic, PARTITIONS)
    records = order_records(4000, 50, seed=7)
    with Producer(settings=config) as producer:
        for key, value in records:
            producer.send(topic, value, key=key)
    spawn = Spawner(tmp_path, sentinel.url)
    try:
        worker = spawn(
            "worker",
            topic,
            app,
            *client_tls(certs),
            *["--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "3000"],
            env={"PSPF_TEST_WORK_US": "1000"},
        )
        with sentinel.master.client() as old:
            wait_until(
                lambda: backup_applied(old, topic, app, PARTITIONS) > 500, 60, "the worker to apply entries"
            )
            assert backup_applied(old, topic, app, PARTITIONS) < len(records), "the worker finished first"
        assert sentinel.master.process is not None
        sentinel.master.process.send_signal(signal.SIGKILL)  # mid-run
        sentinel.master.process.wait()
        wait_until(lambda: sentinel.master_port() not in (None, sentinel.master.port), 60, "the fail-over")
        assert sentinel.master_port() == sentinel.replica.port
        with sentinel.replica.client() as new:
            wait_until(lambda: caught_up(new, topic, app), 120, "the worker to catch up on the new master")
            assert worker.alive(), worker.tail()
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0, worker.tail()
            want = held_on(new, topic)
        got: dict[str, tuple[int, int]] = {}
        for state in all_state(spawn.state_dir, app, PARTITIONS).values():
            got.update({key: (v["count"], v["total"]) for key, v in state.items()})
        assert got == want, worker.tail()
        # Everything was produced, and had reached the replica, before the fail-over.
        assert want == expected_state(records)
        log = worker.log.read_text()
        # It lost the master and went on: its loop or its lease keeper, whichever asked the dead
        # master first, says so (on a busy machine the loop may ask only after the fail-over).
        lost = ("Redis unavailable, retrying", "renewing the leases failed")
        assert any(line in log for line in lost), worker.tail()
    finally:
        spawn.reap()
