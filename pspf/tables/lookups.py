"""Looking rows up: what a worker's batches look up in, and the checks made before any entry.

``Lookups`` is what ``ctx.table`` reads through: the app's tables (``pspf.tables.table``), its
partition count and the global tables (``pspf.tables.global_tables``). A lookup's key must be of
the entry's partition (any key for a global table); the app's functions are checked for literal
names of tables it does not declare, and a table for the app's partition count.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pspf import codec, keys
from pspf.errors import ConfigError

if TYPE_CHECKING:
    from pspf.tables.global_tables import GlobalTables

from pspf.tables.table import Table, TableError


def check_lookup_key(table: Table, key: Any, partition: int, partitions: int, what: str) -> str:
    """``key`` when a lookup of ``table`` may use it here; TableError naming both partitions if not."""
    if type(key) is not str:
        raise TableError(f"{what}: the key must be a string, not {type(key).__name__}")
    if not table.is_global:
        owner = keys.partition_for(codec.encode_text("key", key), partitions)
        if owner != partition:
            raise TableError(
                f"{what}: key {key!r} is in partition {owner} of table {table.name!r}, this "
                f"entry's partition is {partition}; a table is looked up by keys of the entry's "
                "partition (a global table by any key)"
            )
    return key


class Lookups:
    """What a worker's batches look rows up in: the app's tables, its partition count, the global tables."""

    __slots__ = ("global_tables", "partitions", "tables")

    def __init__(
        self, tables: dict[str, Table], partitions: int, global_tables: GlobalTables | None = None
    ) -> None:
        self.tables = tables
        self.partitions = partitions
        self.global_tables = global_tables

    def table(self, name: str, what: str) -> Table:
        table = self.tables.get(name)
        if table is None:
            declared = ", ".join(repr(n) for n in sorted(self.tables)) or "none"
            raise TableError(f"{what}({name!r}): the app has no table {name!r} (its tables: {declared})")
        return table


def check_lookup_names(app: str, declared: Iterable[str], functions: Iterable[Callable[..., Any]]) -> None:
    """Refuse, before any entry, a function that looks up a table the app does not declare.

    Only literal names are seen (``ctx.table("name")`` on one of its parameters); other names are
    checked when looked up, and functions whose source cannot be read are not checked.
    """
    names = set(declared)
    for func in functions:
        try:
            lines, first = inspect.getsourcelines(func)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        for name, line in _literal_lookups(tree):
            if name not in names:
                tables = ", ".join(repr(n) for n in sorted(names)) or "none"
                where = f"{inspect.getsourcefile(func)}:{first + line - 1}"
                raise ConfigError(
                    f"{func.__qualname__} ({where}) looks up table {name!r}, which app {app!r} does "
                    f"not declare (its tables: {tables}): declare it with app.table({name!r}) or "
                    f"app.global_table({name!r})"
                )


def _literal_lookups(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(name, line) of each ``PARAM.table("name", ...)`` in a function's source."""
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        return
    params = {a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "table"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in params
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def check_table_partitions(app: str, tables: list[str], counts: dict[str, int]) -> None:
    """Refuse a table whose topic's partition count is not the app's other topics' (one line)."""
    others = {count for topic, count in counts.items() if topic not in tables}
    for table in tables:
        if others and counts[table] not in others:
            theirs = ", ".join(str(n) for n in sorted(others))
            raise ConfigError(
                f"table {table!r} of app {app!r} has {counts[table]} partitions, the app's other "
                f"topics have {theirs}: a table must have the app's partition count (a global "
                "table may have any)"
            )
