"""The Spark sink in Structured Streaming: replays and retries write every row exactly once.

The input is a file source over JSON files read one per micro-batch (``maxFilesPerTrigger=1``),
so a replayed micro-batch yields the same rows in the same order, as the sink's markers need.
Each file holds 12,000 rows: more than one Arrow batch (10,000 rows) of the Python writer and six
chunks of 2,000 rows, so when a task fails at row 11,000 of a file its writer has been handed the
first Arrow batch, which it writes (five chunks) while Spark retries or replays the task. The
queries run with ``trigger(availableNow=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

import pyarrow as pa
from pyspark import TaskContext
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pspf.keys import stream_key
from pspf.spark import PSPFDataSource, PSPFStreamWriter, SinkCommitMessage
from tests.conftest import ClusterServer, RedisServer, standalone_only
from tests.spark.conftest import TopicReader, arrow_batch_rows, failing_ids

pytestmark = [pytest.mark.integration, pytest.mark.spark]

FILE_ROWS = 12_000
SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("user", StringType()),
        StructField("amount", LongType()),
    ]
)
ARROW_SCHEMA = pa.schema([("id", pa.int64()), ("user", pa.string()), ("amount", pa.int64())])


def write_files(folder: Path, files: int, rows: int = FILE_ROWS) -> int:
    """``files`` JSON-lines files of ``rows`` orders with consecutive ids; returns the row count.

    Their modification times increase one second per file: the file source takes new files in
    that order, so micro-batch ``i`` reads file ``i``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    next_id = 0
    for f in range(files):
        path = folder / f"orders-{f:03d}.json"
        with path.open("w") as out:
            for i in range(next_id, next_id + rows):
                out.write(json.dumps({"id": i, "user": f"u{i * 7919 % 500}", "amount": i % 97 + 1}) + "\n")
        next_id += rows
        stamp = 1_700_000_000 + f
        os.utime(path, (stamp, stamp))
    return next_id


def start_query(
    spark: SparkSession,
    source: Path,
    checkpoint: Path,
    url: str,
    topic: str,
    ids: Callable[[Any], Any] | None = None,
    **options: str,
) -> StreamingQuery:
    df = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
    if ids is not None:
        df = df.withColumn("id", ids(F.col("id")))
    writer = (
        df.writeStream.format("pspf")
        .option("broker", url)
        .option("topic", topic)
        .option("key", "user")
        .options(**options)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
    )
    return writer.start()


def committed_batches(checkpoint: Path) -> list[int]:
    return sorted(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())


def test_replays_after_a_query_died_mid_batch_and_after_a_lost_commit_write_each_row_once(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    topics: TopicReader,
    tmp_path: Path,
) -> None:
    topic = make_topic(4)
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    rows = write_files(source, 6)
    fail_flag = f"{topic}:fail"
    rclient.set(fail_flag, 1)
    # Micro-batch 3 (file 3) fails at its row 11,000 on every attempt while the flag is set.
    ids = failing_ids(3 * FILE_ROWS + 11_000, url=redis_url, fail_while_key=fail_flag)

    # 1. The query dies in micro-batch 3 after its tasks wrote part of the batch.
    query = start_query(spark, source, checkpoint, redis_url, topic, ids)
    with pytest.raises(StreamingQueryException, match="injected failure"):
        query.awaitTermination()
    assert committed_batches(checkpoint) == [0, 1, 2]
    partial = topics.settled_count(topic, 4) - 3 * FILE_ROWS
    assert 0 < partial < FILE_ROWS  # batches 0-2 whole, batch 3 in part

    # 2. Restarted from its checkpoint, it replays batch 3 (skipping the chunks written) and goes on.
    rclient.delete(fail_flag)
    query = start_query(spark, source, checkpoint, redis_url, topic, ids)
    query.awaitTermination()
    assert committed_batches(checkpoint) == [0, 1, 2, 3, 4, 5]
    counts = topics.id_counts(topic, 4)
    assert set(counts) == set(range(rows))
    assert max(counts.values()) == 1
    assert topics.count(topic, 4) == rows

    # 3. The commit of the last batch is lost (as when the driver dies between the sink's write and
    # Spark's commit): the restarted query replays batch 5 in full, and writes nothing twice.
    for name in ("5", ".5.crc"):
        (checkpoint / "commits" / name).unlink()
    query = start_query(spark, source, checkpoint, redis_url, topic, ids)
    query.awaitTermination()
    assert committed_batches(checkpoint) == [0, 1, 2, 3, 4, 5]
    progress = query.lastProgress
    assert progress is not None
    assert (progress.batchId, progress.numInputRows) == (5, FILE_ROWS)  # batch 5 did run again
    assert topics.count(topic, 4) == rows
    assert max(topics.id_counts(topic, 4).values()) == 1


