"""Sinks: deliver a topic into an external store, each entry's effect once; a new sink goes here.

A sink is an ordinary PSPF consumer (a ``Worker`` whose one handler stages each entry) whose
commits are transactions of the external store: the rows and the checkpoints that cover them
are written together. The rooms:

- ``base``: the interface a sink implements (``Sink``, ``SinkPartition``), the records it is
  given, its store (``SinkStore``) and how refused rows and an unreachable target are handled;
- ``postgres``: the PostgreSQL sink (psycopg 3); ``pspf.sink_postgres`` is its public path.

A new sink is one more room beside ``postgres``, written against ``base`` (``docs/how-to/sinks.md``).
This face re-exports ``base`` only, so importing it needs no database driver.
"""

from __future__ import annotations

from pspf.sink.base import RowsRefused, Sink, SinkPartition, SinkRecord, SinkRefused, SinkStore, Updates

__all__ = ["RowsRefused", "Sink", "SinkPartition", "SinkRecord", "SinkRefused", "SinkStore", "Updates"]
