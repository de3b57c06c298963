"""`pspf produce` given bytes that are not UTF-8 (on the command line or in its input): one line,
exit 2, nothing written for the bad input."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.keys import stream_key
from tests.conftest import pspf_command, subprocess_env

pytestmark = pytest.mark.integration


def _pspf(*args: str | bytes, redis_url: str, stdin: bytes = b"") -> tuple[int, str]:
    """Run the CLI with raw bytes in argv; its exit code and stderr."""
    done = subprocess.run(
        [*pspf_command(), *args],
        env=subprocess_env(PSPF_BROKER=redis_url),
        input=stdin,
        capture_output=True,
        timeout=60,
    )
    return done.returncode, done.stderr.decode(errors="replace")


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


def test_non_utf8_key_value_topic_and_input_lines_are_one_line_errors(
    make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    topic = make_topic(2)

    code, stderr = _pspf("produce", topic, "--key", b"\xff", '{"a": 1}', redis_url=redis_url)
    assert code == 2 and "key '\\udcff' is not valid UTF-8" in _one_error_line(stderr)

    code, stderr = _pspf("produce", topic, "--key", "u1", b'{"a": "\xff"}', redis_url=redis_url)
    assert code == 2 and "invalid JSON" in _one_error_line(stderr)

    code, stderr = _pspf("produce", b"t\xff", '{"a": 1}', redis_url=redis_url)
    assert code == 2 and "invalid topic name" in _one_error_line(stderr)

    code, stderr = _pspf("state", "get", "some-app", b"\xff", redis_url=redis_url)
    assert code == 2 and "key '\\udcff' is not valid UTF-8" in _one_error_line(stderr)

    assert rclient.xlen(stream_key(topic, 0)) + rclient.xlen(stream_key(topic, 1)) == 0

    # NDJSON input whose second line is not UTF-8: from a file with --key-field, and from stdin.
    lines = b'{"user": "a", "n": 1}\n{"user": "b", "note": "\xff"}\n{"user": "c", "n": 3}\n'
    (tmp_path / "orders.ndjson").write_bytes(lines)
    code, stderr = _pspf(
        "produce",
        topic,
        "--key-field",
        "user",
        "--file",
        str(tmp_path / "orders.ndjson"),
        redis_url=redis_url,
    )
    assert code == 2
    assert "line 2: invalid JSON: not valid UTF-8" in _one_error_line(stderr)
    assert "(1 entry written before it)" in stderr
    code, stderr = _pspf("produce", topic, redis_url=redis_url, stdin=lines)
    assert code == 2 and "line 2: invalid JSON: not valid UTF-8" in _one_error_line(stderr)
    assert rclient.xlen(stream_key(topic, 0)) + rclient.xlen(stream_key(topic, 1)) == 2


@pytest.mark.parametrize(
    "args",
    [
        ("topic", "describe", b"\xff"),
        ("dlq", "list", b"\xff"),
        ("dlq", "show", b"\xff", "0:1-1"),
        ("dlq", "redrive", b"\xff", "--all"),
        ("dlq", "purge", b"\xff", "--all", "--yes"),
    ],
    ids=lambda args: " ".join(a for a in args if isinstance(a, str)),
)
def test_commands_naming_a_topic_refuse_a_name_that_is_not_utf8(
    args: tuple[str | bytes, ...], redis_url: str
) -> None:
    code, stderr = _pspf(*args, redis_url=redis_url)
    assert code == 2, stderr
    assert "invalid topic name" in _one_error_line(stderr)
