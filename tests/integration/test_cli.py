"""The pspf command through click's CliRunner: happy paths and every user error path."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import redis
from click.testing import CliRunner, Result

from pspf.cli import cli
from pspf.cli.main import RUN_OPTIONS
from pspf.embedded import free_port
from pspf.keys import stream_key
from tests.conftest import Names

pytestmark = pytest.mark.integration


@pytest.fixture
def invoke(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR", "PSPF_UNTIL_IDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    base_env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state"), "PSPF_BLOCK_MS": "100"}

    def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), input=input, env={**base_env, **(env or {})})

    return run


def one_line_error(result: Result) -> str:
    """The CLI's error output: exactly one line, no traceback."""
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_topic_produce_run_state_round_trip(
    invoke: Callable[..., Result], names: Names, rclient: redis.Redis
) -> None:
    topic, app = names.topic(), names.app()
    assert invoke("topic", "create", topic, "--partitions", "4").exit_code == 0
    again = invoke("topic", "create", topic, "--partitions", "4")
    assert again.exit_code == 0 and "already exists" in again.output
    listed = json.loads(invoke("topic", "list", "--json").output)
    assert {"name": topic, "partitions": 4} in listed

    single = invoke("produce", topic, "--key", "u1", '{"amount": 3}')
    assert single.exit_code == 0, single.output
    lines = "".join(json.dumps({"user": f"u{i % 7}", "amount": i}) + "\n" for i in range(1, 301))
    many = invoke("produce", topic, "--key-field", "user", input=lines)
    assert many.exit_code == 0, many.output
    assert "300 entries written" in many.output
    # Each entry sits in the partition its key maps to.
    for p in range(4):
        for _, fields in rclient.xrange(stream_key(topic, p)):
            assert zlib.crc32(fields[b"key"]) % 4 == p

    described = json.loads(invoke("topic", "describe", topic, "--json").output)
    assert described["length"] == 301

    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app}
    ran = invoke("run", "tests.integration.cli_apps:make", "--until-idle", env=env)
    assert ran.exit_code == 0, ran.output
    assert "processed 301 entries" in ran.output

    got = invoke("state", "get", app, "u1", "--json")
    assert got.exit_code == 0, got.output
    want_u1 = 3 + sum(i for i in range(1, 301) if i % 7 == 1)
    assert json.loads(got.output) == {"total": want_u1, "count": 1 + len(range(1, 301, 7))}
    human = invoke("state", "get", app, "u1")
    assert f"total: {want_u1}" in human.output
    keys = json.loads(invoke("state", "list", app, "--json").output)
    assert keys == sorted(f"u{i}" for i in range(7))


def test_produce_large_ndjson_file(
    invoke: Callable[..., Result], names: Names, tmp_path: Path, rclient: redis.Redis
) -> None:
    topic = names.topic()
    invoke("topic", "create", topic, "--partitions", "2")
    path = tmp_path / "orders.ndjson"
    path.write_text("".join(json.dumps({"user": f"u{i % 100}", "amount": 1}) + "\n" for i in range(20_000)))
    result = invoke("produce", topic, "--key-field", "user", "--file", str(path))
    assert result.exit_code == 0, result.output
    assert rclient.xlen(stream_key(topic, 0)) + rclient.xlen(stream_key(topic, 1)) == 20_000


@pytest.mark.parametrize(
    ("target", "exit_code", "message"),
    [
        ("no_such_module_xyz:main", 2, "cannot import module 'no_such_module_xyz'"),
        ("tests.integration.cli_apps:nope", 2, "has no attribute 'nope'"),
        ("tests.integration.cli_apps:not_an_app", 2, "is a int, not a pspf.App"),
        ("tests.integration.cli_apps:needs_arguments", 2, "takes arguments"),
        ("tests.integration.cli_apps:broken_factory", 2, "database password missing"),
        ("tests.integration.cli_apps", 2, "MODULE:ATTRIBUTE"),
    ],
)
def test_run_target_errors(invoke: Callable[..., Result], target: str, exit_code: int, message: str) -> None:
    result = invoke("run", target)
    assert result.exit_code == exit_code
    assert message in one_line_error(result)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_run_unreachable_broker(invoke: Callable[..., Result], names: Names, host: str) -> None:
    """On this machine, the error says how to start a server where the URL points."""
    env = {"PSPF_TEST_TOPIC": names.topic(), "PSPF_TEST_APP": names.app()}
    port = free_port()
    url = f"redis://{host}:{port}/0"
    result = invoke("run", "tests.integration.cli_apps:make", "--broker", url, env=env)
    assert result.exit_code == 3
    line = one_line_error(result)
    assert line.startswith(f"Error: cannot reach Redis at {url}: ")
    assert line.endswith(f"(to start a local server there: pspf server --port {port})")


