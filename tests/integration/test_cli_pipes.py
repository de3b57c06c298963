"""Commands piped into a reader that stops early (``pspf state export APP | head -5``) end quietly.

A reader that has what it wants closes the pipe while the command is still writing: the command
stops writing, says nothing on stderr and exits 0, so a ``set -o pipefail`` script goes on. (A
large output written at once, like ``--json``, already ended that way: CPython's buffered
writer reports a short write, not the broken pipe.)
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

from pspf.failures import DeadLetter
from pspf.keys import STATE_NAMESPACE, StreamId, dlq_key
from pspf.state_stores import open_store
from tests.conftest import ROOT, Names, pspf_command, subprocess_env

pytestmark = pytest.mark.integration

#: Values in the store: their export (about 1.5 MB) is far larger than a pipe holds (64 KB).
VALUES = 50_000
DEAD = 5_000


def close_early(
    args: list[str], env: dict[str, str], first_bytes: int | None = None
) -> tuple[bytes, str, int]:
    """Run a pspf command, read its first line (or bytes), close the pipe: (read, stderr, exit)."""
    with subprocess.Popen(
        pspf_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        read = proc.stdout.readline() if first_bytes is None else proc.stdout.read(first_bytes)
        proc.stdout.close()  # what `head` does once it has what it wants
        stderr = proc.stderr.read().decode(errors="replace")
        return read, stderr, proc.wait(timeout=120)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """An app's store with VALUES keys."""
    directory = tmp_path / "state"
    with open_store("sqlite", directory, "big-app", 0) as store, store.transaction() as tx:
        for n in range(VALUES):
            tx.set(STATE_NAMESPACE, f"key-{n:06d}", msgspec.msgpack.encode({"n": n}))
        tx.set_checkpoint("orders", StreamId(1, 0))
    return directory


def assert_quiet(stderr: str, code: int) -> None:
    assert "Traceback" not in stderr and "Error" not in stderr and "Exception" not in stderr, stderr
    assert stderr == ""
    assert code == 0


def test_state_export_into_a_closed_pipe_ends_quietly(state_dir: Path) -> None:
    first, stderr, code = close_early(
        ["state", "export", "big-app", "--state-dir", str(state_dir)], subprocess_env()
    )
    assert json.loads(first) == {
        "kind": "checkpoints",
        "partition": 0,
        "checkpoints": {"orders": "1-0"},
        "internal": False,
    }
    assert_quiet(stderr, code)


@pytest.mark.parametrize("as_json", [False, True], ids=["lines", "json"])
def test_state_list_into_a_closed_pipe_ends_quietly(state_dir: Path, as_json: bool) -> None:
    args = ["state", "list", "big-app", "--state-dir", str(state_dir), *(["--json"] if as_json else [])]
    read, stderr, code = close_early(args, subprocess_env(), 20 if as_json else None)
    assert read.startswith(b'["key-000000",' if as_json else b"key-000000\n")
    assert_quiet(stderr, code)


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_dlq_list_into_a_closed_pipe_ends_quietly(
    make_topic: Callable[[int], str], names: Names, rclient: redis.Redis, redis_url: str, as_json: bool
) -> None:
    topic, app = make_topic(1), names.app()
    pipe = rclient.pipeline(transaction=False)
    for n in range(DEAD):
        record = DeadLetter(
            source_topic=topic,
            source_partition=0,
            source_id=f"{n + 1}-0",
            app=app,
            consumer="c",
            original={b"key": b"k", b"value": b"{}"},
            error_type="ValueError",
            message=f"entry {n} failed",
            traceback="",
            attempts=1,
            first_failed_ms=1,
            last_failed_ms=1,
        )
        pipe.xadd(dlq_key(topic, 0), record.to_fields())  # type: ignore[arg-type]
    pipe.execute()
    args = ["dlq", "list", topic, *(["--json"] if as_json else [])]
    read, stderr, code = close_early(args, subprocess_env(PSPF_BROKER=redis_url), 20 if as_json else None)
    assert read.startswith(b'[{"dlq_id":"0:' if as_json else b"DLQ ID")
    assert_quiet(stderr, code)


def test_a_shell_pipeline_into_head_prints_only_the_lines(state_dir: Path) -> None:
    """What a user types: with pipefail the status is the command's, 0."""
    command = shlex.join(pspf_command("state", "export", "big-app", "--state-dir", str(state_dir)))
    script = f"set -o pipefail; {command} | head -5"
    done = subprocess.run(["bash", "-c", script], capture_output=True, env=subprocess_env(), cwd=ROOT)
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 5 and json.loads(lines[1])["key"] == "key-000000"
    assert_quiet(done.stderr.decode(), done.returncode)
