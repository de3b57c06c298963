"""Sinks: deliver a topic into an external store, each entry's effect once; a new sink goes here.

A sink is an ordinary PSPF consumer (a ``Worker`` whose one handler stages each entry), in one of
two tiers named by their guarantee:

- transactional (``TransactionalSink``): the rows and the checkpoints that cover them are written
  in one transaction of the target (PostgreSQL);
- idempotent (``IdempotentSink``): each batch is one object whose name is deterministic in its
  entries, written all or nothing, so a rewrite replaces (files, object stores).

The rooms:

- ``base``: what both tiers share (``Sink``: the consumer machinery; ``SinkPartition``,
  ``SinkStore``; the records; refused rows and an unreachable target) and the transactional tier;
- ``idempotent``: the idempotent tier (``IdempotentSink``, ``IdempotentPartition``, ``BatchName``);
- ``postgres``: the PostgreSQL sink (psycopg 3); ``pspf.sink_postgres`` is its public path;
- ``iceberg``: the Apache Iceberg sink (pyiceberg; rows and position in one snapshot); ``pspf.sink.iceberg``.

A new sink is one more room beside ``postgres``, written against one tier (``docs/how-to/sinks.md``).
This face re-exports ``base`` and ``idempotent`` only, so importing it needs no database driver.
"""

from __future__ import annotations

from pspf.sink.base import (
    RowsRefused,
    Sink,
    SinkPartition,
    SinkRecord,
    SinkRefused,
    SinkStore,
    TransactionalSink,
    Updates,
)
from pspf.sink.idempotent import BatchName, IdempotentPartition, IdempotentSink

__all__ = [
    "BatchName",
    "IdempotentPartition",
    "IdempotentSink",
    "RowsRefused",
    "Sink",
    "SinkPartition",
    "SinkRecord",
    "SinkRefused",
    "SinkStore",
    "TransactionalSink",
    "Updates",
]