@pytest.mark.parametrize("url", ["http://localhost:6379", "redis://localhost:port/0", "redis://h/x"])
def test_run_malformed_broker_url(invoke: Callable[..., Result], names: Names, url: str) -> None:
    env = {"PSPF_TEST_TOPIC": names.topic(), "PSPF_TEST_APP": names.app()}
    result = invoke("run", "tests.integration.cli_apps:make", "--broker", url, env=env)
    assert result.exit_code == 2
    assert "invalid broker URL" in one_line_error(result)


def test_run_topic_that_does_not_exist(invoke: Callable[..., Result], names: Names) -> None:
    topic = names.topic()
    result = invoke(
        "run", "tests.integration.cli_apps:make", env={"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": "x"}
    )
    assert result.exit_code == 4
    assert f"topic '{topic}' does not exist" in one_line_error(result)


def test_run_state_dir_not_writable(invoke: Callable[..., Result], names: Names, tmp_path: Path) -> None:
    topic = names.topic()
    invoke("topic", "create", topic)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": names.app()}
    result = invoke("run", "tests.integration.cli_apps:make", "--state-dir", str(blocker / "state"), env=env)
    assert result.exit_code == 5
    assert "is not writable" in one_line_error(result)


def test_verbose_shows_the_traceback(invoke: Callable[..., Result]) -> None:
    result = invoke("-v", "run", "no_such_module_xyz:main")
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_produce_errors(invoke: Callable[..., Result], names: Names, rclient: redis.Redis) -> None:
    missing = invoke("produce", names.topic(), '{"a": 1}')
    assert missing.exit_code == 4
    assert "does not exist" in one_line_error(missing)

    topic = names.topic()
    invoke("topic", "create", topic)
    bad_json = invoke("produce", topic, "{nope")
    assert bad_json.exit_code == 2 and "invalid JSON" in one_line_error(bad_json)

    lines = '{"user": "a", "amount": 1}\n{"user": "b", "amount": 2}\n{"amount": 3}\n{"user": "c"}\n'
    partial = invoke("produce", topic, "--key-field", "user", input=lines)
    assert partial.exit_code == 2
    assert "line 3: no field 'user' (2 entries written before it)" in one_line_error(partial)
    assert rclient.xlen(stream_key(topic, 0)) == 2  # the good lines before it are kept

    usage = invoke("produce", topic, '{"a": 1}', "--key-field", "user")
    assert usage.exit_code == 2

    null_key = invoke("produce", topic, "--key-field", "user", input='{"user": null, "amount": 4}\n')
    assert null_key.exit_code == 2
    assert "line 1: field 'user' is null: a key must be a string or an integer" in one_line_error(null_key)


def test_produce_with_headers(invoke: Callable[..., Result], names: Names, rclient: redis.Redis) -> None:
    topic = names.topic()
    invoke("topic", "create", topic)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    done = invoke(
        "produce", topic, "--key", "u1", "--header", f"traceparent={parent}", "--header", "a=b=c", "{}"
    )
    assert done.exit_code == 0, done.output
    ((_, fields),) = rclient.xrange(stream_key(topic, 0))
    assert msgspec.json.decode(fields[b"headers"]) == {"traceparent": parent, "a": "b=c"}
    bad = invoke("produce", topic, "--header", "novalue", "{}")
    assert bad.exit_code == 2 and "'novalue' is not NAME=VALUE" in bad.output
    lines = invoke("produce", topic, "--header", "a=b", input="{}\n")
    assert lines.exit_code == 2 and "go with a single VALUE" in lines.output


