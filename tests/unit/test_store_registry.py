"""The store engine registry: the one list the docs, the settings and ``open_store`` agree with."""

from __future__ import annotations

from pathlib import Path

import pytest

from pspf.errors import ConfigError
from pspf.state_stores import engines, file_engines, open_store

DOCS = Path(__file__).resolve().parents[2] / "docs"
SHIPPED = [name for name, engine in engines().items() if engine.store_class.startswith("pspf.")]


@pytest.mark.parametrize("name", [n for n in SHIPPED if engines()[n].suffix is not None])
def test_the_docs_name_every_engine_pspf_ships(name: str) -> None:
    """A registered engine is in the engine table, the settings reference and the CLI reference."""
    assert f"| `{name}`" in (DOCS / "how-to" / "state.md").read_text()
    store_row = next(
        line
        for line in (DOCS / "reference" / "settings.md").read_text().splitlines()
        if "`PSPF_STORE`" in line
    )
    assert f"`{name}`" in store_row
    flag_row = next(
        line for line in (DOCS / "reference" / "cli.md").read_text().splitlines() if "`--store " in line
    )
    assert name in flag_row


def test_an_unknown_or_memory_engine_is_refused_with_the_choices(tmp_path: Path) -> None:
    assert file_engines()[:2] == ["sqlite", "rocksdb"]
    for name in ("nosuch", "memory"):
        with pytest.raises(ConfigError, match=rf"unknown state store engine '{name}'; choose one of \["):
            open_store(name, tmp_path, "g", 0)
    assert engines()["memory"].load()().get("ns", "k") is None
