"""The built wheel, installed in a fresh virtual environment, runs an app from another directory.

The repository keeps ``cli/``, ``admin_api/`` and ``state_stores/`` at its top level; the wheel must
install them under ``pspf`` only, with no generic top-level package that would clash with another
project's ``cli``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

APP = """
from pspf import App, Context

app = App("wheel-check")


@app.handler("{topic}")
def add(order: dict, ctx: Context) -> None:
    ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), "."],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("pspf-*.whl")
    return built


def test_the_wheel_installs_everything_under_the_pspf_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"pspf"}
    for module in ("cli/main.py", "admin_api/app.py", "state_stores/sqlite.py", "py.typed"):
        assert f"pspf/{module}" in names
    assert any(name.startswith("pspf/lua/") for name in names)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "pspf = pspf.cli:cli" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_wheel_runs_an_app_from_another_directory(
    wheel: Path,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Nothing of the checkout on the path: the app runs on what the wheel installed. (With the
    # checkout on PYTHONPATH, pip would take the pspf.egg-info the wheel's build left there for an
    # installed pspf and install nothing.)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSPF_", "PYTHON"))}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True, env=env
    )
    assert install.returncode == 0, install.stderr

    topic = make_topic(2)
    produce(topic, [(f"u{i % 3}", {"amount": i}) for i in range(1, 31)])
    project = tmp_path / "elsewhere"
    project.mkdir()
    (project / "shop.py").write_text(APP.format(topic=topic))
    env.update(PSPF_BROKER=redis_url, PSPF_STATE_DIR=str(tmp_path / "state"), PSPF_BLOCK_MS="100")

    where = subprocess.run(
        [str(python), "-c", "import pspf.cli, sys; print(pspf.cli.__file__); import cli"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert str(env_dir) in where.stdout
    assert "No module named 'cli'" in where.stderr

    pspf_command = str(env_dir / "bin" / "pspf")
    run = subprocess.run(
        [pspf_command, "run", "shop:app", "--until-idle"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    state = subprocess.run(
        [pspf_command, "state", "get", "wheel-check", "u1", "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert state.returncode == 0, state.stderr
    assert json.loads(state.stdout)["total"] == sum(i for i in range(1, 31) if i % 3 == 1)
