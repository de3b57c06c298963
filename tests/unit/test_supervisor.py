"""The supervisor of ``pspf run --workers``: its children's command lines, backoff and stopping.

The stopping tests run small stand-in children (no Redis) and feed the supervisor its signals
through its handler from another thread, as the interpreter would, without signalling pytest.
"""

from __future__ import annotations

import io
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pspf.cli.supervisor import Backoff, Supervisor, child_args
from pspf.errors import ConfigError


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "app:main", "--workers", "3"], ["run", "app:main", "--consumer", "c-1"]),
        (
            ["run", "--workers=3", "app:main", "--until-idle"],
            ["run", "app:main", "--until-idle", "--consumer", "c-1"],
        ),
        (
            ["-v", "run", "app:main", "--consumer", "mine", "--batch-size", "10", "--workers", "2"],
            ["-v", "run", "app:main", "--batch-size", "10", "--consumer", "c-1"],
        ),
        (
            ["run", "--consumer=mine", "--workers", "2", "--", "app:main"],
            ["run", "--consumer", "c-1", "--", "app:main"],
        ),
    ],
)
def test_a_child_runs_the_same_command_line_without_workers_and_with_its_name(
    args: list[str], expected: list[str]
) -> None:
    assert child_args(args, "c-1") == expected


def test_backoff_doubles_up_to_its_limit_and_starts_over_after_a_long_run() -> None:
    backoff = Backoff(first_s=0.5, factor=2.0, max_s=30.0, reset_after_s=60.0)
    delays = [backoff.next(None, 0.0)]
    for _ in range(8):
        delays.append(backoff.next(delays[-1], 1.0))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff.next(30.0, 61.0) == 0.5


def stand_in(tmp_path: Path, body: str) -> list[str]:
    """A child program: Python running ``body``, after it wrote its pid to ``tmp_path``."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "name = sys.argv[sys.argv.index('--consumer') + 1]\n"
        f"open(os.path.join({str(tmp_path)!r}, name + '.' + str(os.getpid())), 'w').close()\n" + body
    )
    return [sys.executable, str(script)]


def supervisor(tmp_path: Path, body: str, workers: int = 2, **kwargs: object) -> Supervisor:
    return Supervisor(
        ["run", "app:main"],
        workers,
        "c",
        program=stand_in(tmp_path, body),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
        **kwargs,  # type: ignore[arg-type]
    )


def starts(tmp_path: Path, name: str) -> int:
    return len(list(tmp_path.glob(f"{name}.*")))


def signal_later(sup: Supervisor, delay_s: float, *signums: int) -> threading.Thread:
    def send() -> None:
        for signum in signums:
            time.sleep(delay_s)
            sup._on_signal(signum, None)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


GRACEFUL = (
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "print('to stderr', file=sys.stderr, flush=True)\n"
    "time.sleep(60)\n"
)


def test_sigterm_reaches_every_child_and_a_clean_stop_exits_0(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, GRACEFUL)
    signal_later(sup, 1.5, signal.SIGTERM)
    assert sup.run() == 0
    assert starts(tmp_path, "c-1") == starts(tmp_path, "c-2") == 1
    assert isinstance(sup._stderr, io.StringIO) and isinstance(sup._stdout, io.StringIO)
    assert sup._stdout.getvalue() == "ready\nready\n"
    lines = sup._stderr.getvalue().splitlines()
    assert sorted(re.fullmatch(r"\[worker (\d) pid \d+\] to stderr", line)[1] for line in lines) == ["1", "2"]


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    sup = supervisor(tmp_path, body, workers=1, grace_s=1.0)
    signal_later(sup, 1.0, signal.SIGTERM)
    begun = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - begun < 5


def test_a_second_signal_kills_the_children_at_once(tmp_path: Path) -> None:
    body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    sup = supervisor(tmp_path, body, grace_s=30.0)
    signal_later(sup, 1.0, signal.SIGINT, signal.SIGINT)
    begun = time.monotonic()
    assert sup.run() == 128 + signal.SIGINT
    assert time.monotonic() - begun < 5


def test_a_crashing_child_is_restarted_with_backoff_and_one_that_exits_0_is_not(tmp_path: Path) -> None:
    # c-1 crashes twice, then exits 0; c-2 exits 0 at once.
    body = (
        "here = os.listdir(os.path.dirname(__file__))\n"
        "if name == 'c-1' and len([f for f in here if f.startswith('c-1.')]) < 3:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "sys.exit(0)\n"
    )
    sup = supervisor(tmp_path, body, backoff=Backoff(first_s=0.2, max_s=1.0))
    begun = time.monotonic()
    assert sup.run() == 0
    assert starts(tmp_path, "c-1") == 3 and starts(tmp_path, "c-2") == 1
    assert time.monotonic() - begun >= 0.2 + 0.4


def test_exit_2_of_one_child_stops_the_others_and_the_supervisor(tmp_path: Path) -> None:
    # c-2 fails only once the others are up, so that "started once" does not race their start-up.
    body = (
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "if name == 'c-2':\n"
        "    here = os.path.dirname(os.path.abspath(__file__))\n"
        "    while not {'c-1', 'c-3'} <= {f.split('.')[0] for f in os.listdir(here)}:\n"
        "        time.sleep(0.01)\n"
        "    print('Error: no good', file=sys.stderr, flush=True)\n"
        "    sys.exit(2)\n"
        "time.sleep(60)\n"
    )
    sup = supervisor(tmp_path, body, workers=3)
    with pytest.raises(ConfigError, match=r"^worker 2 stopped on a configuration error: no good$"):
        sup.run()
    assert [starts(tmp_path, f"c-{i}") for i in (1, 2, 3)] == [1, 1, 1]
