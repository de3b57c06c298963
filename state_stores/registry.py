"""The store engines by name: the one list ``open_store``, the settings, the CLI and the docs read.

An engine is one module of this package with a ``StateStore`` subclass, plus one ``register_engine``
line at the bottom of this file (or in a test, for an engine of the tests). The class is imported
when a store of the engine is first opened, so an engine whose library is an optional extra costs
nothing to the users of the others.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pspf.errors import ConfigError

if TYPE_CHECKING:
    from pspf.state_stores.base import StateStore


@dataclass(frozen=True)
class Engine:
    """One store engine: where its class is and how its files are named."""

    name: str
    #: ``module:Class`` of the ``StateStore`` subclass, imported on first use
    store_class: str
    #: the suffix of a store's file or directory (``p3.sqlite``); None: it keeps nothing on disk,
    #: so it is not one ``open_store`` or ``--store`` offers (the memory engine of tests)
    suffix: str | None
    #: the pip extra that installs the engine's library (``pip install 'pspf[rocksdb]'``)
    extra: str | None = None

    def load(self) -> type[StateStore]:
        """The engine's class; a missing optional library names the extra that installs it."""
        module, _, name = self.store_class.partition(":")
        try:
            found: type[StateStore] = getattr(importlib.import_module(module), name)
        except ImportError as exc:
            if self.extra is None:
                raise
            needs = exc.name or f"the {self.extra} extra"
            raise ConfigError(
                f"the {self.name} store needs {needs}: pip install 'pspf[{self.extra}]'"
            ) from None
        return found


_ENGINES: dict[str, Engine] = {}


def register_engine(
    name: str, store_class: str, suffix: str | None = None, extra: str | None = None
) -> Engine:
    """Add an engine under ``name`` (replacing one of that name): the one line an engine needs."""
    engine = Engine(name, store_class, suffix, extra)
    _ENGINES[name] = engine
    return engine


def engines() -> dict[str, Engine]:
    """Every registered engine by name, in registration order (memory ones included)."""
    return dict(_ENGINES)


def file_engines() -> list[str]:
    """The names of the engines that keep stores on disk: what ``--store`` and ``PSPF_STORE`` take."""
    return [name for name, engine in _ENGINES.items() if engine.suffix is not None]


def file_engine(name: str) -> Engine:
    """The engine ``--store NAME`` names; a ConfigError lists the choices for an unknown one."""
    engine = _ENGINES.get(name)
    if engine is None or engine.suffix is None:
        raise ConfigError(f"unknown state store engine {name!r}; choose one of {sorted(file_engines())}")
    return engine


register_engine("sqlite", "pspf.state_stores.sqlite:SQLiteStore", suffix=".sqlite")
register_engine("rocksdb", "pspf.state_stores.rocksdb:RocksDBStore", suffix=".rocksdb", extra="rocksdb")
register_engine("memory", "pspf.state_stores.memory:MemoryStore")