def test_topic_errors(invoke: Callable[..., Result], names: Names) -> None:
    bad_name = invoke("topic", "create", "no spaces")
    assert bad_name.exit_code == 2 and "invalid topic name" in one_line_error(bad_name)
    zero = invoke("topic", "create", names.topic(), "--partitions", "0")
    assert zero.exit_code == 2 and one_line_error(zero).endswith("invalid --partitions 0: give 1 to 1024")
    topic = names.topic()
    invoke("topic", "create", topic, "--partitions", "2")
    # Another partition count: a usage error (exit 2, as for a bad argument), not the broker's 3.
    clash = invoke("topic", "create", topic, "--partitions", "3")
    assert clash.exit_code == 2
    assert one_line_error(clash) == (
        f"Error: topic '{topic}' exists with 2 partitions, not 3: a topic's partition count is fixed "
        "when it is created"
    )
    # The same count again: not an error, the topic is left as it is.
    same = invoke("topic", "create", topic, "--partitions", "2")
    assert same.exit_code == 0 and f"topic {topic} already exists with 2 partitions\n" in same.output
    unknown = invoke("topic", "describe", names.topic())
    assert unknown.exit_code == 4


def test_state_errors(invoke: Callable[..., Result], names: Names) -> None:
    never_ran = invoke("state", "get", names.app(), "u1")
    assert never_ran.exit_code == 4 and "has never run" in one_line_error(never_ran)
    no_state = invoke("state", "list", names.app())
    assert no_state.exit_code == 4 and "no sqlite state for app" in one_line_error(no_state)


def test_run_without_a_state_dir_uses_the_user_data_dir_and_says_so(
    invoke: Callable[..., Result], names: Names, tmp_path: Path
) -> None:
    topic, app = names.topic(), names.app()
    assert invoke("topic", "create", topic).exit_code == 0
    assert invoke("produce", topic, "--key", "u1", '{"amount": 3}').exit_code == 0
    data = tmp_path / "data"
    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app, "PSPF_STATE_DIR": None, "XDG_DATA_HOME": str(data)}
    ran = invoke("run", "tests.integration.cli_apps:make", "--until-idle", env=env)
    assert ran.exit_code == 0, ran.output
    want = data / "pspf" / "state"
    assert f"state dir: {want}\n" in ran.output
    assert (want / app).is_dir()
    # the commands that read the stores find them there without being told
    lagged = json.loads(invoke("lag", app, "--json", env=env).output)
    assert [d["checkpoint"] for d in lagged["detail"]] == [d["last_id"] for d in lagged["detail"]]

    other = tmp_path / "other"
    target = "tests.integration.cli_apps:make"
    given = invoke("run", target, "--until-idle", "--state-dir", str(other), env=env)
    assert given.exit_code == 0, given.output
    assert f"state dir: {other}\n" in given.output


