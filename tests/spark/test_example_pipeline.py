"""The README's Spark example, ``python examples/spark_pipeline.py``, runs and checks its own result.

It runs as a user runs it (a subprocess, its own embedded server, nothing of the tests'
set-up), on fewer orders than its default so that it stays quick. CI also runs the README's
command as written (``.ci/run``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_spark_pipeline_example_runs_and_its_state_matches_the_input() -> None:
    done = subprocess.run(
        [sys.executable, "examples/spark_pipeline.py", "--orders", "3000"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert done.returncode == 0, done.stderr[-3000:]
    assert "every user's state equals the totals computed from the file" in done.stdout
    assert 'df.write.format("pspf")' in done.stdout
