"""``format("pspf")``: the data source Spark registers, and which reader or writer its options ask for.

``register`` makes it available in a Spark session. A write goes to ``pspf.spark.writer``; a read
of a topic to ``topic_batch`` or ``topic_stream``, of an app's state or a table to ``state_read``.
Options are checked here, on the driver, before any task runs. This room imports every other one
at its top, so no room imports another from inside a function.
"""

from __future__ import annotations

from pspf.errors import ConfigError
from pspf.spark.connection import CONNECTION_OPTIONS, SPARK_OPTIONS
from pspf.spark.reading import STATE_SCHEMA, TABLE_SCHEMA, TOPIC_SCHEMA
from pspf.spark.state_read import StateReader, plan_state_read
from pspf.spark.topic_batch import TopicReader, plan_topic_read
from pspf.spark.topic_stream import TopicStreamReader, plan_stream_read
from pspf.spark.writer import PSPFBatchWriter, PSPFStreamWriter, sink_options

try:
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        DataSourceStreamArrowWriter,
        DataSourceStreamReader,
    )
    from pyspark.sql.types import StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Spark data source needs pyspark 4.1+ and pyarrow: pip install 'pspf[spark]'"
    ) from exc

NAME = "pspf"

_BATCH_TOPIC_OPTIONS = {"topic", "start_id", "end_id", "start_time", "end_time", "max_entries_per_split"}
_STREAM_TOPIC_OPTIONS = {"topic", "starting", "max_entries_per_trigger", "fail_on_data_loss"}
_STATE_OPTIONS = {"state"}
_TABLE_OPTIONS = {"table", "app"}


def register(spark: SparkSession) -> None:
    """Make ``format("pspf")`` available in this Spark session."""
    spark.dataSource.register(PSPFDataSource)


class PSPFDataSource(DataSource):
    """``format("pspf")``: writes rows into topics; reads topics, state and tables (batch and streaming)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return source_schema(dict(self.options))

    def reader(self, schema: StructType) -> DataSourceReader:
        return batch_reader(dict(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return stream_reader(dict(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        return PSPFBatchWriter(sink_options(dict(self.options), schema), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        return PSPFStreamWriter(sink_options(dict(self.options), schema), schema)


def _what(options: dict[str, str]) -> str:
    """Which read the options ask for: ``topic``, ``state`` or ``table`` (exactly one is given)."""
    given = [name for name in ("topic", "state", "table") if options.get(name)]
    if len(given) != 1:
        raise ConfigError(
            'the pspf source reads one thing: give exactly one of .option("topic", ...), '
            f'.option("state", app) or .option("table", ...); given: {given or "none"}'
        )
    return given[0]


def source_schema(options: dict[str, str]) -> StructType:
    """The schema of what the options read (the rows of a topic, of an app's state or of a table)."""
    return {"topic": TOPIC_SCHEMA, "state": STATE_SCHEMA, "table": TABLE_SCHEMA}[_what(options)]


def _check_options(options: dict[str, str], schema: StructType, known: set[str]) -> None:
    """ConfigError for an option this read does not take, or a schema that is not the source's."""
    allowed = known | CONNECTION_OPTIONS | SPARK_OPTIONS
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown pspf source option(s) {unknown} for this read; known: {sorted(allowed)}")
    expected = source_schema(options)
    if [(f.name, f.dataType) for f in schema.fields] != [(f.name, f.dataType) for f in expected.fields]:
        raise ConfigError(
            f"the pspf source gives the schema {expected.simpleString()}, not {schema.simpleString()}"
        )


def batch_reader(options: dict[str, str], schema: StructType) -> DataSourceReader:
    """The reader of ``spark.read.format("pspf")``, its options checked here, on the driver."""
    what = _what(options)
    if what == "topic":
        _check_options(options, schema, _BATCH_TOPIC_OPTIONS)
        return TopicReader(plan_topic_read(options))
    _check_options(options, schema, _STATE_OPTIONS if what == "state" else _TABLE_OPTIONS)
    return StateReader(plan_state_read(options, what))


def stream_reader(options: dict[str, str], schema: StructType) -> DataSourceStreamReader:
    """The reader of ``spark.readStream.format("pspf")`` (topics only)."""
    if _what(options) != "topic":
        raise ConfigError("the pspf source streams topics only: read state and tables with spark.read")
    _check_options(options, schema, _STREAM_TOPIC_OPTIONS)
    return TopicStreamReader(plan_stream_read(options))
