"""The import paths the docs name keep working after the modules moved into wings (packages)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

#: path -> names the docs, README and examples use from it
PUBLIC = {
    "pspf": [
        "App",
        "Context",
        "Producer",
        "ProcessorHooks",
        "RetryPolicy",
        "Settings",
        "Stream",
        "Worker",
        "agg",
    ],
    "pspf.dataflow": ["Stream", "WindowedStream", "agg"],
    "pspf.app": ["App"],
    "pspf.context": ["Context", "TimerContext"],
    "pspf.settings": ["Settings", "RedisSettings", "ConsumerSettings"],
    "pspf.keys": ["stream_key", "partition_for"],
    "pspf.errors": ["PSPFError", "ConfigError", "NonRetryableError"],
    "pspf.failures": ["RetryPolicy"],
    "pspf.hooks": ["ProcessorHooks"],
    "pspf.producer": ["Producer"],
    "pspf.embedded": ["LocalRedis", "LocalCluster", "LocalSentinel"],
    "pspf.testing": ["TestApp", "EmittedEntry"],
    "pspf.pytest_plugin": ["pspf_server", "pspf_settings"],
    "pspf.windows": ["WindowSpec", "tumbling", "hopping", "sliding", "session"],
    "pspf.worker": ["Worker", "RunSummary"],
    "pspf.service": ["Service"],
    "pspf.state_stores": ["StateStore", "MemoryStore"],
    "pspf.sink": ["Sink", "SinkPartition", "SinkRecord"],
    "pspf.cli": [],
}


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_a_public_path_imports_and_has_its_names(path: str) -> None:
    module = importlib.import_module(path)
    missing = [name for name in PUBLIC[path] if not hasattr(module, name)]
    assert missing == []


def test_the_windows_kinds_through_from_pspf_import_windows() -> None:
    from datetime import timedelta

    from pspf import windows

    spec = windows.tumbling(timedelta(minutes=1))
    assert isinstance(spec, windows.WindowSpec) and spec.kind == "tumbling" and spec.size_ms == 60_000


def test_the_postgres_sink_path() -> None:
    pytest.importorskip("psycopg")
    from pspf.sink import Sink
    from pspf.sink_postgres import PostgresSink

    assert issubclass(PostgresSink, Sink)


def test_the_spark_path_registers_the_data_source_by_its_module() -> None:
    """Spark pickles the data source class by reference: its module must import in the workers."""
    pytest.importorskip("pyspark")
    import pspf.spark

    assert pspf.spark.PSPFDataSource.name() == "pspf"
    code = f"import {pspf.spark.PSPFDataSource.__module__} as m; print(m.PSPFDataSource.name())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pspf"


def test_every_package_of_the_checkout_is_listed_for_the_wheel() -> None:
    """A package missing from pyproject.toml's list goes into the wheel only as data, with a warning."""
    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for init in (root / "pspf").rglob("__init__.py"):
        parts = init.parent.relative_to(root).parts
        if "__pycache__" not in parts:
            found.add(".".join(parts))
    assert len(found) > 15
    assert sorted(found - listed) == []