@pytest.fixture
def root_log_level() -> Iterator[None]:
    """Put the root logger's level back after a test that lets the CLI change it."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.mark.usefixtures("root_log_level")
@pytest.mark.parametrize(
    ("args", "level"),
    [
        (["-v", "topic", "list"], logging.INFO),
        (["topic", "list", "-v"], logging.INFO),
        (["topic", "-v", "list"], logging.INFO),
        (["topic", "list", "-vv"], logging.DEBUG),
        (["-v", "topic", "list", "--verbose"], logging.DEBUG),
        (["groups", "--verbose"], logging.INFO),
    ],
)
def test_verbose_before_or_after_the_subcommand(
    invoke: Callable[..., Result], args: list[str], level: int
) -> None:
    logging.getLogger().setLevel(logging.WARNING)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert logging.getLogger().level == level


def test_verbose_after_the_subcommand_shows_the_traceback(invoke: Callable[..., Result]) -> None:
    result = invoke("run", "no_such_module_xyz:main", "-v")
    assert result.exit_code == 2
    assert "Traceback" in result.output


def test_counts_of_one_are_singular(invoke: Callable[..., Result], names: Names) -> None:
    topic = names.topic()
    created = invoke("topic", "create", topic)
    assert created.exit_code == 0 and f"topic {topic} created with 1 partition\n" in created.output
    again = invoke("topic", "create", topic)
    assert f"topic {topic} already exists with 1 partition\n" in again.output
    many = invoke("topic", "create", names.topic(), "--partitions", "3")
    assert "created with 3 partitions\n" in many.output
    produced = invoke("produce", topic, "--key-field", "user", input='{"user": "u1", "amount": 1}\n')
    assert produced.exit_code == 0 and "1 entry written\n" in produced.output
    described = invoke("topic", "describe", topic)
    assert f"topic {topic}: 1 partition, 1 entry\n" in described.output
    partial = invoke("produce", topic, "--key-field", "user", input='{"user": "u1"}\n{"amount": 3}\n')
    assert "(1 entry written before it)" in one_line_error(partial)


def test_run_summary_counts_dead_letters_and_retries_apart(
    invoke: Callable[..., Result], names: Names
) -> None:
    topic, app = names.topic(), names.app()
    invoke("topic", "create", topic)
    lines = "".join(json.dumps(order) + "\n" for order in [{}, {"fail": 1}, {"fail": "always"}])
    assert invoke("produce", topic, input=lines).exit_code == 0
    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app, "PSPF_RETRY_BASE_MS": "10"}
    ran = invoke("run", "tests.integration.cli_apps:flaky", "--until-idle", env=env)
    assert ran.exit_code == 0, ran.output
    # 3 attempts in all for the one that always fails (2 retried, then the DLQ), 1 retry for the other
    assert "processed 2 entries (0 already done), 1 dead-lettered, 3 failed attempts retried\n" in ran.output

    single = invoke("produce", topic, '{"fail": 1}')
    assert single.exit_code == 0
    again = invoke("run", "tests.integration.cli_apps:flaky", "--until-idle", env=env)
    assert "processed 1 entry (0 already done), 0 dead-lettered, 1 failed attempt retried\n" in again.output


def test_a_confirmation_without_a_terminal_says_to_pass_yes(
    invoke: Callable[..., Result], names: Names
) -> None:
    """A script's stdin ends before any answer: one line naming --yes, not click's bare "Aborted!"."""
    topic = names.topic()
    invoke("topic", "create", topic)
    unanswered = invoke("dlq", "purge", topic, "--all")
    assert unanswered.exit_code == 2
    error = 'Error: cannot ask "Delete 0 DLQ entries?" without a terminal: pass --yes'
    assert one_line_error(unanswered) == error
    refused = invoke("dlq", "purge", topic, "--all", input="n\n")
    assert refused.exit_code == 1 and "Aborted!" in refused.output
    assert invoke("dlq", "purge", topic, "--all", "--yes").exit_code == 0


NUMERIC_RUN_FLAGS = [(flag, kind) for flag, kind, _ in RUN_OPTIONS if kind in (int, float)]


@pytest.mark.parametrize(("flag", "kind"), NUMERIC_RUN_FLAGS)
def test_a_bad_number_names_the_flag_it_came_from(
    invoke: Callable[..., Result], flag: str, kind: type
) -> None:
    """Every numeric flag of ``pspf run`` (and of ``pspf sink``, which shares them)."""
    result = invoke("run", "tests.integration.cli_apps:make", flag, "-1")
    assert result.exit_code == 2
    line = one_line_error(result)
    assert line.startswith(f"Error: invalid {flag} {kind(-1)}: expected "), line
    assert "PSPF_" not in line and "$." not in line


def test_a_bad_number_from_the_environment_names_the_variable(invoke: Callable[..., Result]) -> None:
    result = invoke("run", "tests.integration.cli_apps:make", env={"PSPF_BATCH_SIZE": "0"})
    assert result.exit_code == 2
    assert one_line_error(result) == "Error: invalid PSPF_BATCH_SIZE=0: expected `int` >= 1"
    given = invoke(
        "run", "tests.integration.cli_apps:make", "--batch-size", "0", env={"PSPF_BATCH_SIZE": "5"}
    )
    assert one_line_error(given) == "Error: invalid --batch-size 0: expected `int` >= 1"


@pytest.mark.parametrize("count", ["0", "1025"])
def test_a_bad_partition_count_names_the_flag(
    invoke: Callable[..., Result], names: Names, count: str
) -> None:
    result = invoke("topic", "create", names.topic(), "--partitions", count)
    assert result.exit_code == 2
    assert one_line_error(result) == f"Error: invalid --partitions {count}: give 1 to 1024"
