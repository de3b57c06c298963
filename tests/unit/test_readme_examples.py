"""CI runs every example the README tells users to run, so an example cannot break unnoticed.

An example command (``python examples/...``, run as written: it starts its own server)
is the first line of a code fence that follows a marker comment ``<!-- NAME -->``; ``.ci/run``
runs the commands of the markers in its ``examples=(...)`` list. ``pspf run examples...`` lines
need a server of the user's, so CI cannot run them; their MODULE:ATTRIBUTE must still load.
"""

from __future__ import annotations

import re

from pspf import App
from pspf.cli.main import load_app
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def shell_lines() -> list[tuple[int, str]]:
    """(line index, text) of every line inside the README's ``sh`` code fences."""
    lines = README.splitlines()
    found, inside = [], False
    for index, line in enumerate(lines):
        if line.startswith("```"):
            inside = not inside and line.strip() in ("```sh", "```bash")
        elif inside:
            found.append((index, line))
    return found


def marker_of(index: int) -> str | None:
    """The marker comment two lines above a fence's first line, if any."""
    lines = README.splitlines()
    if index < 2 or not lines[index - 1].startswith("```"):
        return None
    found = re.fullmatch(r"<!-- ([a-z-]+) -->", lines[index - 2].strip())
    return found.group(1) if found else None


def ci_example_markers() -> list[str]:
    found = re.search(r"^examples=\(([^)]*)\)", CI, re.MULTILINE)
    assert found, ".ci/run has no examples=(...) list"
    return found.group(1).split()


def test_every_example_command_in_the_readme_is_run_by_ci() -> None:
    examples = [(i, line) for i, line in shell_lines() if "python examples/" in line]
    assert examples, "the README names no example to run"
    unmarked = [line for i, line in examples if marker_of(i) is None]
    assert unmarked == [], "give each a <!-- NAME-command --> marker and add NAME to .ci/run's examples"
    not_run = [marker_of(i) for i, _ in examples if marker_of(i) not in ci_example_markers()]
    assert not_run == [], ".ci/run's examples=(...) must list these markers"


def test_every_marker_ci_runs_is_in_the_readme() -> None:
    for name in [*ci_example_markers(), "test-command"]:
        assert f"<!-- {name} -->" in README, name


def test_every_app_the_readme_runs_with_pspf_run_loads() -> None:
    targets = {m for _, line in shell_lines() for m in re.findall(r"pspf run (examples\.\S+)", line)}
    assert targets, "the README runs no example app"
    for target in targets:
        assert isinstance(load_app(target), App), target
