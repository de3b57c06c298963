"""What ``pspf run TARGET`` loads: ``module:attribute``, imported with the current directory on the path.

A target that is not what it should be is refused in one line that says what to type instead:
a file path gets its module name (and where to run it), a module that is not found says whether
the current directory, which is always on the path, or a package found on the way lacks it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pspf.app import App
from pspf.errors import ConfigError, PSPFError


def load_app(target: str) -> App:
    """Import ``module:attribute`` (from the current directory too) and return its App."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"target {target!r} must look like MODULE:ATTRIBUTE, e.g. app:main")
    if _looks_like_a_file(module_name):
        raise ConfigError(_file_target_error(target, module_name, attribute))
    cwd = Path.cwd()
    if "" not in sys.path and str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"cannot import module {module_name!r}: {_not_found(exc.name, cwd)}") from exc
        raise ConfigError(f"importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(found, App) and callable(found):
        found = _call_factory(target, found)
    if not isinstance(found, App):
        raise ConfigError(
            f"{target} is a {type(found).__name__}, not a pspf.App (or a function returning one)"
        )
    return found


def _looks_like_a_file(module_name: str) -> bool:
    """A module name has no path separator and no ``.py`` (which would import a module ``py``)."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _file_target_error(target: str, module_name: str, attribute: str) -> str:
    """Why a file path is refused, and the module name (and directory) that loads that file."""
    cwd = Path.cwd()
    file = cwd / module_name
    named = f"target {target!r} names a file"
    if not file.is_file():
        named += f", and {file} does not exist"
    module = file.with_suffix("") if file.suffix == ".py" else file
    if not module.name.isidentifier():
        return f"{named}: {module.name} is no module name (letters, digits and _): rename the file"
    here = f"{module.name}:{attribute}"
    try:
        parts = module.relative_to(cwd).parts
    except ValueError:
        parts = ()
    if not parts or not all(part.isidentifier() for part in parts):
        return f"{named}: use the module name, {here}, run in {module.parent}"
    dotted = f"{'.'.join(parts)}:{attribute}"
    on_path = f"(the current directory {cwd} is on the path)"
    if len(parts) == 1:
        return f"{named}: use the module name, {dotted} {on_path}"
    return f"{named}: use the module name, {dotted} {on_path}, or {here} run in {module.parent}"


def _not_found(missing: str, cwd: Path) -> str:
    """Where the missing module was looked for: the path (current directory first) or its package."""
    package, _, name = missing.rpartition(".")
    if not package:
        where = f"in the current directory {cwd} (which is on the path) or elsewhere on the path"
        return f"no module {missing!r} {where}"
    places = list(getattr(sys.modules.get(package), "__path__", []))
    where = f" ({places[0]})" if places else ""
    return f"package {package!r}{where} has no module {name!r}"


def _call_factory(target: str, factory: Callable[..., Any]) -> Any:
    try:
        required = [
            p
            for p in inspect.signature(factory).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required:
        raise ConfigError(
            f"{target} takes arguments; point pspf run at an App or a function without arguments"
        )
    try:
        return factory()
    except PSPFError:
        raise
    except Exception as exc:
        raise ConfigError(f"calling {target} failed: {type(exc).__name__}: {exc}") from exc
