"""Tables: state built from a topic, looked up by handlers with ``ctx.table``.

The rooms:

- ``table``: a table (``App.table``, the app's partition count): its changelog topic applied in
  the app's batches, its rows and their history for parked entries;
- ``global_tables``: the global tables (``App.global_table``), whole, in each worker's own store,
  followed between batches;
- ``lookups``: what ``ctx.table`` reads through, and the checks made before any entry.

PSPF's own modules import the rooms by their full path, so no face sits in an import circle; the
names other wings use are re-exported here.
"""

from __future__ import annotations

from pspf.tables.global_tables import GlobalTables
from pspf.tables.lookups import Lookups, check_lookup_key, check_lookup_names, check_table_partitions
from pspf.tables.table import MISSING, Table, TableError, TableWrites, add_history, row_then

__all__ = [
    "MISSING",
    "GlobalTables",
    "Lookups",
    "Table",
    "TableError",
    "TableWrites",
    "add_history",
    "check_lookup_key",
    "check_lookup_names",
    "check_table_partitions",
    "row_then",
]
