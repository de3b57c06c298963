"""Spark 4: ``format("pspf")`` writes DataFrames into topics and reads topics, app state and tables.

Example:
    import pspf.spark

    pspf.spark.register(spark)
    spark.read.format("pspf").option("broker", url).option("topic", "orders").load()

Needs pyspark 4.1+ and pyarrow (``pip install 'pspf[spark]'``) and Java 17+; ``import pspf`` does
not import this package. The rooms:

- ``datasource``: the data source Spark registers (``register``, ``PSPFDataSource``), and which
  reader or writer the options ask for, checked on the driver;
- ``connection``: the options every read and write takes (``broker``), and a connection;
- ``writer``: the writing side: rows encoded per Arrow batch, chunks written idempotently with
  markers, trimming that never removes an unread entry, writes routed again after a repartition;
- ``reading``: what every read shares: the row schemas, the options, reading entries into Arrow;
- ``topic_batch``, ``topic_stream``: a topic read in batch (ranges fixed on the driver) and as a
  stream (offsets per partition in Spark's checkpoint);
- ``state_read``: an app's state or a table, read from the partitions' state backups.

Spark finds the data source by ``register``; the names below are this package's public path.
"""

from __future__ import annotations

from pspf.spark.connection import broker_url, connected
from pspf.spark.datasource import NAME, PSPFDataSource, register, source_schema
from pspf.spark.reading import STATE_SCHEMA, TABLE_SCHEMA, TOPIC_SCHEMA
from pspf.spark.writer import PSPFBatchWriter, PSPFStreamWriter, SinkCommitMessage, SinkOptions

__all__ = [
    "NAME",
    "STATE_SCHEMA",
    "TABLE_SCHEMA",
    "TOPIC_SCHEMA",
    "PSPFBatchWriter",
    "PSPFDataSource",
    "PSPFStreamWriter",
    "SinkCommitMessage",
    "SinkOptions",
    "broker_url",
    "connected",
    "register",
    "source_schema",
]
