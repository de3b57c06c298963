"""``pspf run TARGET`` given a file path, or run from the wrong directory: one line that says what to type.

Each case runs ``pspf run`` as a process in a project directory of its own, as a user's shell
would, and then runs the target the error suggests, which must work.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import pspf_command, subprocess_env

pytestmark = pytest.mark.integration

APP_SOURCE = """\
import os

from pspf import App

main = App("targets-" + os.environ["PSPF_TEST_TOPIC"])


@main.handler(os.environ["PSPF_TEST_TOPIC"])
def handle(value, ctx):
    pass
"""

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """``proj/app.py`` and ``proj/jobs/app.py`` (a directory without ``__init__.py``)."""
    root = tmp_path / "proj"
    (root / "jobs").mkdir(parents=True)
    (root / "app.py").write_text(APP_SOURCE)
    (root / "jobs" / "app.py").write_text(APP_SOURCE)
    return root


@pytest.fixture
def run(redis_url: str, make_topic: Callable[[int], str], tmp_path: Path) -> Run:
    env = subprocess_env(PSPF_TEST_TOPIC=make_topic(1), PSPF_STATE_DIR=str(tmp_path / "state"))

    def pspf_run(target: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        command = pspf_command("run", target, "--broker", redis_url, "--until-idle", "--block-ms", "100")
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=60)

    return pspf_run


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refused run (exit 2, nothing else printed)."""
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and done.stdout == "", done.stderr
    return lines[0]


def test_a_file_name_says_to_use_the_module_name(run: Run, project: Path) -> None:
    assert refused(run("app.py:main", project)) == (
        f"Error: target 'app.py:main' names a file: use the module name, app:main "
        f"(the current directory {project} is on the path)"
    )
    assert run("app:main", project).returncode == 0


def test_a_file_in_a_subdirectory_says_both_ways(run: Run, project: Path) -> None:
    assert refused(run("jobs/app.py:main", project)) == (
        f"Error: target 'jobs/app.py:main' names a file: use the module name, jobs.app:main "
        f"(the current directory {project} is on the path), or app:main run in {project / 'jobs'}"
    )
    assert run("jobs.app:main", project).returncode == 0
    assert run("app:main", project / "jobs").returncode == 0


def test_a_file_elsewhere_says_where_to_run(run: Run, project: Path, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    target = f"{project / 'app.py'}:main"
    assert refused(run(target, tmp_path / "other")) == (
        f"Error: target '{target}' names a file: use the module name, app:main, run in {project}"
    )


def test_a_missing_file_is_named_missing(run: Run, project: Path) -> None:
    assert refused(run("jobs/nope.py:main", project)) == (
        f"Error: target 'jobs/nope.py:main' names a file, and {project / 'jobs' / 'nope.py'} does not "
        f"exist: use the module name, jobs.nope:main (the current directory {project} is on the path), "
        f"or nope:main run in {project / 'jobs'}"
    )


def test_a_run_from_another_directory_says_the_current_one_is_on_the_path(
    run: Run, project: Path, tmp_path: Path
) -> None:
    assert refused(run("app:main", tmp_path)) == (
        f"Error: cannot import module 'app': no module 'app' in the current directory {tmp_path} "
        "(which is on the path) or elsewhere on the path"
    )
    assert refused(run("jobs.app:main", project / "jobs")) == (
        f"Error: cannot import module 'jobs.app': no module 'jobs' in the current directory "
        f"{project / 'jobs'} (which is on the path) or elsewhere on the path"
    )


def test_a_missing_module_of_a_found_package_names_the_package(run: Run, project: Path) -> None:
    assert refused(run("jobs.nope:main", project)) == (
        f"Error: cannot import module 'jobs.nope': package 'jobs' ({project / 'jobs'}) has no module 'nope'"
    )
