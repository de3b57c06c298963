"""``pspf topic read``: a topic's entries without a consumer group, merged, decoded, followed."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner, Result

from pspf.cli import cli
from pspf.keys import StreamId, stream_key
from pspf.service import Service
from tests.conftest import ROOT, Names, pspf_command, subprocess_env

pytestmark = pytest.mark.integration


@pytest.fixture
def invoke(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)
    env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state")}

    def run(*args: str) -> Result:
        return CliRunner().invoke(cli, list(args), env=env)

    return run


@pytest.fixture
def spread(make_topic: Callable[[int], str], rclient: redis.Redis) -> str:
    """A 4-partition topic whose entry i has id 1000+i in partition i % 4, key k<i>, value {"n": i}."""
    topic = make_topic(4)
    for i in range(12):
        fields: dict[Any, Any] = {"key": f"k{i}", "value": json.dumps({"n": i})}
        if i == 10:
            fields["headers"] = json.dumps({"trace": "t10"})
        rclient.xadd(stream_key(topic, i % 4), fields, id=f"{1000 + i}-0")
    return topic


def lines(result: Result) -> list[dict[str, object]]:
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


def one_line_error(result: Result) -> str:
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_the_tail_of_all_partitions_in_id_order(invoke: Callable[..., Result], spread: str) -> None:
    got = lines(invoke("topic", "read", spread, "--count", "5", "--json"))
    assert [e["id"] for e in got] == [f"{i}-0" for i in range(1007, 1012)]
    assert [(e["partition"], e["key"], e["value"]) for e in got] == [
        (i % 4, f"k{i}", {"n": i}) for i in range(7, 12)
    ]
    assert got[3]["headers"] == {"trace": "t10"} and got[0]["headers"] == {}
    assert len(lines(invoke("topic", "read", spread, "--json"))) == 10  # the default count

    human = invoke("topic", "read", spread, "--count", "2")
    assert human.output.splitlines() == [
        '1010-0  p2  k10  {"n":10}  headers {"trace":"t10"}',
        '1011-0  p3  k11  {"n":11}',
    ]


def test_one_partition(invoke: Callable[..., Result], spread: str) -> None:
    got = lines(invoke("topic", "read", spread, "--partition", "1", "--json"))
    assert [e["id"] for e in got] == ["1001-0", "1005-0", "1009-0"]
    assert {e["partition"] for e in got} == {1}
    err = invoke("topic", "read", spread, "--partition", "4")
    assert err.exit_code == 2 and "--partition" in one_line_error(err)


@pytest.mark.parametrize(
    "start", ["1003-0", "1003", "1970-01-01T00:00:01.003Z", "1970-01-01T00:00:01.003+00:00"]
)
def test_from_an_id_or_a_time(invoke: Callable[..., Result], spread: str, start: str) -> None:
    got = lines(invoke("topic", "read", spread, "--from", start, "--count", "3", "--json"))
    assert [e["id"] for e in got] == ["1003-0", "1004-0", "1005-0"]


def test_values_that_are_not_json(
    invoke: Callable[..., Result], make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    rclient.xadd(stream, {"value": msgspec.msgpack.encode({"a": [1, 2]}), "encoding": "msgpack"})
    rclient.xadd(stream, {"key": "k", "value": b"plain text"})
    rclient.xadd(stream, {"value": b"\xff\x00"})
    rclient.xadd(stream, {"user": "u1", "amount": "3"})
    rclient.xadd(stream, {"value": b"1", "headers": b"not json"})
    rclient.xadd(stream, {"value": b"two\nlines"})
    got = lines(invoke("topic", "read", topic, "--json"))
    assert [(e["value"], e["encoding"]) for e in got] == [
        ({"a": [1, 2]}, "msgpack"),
        ("plain text", "text"),
        ("b'\\xff\\x00'", "bytes"),
        ({"user": "u1", "amount": "3"}, "flat"),
        (1, "json"),
        ("two\nlines", "text"),
    ]
    assert got[1]["key"] == "k" and got[0]["key"] is None
    assert got[4]["headers"] == "not json"
    human = invoke("topic", "read", topic).output.splitlines()
    assert human[1].endswith("  p0  k  plain text") and human[2].endswith("  b'\\xff\\x00'")
    assert len(human) == 6 and human[5].endswith('  "two\\nlines"')


def test_errors_are_one_line(invoke: Callable[..., Result], names: Names, spread: str) -> None:
    missing = invoke("topic", "read", names.topic())
    assert missing.exit_code == 4 and "does not exist" in one_line_error(missing)
    for bad in ("yesterday", "12-x", "2026-13-40T00:00:00Z"):
        result = invoke("topic", "read", spread, "--from", bad)
        assert result.exit_code == 2 and "--from" in one_line_error(result), bad


def test_follow_prints_new_entries_until_ctrl_c(redis_url: str, spread: str, rclient: redis.Redis) -> None:
    args = ["topic", "read", spread, "--count", "1", "--follow", "--json", "--broker", redis_url]
    with subprocess.Popen(
        pspf_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), cwd=ROOT
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline())["id"] == "1011-0"  # started: the tail is out
        rclient.xadd(stream_key(spread, 2), {"key": "new", "value": '{"n": 99}'})
        new = json.loads(proc.stdout.readline())
        assert (new["partition"], new["key"], new["value"]) == (2, "new", {"n": 99})
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == b""


def test_following_goes_on_after_the_entries_shown(
    service: Service, spread: str, rclient: redis.Redis
) -> None:
    shown, positions = service.reading.read_topic(spread, start=StreamId(1003, 0), count=3)
    assert [e.id for e in shown] == ["1003-0", "1004-0", "1005-0"]
    rest = itertools.islice(service.reading.follow_topic(spread, positions, block_ms=100), 6)
    assert [e.id for e in rest] == [f"{i}-0" for i in range(1006, 1012)]

    tail, positions = service.reading.read_topic(spread, count=2)
    assert [e.id for e in tail] == ["1010-0", "1011-0"]
    rclient.xadd(stream_key(spread, 0), {"value": "7"}, id="1012-0")
    new = next(service.reading.follow_topic(spread, positions, block_ms=100))
    assert (new.id, new.partition, new.value) == ("1012-0", 0, 7)
