"""The ACL the docs give is enough for every CLI command, checked as that user on a real server.

The rules are the line of docs/how-to/redis-topologies.md (the test fails when they drift apart).
They use only syntax Redis 6.2 knows too (``resetchannels``, ``+command|info`` subcommand rules),
and CI runs this against 6.2 as well as 7.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Producer, Settings, Worker, keys
from pspf.broker import Broker
from pspf.cli import cli
from pspf.embedded import LocalCluster
from pspf.errors import AuthenticationFailed, BrokerError
from pspf.service import Service
from pspf.settings import RedisSettings, mask_url
from pspf.worker.retention import Retention
from tests.conftest import ROOT, Names, RedisServer, server_binary_under_test
from tests.integration.failures_support import summing_app

pytestmark = pytest.mark.integration

#: What a PSPF user needs: its keys, streams, the hashes and sets of the topic registry, the
#: commands of the Lua scripts (leases, fences, markers, members), fenced reads (WATCH/MULTI/EXEC) and the
#: start-up checks (INFO, COMMAND INFO). CONFIG GET is optional: without it the worker only warns.
ACL_RULES = (
    "resetkeys ~pspf:* resetchannels -@all +@stream +hsetnx +hset +hget +hgetall +hscan +hdel +sadd "
    "+smembers +exists +mget "
    "+get +set +incr +pexpire +del +evalsha +script|load +watch +multi +exec +unwatch +info +command|info "
    "+ping +select +zadd +zrem +zrange +zrangebyscore +zscore +time +type +hmget +hlen"
)
OPTIONAL_RULES = "+config|get"
UNCHECKED = "persistence and eviction are unchecked"


class AsUser:
    """The CLI in-process, logged in as an ACL user with the given rules, on its own server."""

    def __init__(self, server: RedisServer, rules: str, state_dir: Path, names: Names) -> None:
        self.topic, self.app = names.topic(), names.app()
        admin = server.client()
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", self.app, "reset", "on", ">pw-of-the-app", *rules.split()
        )
        admin.close()
        # Database 1, so that the client sends SELECT.
        self.url = f"redis://{self.app}:pw-of-the-app@127.0.0.1:{server.port}/1"
        self.env = {
            "PSPF_BROKER": self.url,
            "PSPF_STATE_DIR": str(state_dir),
            "PSPF_BLOCK_MS": "100",
            "PSPF_TEST_TOPIC": self.topic,
            "PSPF_TEST_APP": self.app,
        }

    def __call__(self, *args: str, input: str | None = None, **env: str) -> Result:
        result = CliRunner().invoke(cli, list(args), input=input, env={**self.env, **env})
        assert result.exit_code == 0, result.output
        assert "NOPERM" not in result.output and "no permissions" not in result.output, result.output
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "--json").output)


@pytest.fixture
def user(
    own_server: RedisServer, tmp_path: Path, names: Names, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], AsUser]:
    """Makes the ACL user with the rules given (on a server of the test's own) and its CLI."""
    for name in [n for n in os.environ if n.startswith("PSPF_") and n != "PSPF_TEST_REDIS_SERVER"]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(ROOT)
    return lambda rules: AsUser(own_server, rules, tmp_path / "state", names)


def test_the_docs_give_these_rules() -> None:
    page = (ROOT / "docs" / "how-to" / "redis-topologies.md").read_text()
    assert f"ACL SETUSER pspf on '>PASSWORD' {ACL_RULES} {OPTIONAL_RULES}" in page


def test_the_user_cannot_reach_keys_outside_pspf(
    own_server: RedisServer, user: Callable[[str], AsUser]
) -> None:
    """The rules are a restriction, not a no-op: the same login is refused anything else."""
    as_user = user(f"{ACL_RULES} {OPTIONAL_RULES}")
    client = redis.Redis.from_url(as_user.url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("not-pspf", "1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()
    client.close()


def test_every_command_works_as_the_acl_user(
    user: Callable[[str], AsUser], caplog: pytest.LogCaptureFixture
) -> None:
    cli_as = user(f"{ACL_RULES} {OPTIONAL_RULES}")
    topic, app = cli_as.topic, cli_as.app
    cli_as("topic", "create", topic, "--partitions", "2")
    assert {"name": topic, "partitions": 2} in cli_as.json("topic", "list")
    cli_as("topic", "describe", topic)
    lines = "".join(
        json.dumps({"user": f"u{n % 3}", "n": n, "amount": n, "bad": n % 5 == 0}) + "\n" for n in range(1, 31)
    )
    cli_as("produce", topic, "--key-field", "user", input=lines)

    cli_as("run", "tests.integration.dlq_apps:make", "--until-idle")
    assert "worker started" in caplog.text
    assert UNCHECKED not in caplog.text  # CONFIG GET is allowed: persistence was checked
    good = [n for n in range(1, 31) if n % 5]
    assert cli_as.json("state", "get", app, "u1") == {
        "total": sum(n for n in good if n % 3 == 1),
        "count": len([n for n in good if n % 3 == 1]),
    }
    cli_as("state", "list", app)
    lag = cli_as.json("lag", app)
    assert isinstance(lag, dict) and lag["lag"] == 0 and lag["pending"] == 0
    cli_as("groups")
    dead = cli_as.json("dlq", "list", topic)
    assert isinstance(dead, list) and [row["app"] for row in dead] == [app] * 6
    cli_as("dlq", "show", topic, dead[0]["dlq_id"])

    cli_as("dlq", "redrive", topic, "--all", "--yes")
    assert cli_as.json("dlq", "list", topic) == []
    cli_as("run", "tests.integration.dlq_apps:make", "--until-idle", PSPF_TEST_FIXED="1")
    everything = {"total": sum(n for n in range(1, 31) if n % 3 == 1), "count": 10}
    assert cli_as.json("state", "get", app, "u1") == everything

    cli_as("replay", app, "--topic", topic, "--from-start", "--yes")
    cli_as("run", "tests.integration.dlq_apps:make", "--until-idle", PSPF_TEST_FIXED="1")
    # The stream also holds the redriven copies of u1's bad orders 10 and 25: each counts once.
    assert cli_as.json("state", "get", app, "u1") == everything

    cli_as("produce", topic, "--key", "u1", '{"n": 99, "amount": 1, "bad": true}')
    cli_as("run", "tests.integration.dlq_apps:make", "--until-idle")
    cli_as("dlq", "purge", topic, "--all", "--yes")
    assert cli_as.json("dlq", "list", topic) == []


def test_without_config_get_the_worker_runs_and_warns(
    user: Callable[[str], AsUser], caplog: pytest.LogCaptureFixture
) -> None:
    """A slow run with a short lease TTL, so that the worker renews its leases (PEXPIRE) too."""
    cli_as = user(ACL_RULES)
    cli_as("topic", "create", cli_as.topic, "--partitions", "1")
    lines = "".join(json.dumps({"user": "u1", "amount": n}) + "\n" for n in range(12))
    cli_as("produce", cli_as.topic, "--key-field", "user", input=lines)
    env = {"PSPF_TEST_WORK_US": "60000", "PSPF_BATCH_SIZE": "1", "PSPF_LEASE_TTL_MS": "600"}
    cli_as("run", "tests.crash.apps_failures:slow", "--until-idle", **env)
    assert UNCHECKED in caplog.text
    assert "lease expired" not in caplog.text
    assert cli_as.json("state", "get", cli_as.app, "u1") == {"total": sum(range(12)), "count": 12}


def test_commands_of_rarer_paths_are_allowed(user: Callable[[str], AsUser]) -> None:
    """What the flows above may not reach: PING (a standby's health, redis-py's check of a connection
    idle for 30 s), UNWATCH (a fenced read that holds no lease) and the Spark sink's calls."""
    as_user = user(ACL_RULES)
    client = redis.Redis.from_url(as_user.url)
    assert client.ping()
    with client.pipeline(transaction=True) as pipe:
        pipe.watch("pspf:lease:x")  # type: ignore[no-untyped-call]
        assert pipe.mget(["pspf:lease:x"]) == [None]
        pipe.unwatch()
    client.close()

    broker = Broker(RedisSettings(url=as_user.url))
    try:
        broker.topics.create_topic(as_user.topic, 1)
        assert broker.topics.topic_partitions(as_user.topic) == 1
        chunk = {0: (keys.sink_marker_key(as_user.topic, 0, "q-1"), [2, "value", "{}"])}
        assert broker.publishing.add_chunks(as_user.topic, "0", chunk, 60, maxlen="100") == {0: 1}
        assert broker.publishing.add_chunks(as_user.topic, "0", chunk, 60, maxlen="100") == {
            0: 0
        }  # the marker saw it
        # The outbox: publishing (TYPE, HGET, XADD, HSET in Lua) and replay requests (HMGET).
        assert broker.publishing.publish(as_user.topic, 0, "app/0", [(1, {b"value": b"{}"})]) == 1
        broker.requests.request_outbox_replay(as_user.app, 0, [1])
        raw = broker.requests.outbox_replay_requests(as_user.app, [0, 1])[0]
        broker.requests.finish_outbox_replay(as_user.app, 0, raw, b"{}")
        assert broker.requests.outbox_replay_outcomes(as_user.app, [0]) == {0: b"{}"}
    finally:
        broker.close()


#: What a user of a cluster needs besides: the slot map, and COMMAND (the cluster client reads
#: where each command's keys are).
CLUSTER_RULES = "+cluster|slots +command"


def test_on_a_cluster_the_user_needs_the_slot_map_and_command_more(tmp_path: Path, names: Names) -> None:
    """Without the cluster rules the client cannot even connect; with them, produce, run and trim work."""
    topic, app = names.topic(), names.app()
    with LocalCluster(tmp_path / "cluster", binary=server_binary_under_test()) as cluster:
        for node in cluster.nodes:
            with node.client() as admin:
                for name, extra in [("plain", ""), ("clustered", CLUSTER_RULES)]:
                    rules = [*ACL_RULES.split(), OPTIONAL_RULES, *extra.split()]
                    admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *rules)  # type: ignore[no-untyped-call]
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes)

        def settings(name: str) -> Settings:
            url = f"redis+cluster://{name}:pw@{hosts}"
            return Settings.load({"PSPF_BROKER": url, "PSPF_STATE_DIR": str(tmp_path / "state")}, environ={})

        with pytest.raises(BrokerError):
            Service(settings("plain")).create_topic(topic, 4)
        wrong = f"redis+cluster://clustered:not-the-pw@{hosts}"
        with pytest.raises(AuthenticationFailed, match=r"authentication to Redis at .* failed") as refused:
            Service(Settings.load({"PSPF_BROKER": wrong}, environ={})).topics.list_topics()
        assert "not-the-pw" not in str(refused.value)
        service = Service(settings("clustered"))
        service.create_topic(topic, 4)
        with Producer(settings=settings("clustered")) as producer:
            for i in range(200):
                producer.send(topic, {"n": i}, key=f"k{i % 5}")
        Worker(summing_app(app, topic), settings("clustered")).run(until_idle=True)
        assert sum(service.state_get(app, f"k{j}")["total"] for j in range(5)) == sum(range(200))
        assert service.topics.trim_topic(topic, override=Retention(max_len=10)).removed > 0


@pytest.mark.parametrize(
    "login",
    ["app:not-the-password", "nobody:not-the-password", ":not-the-password", ""],
    ids=["wrong-password", "unknown-user", "password-only", "no-login"],
)
def test_a_wrong_password_or_user_is_an_authentication_failure(
    own_server: RedisServer, login: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "cannot reach Redis": the server answered, and refused the login (one line, exit 3)."""
    admin = own_server.client()
    admin.execute_command("ACL", "SETUSER", "app", "reset", "on", ">the-password", "~*", "+@all")  # type: ignore[no-untyped-call]
    admin.execute_command("ACL", "SETUSER", "default", "resetpass", ">default-password")  # type: ignore[no-untyped-call]
    admin.close()
    monkeypatch.chdir(ROOT)
    url = f"redis://{login}{'@' if login else ''}127.0.0.1:{own_server.port}/0"
    env = {
        "PSPF_BROKER": url,
        "PSPF_STATE_DIR": str(tmp_path / "state"),
        "PSPF_TEST_TOPIC": "t",
        "PSPF_TEST_APP": "a",
    }
    try:
        for args in (["topic", "list"], ["run", "tests.integration.dlq_apps:make", "--until-idle"]):
            result = CliRunner().invoke(cli, args, env=env)
            assert result.exit_code == AuthenticationFailed.exit_code == 3, result.output
            errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
            assert len(errors) == 1 and "Traceback" not in result.output, result.output
            assert errors[0].startswith(f"Error: authentication to Redis at {mask_url(url)} failed")
            assert "cannot reach" not in result.output
            assert "not-the-password" not in result.output
    finally:
        with redis.Redis(port=own_server.port, password="default-password") as client:
            client.execute_command("ACL", "SETUSER", "default", "nopass")  # type: ignore[no-untyped-call]