@pytest.mark.parametrize(
    "arrow_rows",
    [
        pytest.param(None, id="arrow-batches-of-10000"),
        # See test_batch_retry_after_a_truncated_input_with_idempotency_key_loses_no_rows.
        pytest.param(2_100, id="arrow-batches-of-2100"),
    ],
)
def test_task_retried_in_a_micro_batch_writes_each_row_once(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    topics: TopicReader,
    tmp_path: Path,
    arrow_rows: int | None,
) -> None:
    """A failed attempt's writer sees its rows end early, cleanly, after the Arrow batches Spark
    had sent it (a multiple of 10,000 rows by default, of 2,100 with the second parameter): with
    batches that are not a multiple of the sink's 2,000-row chunk, its last chunk is short.
    """
    topic = make_topic(4)
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    rows = write_files(source, 3)
    # Attempt 0 of micro-batch 1's task fails at row 11,000 of file 1; its retry, as it starts,
    # records how many entries of batch 1 the failed attempt wrote.
    ids = failing_ids(
        FILE_ROWS + 11_000,
        url=redis_url,
        probe_at=FILE_ROWS,
        probe=lambda c: sum(int(c.xlen(stream_key(topic, p))) for p in range(4)) - FILE_ROWS,
        probe_key=f"{topic}:probe",
    )

    with arrow_batch_rows(spark, arrow_rows):
        start_query(spark, source, checkpoint, redis_url, topic, ids).awaitTermination()

    assert committed_batches(checkpoint) == [0, 1, 2]
    # The failed attempt had written part of batch 1 before its retry started.
    left_behind = int(rclient.get(f"{topic}:probe") or 0)
    assert 0 < left_behind < FILE_ROWS
    topics.settled_count(topic, 4)
    counts = topics.id_counts(topic, 4)
    assert sorted(set(range(rows)) - set(counts)) == []  # nothing missing
    assert max(counts.values()) == 1  # nothing twice
    assert topics.count(topic, 4) == rows


@standalone_only  # a URL of one server
def test_bad_options_fail_the_query_before_any_write_and_mask_the_password(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    redis_server: RedisServer | ClusterServer,
    topics: TopicReader,
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    source = tmp_path / "in"
    write_files(source, 1, rows=100)
    secret_url = f"redis://pspf-nobody:s3cret@127.0.0.1:{redis_server.port}/0"

    for n, (url, options, message) in enumerate(
        [
            (redis_url, {"keys": "user"}, "unknown pspf sink option(s) ['keys']"),
            (redis_url, {"value": "customer"}, "value column 'customer' is not in the DataFrame"),
            (secret_url, {}, "invalid username-password pair"),
        ]
    ):
        checkpoint = tmp_path / f"checkpoint-{n}"
        query = start_query(spark, source, checkpoint, url, topic, **options)
        with pytest.raises(StreamingQueryException) as failed:
            query.awaitTermination()
        text = str(failed.value)
        assert message in text
        assert "s3cret" not in text
        assert committed_batches(checkpoint) == []
        assert topics.count(topic, 2) == 0


class FakeTaskContext:
    """Sets the pyspark TaskContext a stream writer reads, as a micro-batch's task would see it."""

    def __init__(self, query_id: str, batch_id: int, partition: int = 0) -> None:
        self.properties = {"sql.streaming.queryId": query_id, "streaming.sql.batchId": str(batch_id)}
        self.partition = partition

    def __enter__(self) -> None:
        context = TaskContext._getOrCreate()
        context._partitionId = self.partition
        context._attemptNumber = 0
        context._localProperties = self.properties

    def __exit__(self, *exc: object) -> None:
        TaskContext._setTaskContext(None)


def test_stream_writer_write_path_called_again_for_a_batch_writes_nothing_twice(
    make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    """The sink's own write path, without a Spark job: a batch written in part, then again, twice."""
    topic = make_topic(4)
    schema = SCHEMA
    writer = PSPFDataSource({"broker": redis_url, "topic": topic, "key": "user"}).streamWriter(schema, False)
    assert isinstance(writer, PSPFStreamWriter)
    rows = [{"id": i, "user": f"u{i % 37}", "amount": i % 97} for i in range(9_000)]

    def batches(rows: list[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        """The rows as Spark hands them to the writer: Arrow batches (of 1,500 rows here)."""
        table = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
        return iter(table.to_batches(max_chunksize=1_500))

    def dies_after(n: int) -> Iterator[pa.RecordBatch]:
        yield from batches(rows[:n])
        raise RuntimeError("executor lost")

    with FakeTaskContext("q-1", batch_id=7):
        # A first attempt dies while reading past row 4,999: chunks 0 and 1 (rows 0-3,999) are written.
        with pytest.raises(RuntimeError, match="executor lost"):
            writer.write(dies_after(5_000))
        assert topics.count(topic, 4) == 4_000
        # The retry writes the rest; a third call of the same batch writes nothing.
        again = writer.write(batches(rows))
        assert isinstance(again, SinkCommitMessage)
        assert again.written == 5_000
        third = writer.write(batches(rows))
        assert third.written == 0
        assert third.skipped_chunks > 0
    assert topics.count(topic, 4) == 9_000
    assert max(topics.id_counts(topic, 4).values()) == 1

    # Another micro-batch, or the same batch of another Spark partition, is a new write.
    with FakeTaskContext("q-1", batch_id=8):
        assert writer.write(batches(rows[:10])).written == 10
    with FakeTaskContext("q-1", batch_id=7, partition=1):
        assert writer.write(batches(rows[:10])).written == 10
    assert topics.count(topic, 4) == 9_020

    # Outside a streaming query's task the stream writer refuses to write.
    with pytest.raises(RuntimeError, match="outside a streaming query"):
        writer.write(batches(rows[:10]))
