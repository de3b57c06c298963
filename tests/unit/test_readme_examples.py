"""CI runs every example the README tells users to run, so an example cannot break unnoticed.

An example command (``python examples/...``, run as written: it starts its own server)
is the first line of a code fence that follows a marker comment ``<!-- NAME -->``; ``.ci/run``
runs the commands of the markers in its ``examples=(...)`` list. ``pspf run examples...`` lines
need a server of the user's, so CI cannot run them; their MODULE:ATTRIBUTE must still load, in the
README and in the documentation pages it sends readers to.
"""

from __future__ import annotations

import re

from pspf import App
from pspf.cli.main import load_app
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
DOCS = sorted((ROOT / "docs").rglob("*.md"))


def shell_lines(text: str = README) -> list[tuple[int, str]]:
    """(line index, text) of every line inside the ``sh`` code fences of a Markdown text."""
    lines = text.splitlines()
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


def run_targets(text: str) -> set[str]:
    """The MODULE:ATTRIBUTE of every ``pspf run examples...`` line in a text's shell fences."""
    return {m for _, line in shell_lines(text) for m in re.findall(r"pspf run (examples\.\S+)", line)}


def test_every_app_the_readme_runs_with_pspf_run_loads() -> None:
    targets = run_targets(README)
    assert targets, "the README runs no example app"
    for target in targets:
        assert isinstance(load_app(target), App), target


def test_every_app_the_docs_run_with_pspf_run_loads() -> None:
    targets = {target: page for page in DOCS for target in run_targets(page.read_text())}
    assert targets, "no documentation page runs an example app"
    for target, page in targets.items():
        assert isinstance(load_app(target), App), f"{target} in {page.relative_to(ROOT)}"
