"""How the CLI prints what the service returns: the ``--json`` switch, JSON, tables and fields.

Every command renders its results through these helpers, so a table, a record's fields or a JSON
document look the same whichever command prints them, and the JSON is encoded from the service's
own records as the admin API's bodies are. Sentences that only one command says stay with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import click
import msgspec

F = TypeVar("F", bound=Callable[..., Any])


def json_option(func: F) -> F:
    """``--json``: the command prints JSON (its ``as_json`` argument) instead of text."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def json_text(value: Any) -> str:
    """``value`` as compact JSON on one line."""
    return msgspec.json.encode(value).decode()


def print_json(value: Any) -> None:
    click.echo(json_text(value))


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """Left-aligned columns two spaces apart; a missing value (None) shows as ``-``."""
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def print_fields(record: msgspec.Struct, skip: Iterable[str] = ()) -> None:
    """One ``name: JSON value`` line per field of ``record``, in its order."""
    for name in record.__struct_fields__:
        if name not in skip:
            click.echo(f"{name}: {json_text(getattr(record, name))}")


def age_text(seconds: float | None) -> str | None:
    """A duration for a table cell: seconds up to 2 minutes, minutes up to 2 hours, then hours."""
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def first_line(text: str, width: int = 60) -> str:
    """The first line of ``text`` for a table cell, cut to ``width`` with ``...``."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."
