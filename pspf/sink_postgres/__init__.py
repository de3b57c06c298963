"""The public path of the PostgreSQL sink (``from pspf.sink_postgres import PostgresSink``).

The sink itself lives with the other sinks, in ``pspf.sink.postgres``; it needs psycopg 3
(``pip install 'pspf[postgres]'``), and importing this path without it raises ImportError.
"""

from __future__ import annotations

from pspf.sink.postgres import Mode, PostgresPartition, PostgresSink, connect, forget, mask_dsn

__all__ = ["Mode", "PostgresPartition", "PostgresSink", "connect", "forget", "mask_dsn"]
