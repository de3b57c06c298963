"""The Spark source in Structured Streaming: per-partition offsets in Spark's checkpoint.

A query reading a 4-partition topic into Parquet files is stopped while entries are still being
produced and micro-batches run, then restarted from its checkpoint with
``trigger(availableNow=True)``: its output holds every entry exactly once. A query whose unread
entries were trimmed fails clearly, or reads on with ``fail_on_data_loss`` false.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark source needs Java 17+)", allow_module_level=True)

from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

from pspf.keys import MAX_SEQ, StreamId, partition_for, stream_key
from pspf.spark.reading import StreamState
from pspf.spark.topic_stream import Position, initial_position, trimmed_after

pytestmark = [pytest.mark.integration, pytest.mark.spark]

PARTITIONS = 4


def produce(client: redis.Redis, topic: str, numbers: range) -> None:
    """Entries ``{"n": i}``, keyed (every third keyless), in one pipeline per call."""
    pipe = client.pipeline(transaction=False)
    for i in numbers:
        fields = {b"value": msgspec.json.encode({"n": i})}
        partition = i % PARTITIONS
        if i % 3:
            key = f"k{i % 101}".encode()
            fields[b"key"] = key
            partition = partition_for(key, PARTITIONS)
        pipe.xadd(stream_key(topic, partition), fields)
    pipe.execute()


def start(
    spark: SparkSession, url: str, topic: str, folder: Path, available_now: bool, **options: str
) -> StreamingQuery:
    source = spark.readStream.format("pspf").option("broker", url).option("topic", topic).options(**options)
    writer = (
        source.load()
        .selectExpr("partition", "id", "get_json_object(value, '$.n') as n")
        .writeStream.format("parquet")
        .option("path", str(folder / "out"))
        .option("checkpointLocation", str(folder / "checkpoint"))
    )
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="200 milliseconds").start()


def output(spark: SparkSession, folder: Path) -> Counter[int]:
    """How often each number is in the query's output (committed files only, by the sink's log)."""
    if not (folder / "out").exists():
        return Counter()
    return Counter(int(row.n) for row in spark.read.parquet(str(folder / "out")).select("n").collect())


def test_a_query_stopped_and_restarted_mid_stream_reads_every_entry_exactly_once(
    spark: SparkSession,
    redis_url: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic = make_topic(PARTITIONS)
    total = 12_000
    produce(rclient, topic, range(0, 3000))

    def keep_producing() -> None:
        for at in range(3000, total, 500):
            produce(rclient, topic, range(at, at + 500))
            time.sleep(0.3)

    producer = threading.Thread(target=keep_producing)
    query = start(spark, redis_url, topic, tmp_path, False, max_entries_per_trigger="700")
    producer.start()
    try:
        deadline = time.monotonic() + 120
        while len(query.recentProgress) < 4 and time.monotonic() < deadline:
            assert query.exception() is None
            time.sleep(0.2)
        assert len(query.recentProgress) >= 4
    finally:
        query.stop()  # mid-stream: a micro-batch may be running
        producer.join()
    before = output(spark, tmp_path)
    assert 0 < sum(before.values()) < total
    assert max(before.values()) == 1

    again = start(spark, redis_url, topic, tmp_path, True, max_entries_per_trigger="5000")
    again.awaitTermination(300)
    assert again.exception() is None
    after = output(spark, tmp_path)
    assert sorted(after) == list(range(total))  # none missing
    assert set(after.values()) == {1}  # none twice
    assert len(again.recentProgress) >= 2  # the rest in more than one micro-batch: the limit held

    produce(rclient, topic, range(total, total + 100))
    last = start(spark, redis_url, topic, tmp_path, True)
    last.awaitTermination(300)
    assert output(spark, tmp_path) == Counter(range(total + 100))


def test_trimmed_unread_entries_fail_the_query_or_are_skipped_on_request(
    spark: SparkSession,
    redis_url: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic = make_topic(PARTITIONS)
    produce(rclient, topic, range(0, 400))
    if "entries-added" not in rclient.xinfo_stream(stream_key(topic, 0)):
        pytest.skip("the server does not report trimmed ids (Redis 6.2)")
    first = start(spark, redis_url, topic, tmp_path, True)
    first.awaitTermination(120)
    assert output(spark, tmp_path) == Counter(range(400))

    produce(rclient, topic, range(400, 800))
    for p in range(PARTITIONS):  # retention trims entries the query has not read
        stream = stream_key(topic, p)
        rclient.xtrim(stream, maxlen=10, approximate=False)
    failed = start(spark, redis_url, topic, tmp_path, True)
    with pytest.raises(StreamingQueryException, match="which the query had yet to read, were trimmed"):
        failed.awaitTermination(120)

    skipping = start(spark, redis_url, topic, tmp_path, True, fail_on_data_loss="false")
    skipping.awaitTermination(120)
    assert skipping.exception() is None
    read = output(spark, tmp_path)
    assert set(read.values()) == {1}
    assert sum(read.values()) == 400 + 10 * PARTITIONS  # what was left of the trimmed streams


def state(first: int | None, generated: int | None, length: int, added: int | None) -> StreamState:
    """A stream's XINFO: entries ``first``-0 on (ms), last id ``generated``-0, ``added`` ever added."""
    return StreamState(
        {
            "length": length,
            "first-entry": None if first is None else (f"{first}-0".encode(), {}),
            "last-generated-id": None if generated is None else f"{generated}-0".encode(),
            "entries-added": added,
        }
    )


def test_initial_positions_and_what_counts_as_trimmed() -> None:
    # Entries 1-0 to 9-0 added, 1-0 to 4-0 trimmed: 5-0 to 9-0 are left.
    stream = state(5, 9, 5, 9)
    assert initial_position(stream, "earliest") == Position(str(StreamId(4, MAX_SEQ)), 4)
    assert initial_position(stream, "latest") == Position("9-0", 9)
    # An empty stream (never written, or all of it trimmed) starts after its last id either way.
    assert initial_position(state(None, 9, 0, 9), "earliest") == Position("9-0", 9)
    assert initial_position(state(None, None, 0, None), "earliest") == Position("0-0", None)

    assert trimmed_after(stream, Position("4-0", 4)) is None  # read up to the trim
    assert trimmed_after(stream, Position("2-0", 2)) == 2  # 3-0 and 4-0 were unread
    assert trimmed_after(stream, Position("6-0", 6)) is None  # the first entry left was read
    assert trimmed_after(state(None, 9, 0, 9), Position("3-0", 3)) == 6  # all of it trimmed
    assert trimmed_after(state(5, 9, 5, 9), Position("3-0", None)) is None  # Redis 6.2: unknown
    # Sparse ids: 1-0, 10-0, 20-0 added and 1-0 trimmed; a query after 1-0 lost nothing.
    assert trimmed_after(state(10, 20, 2, 3), Position("1-0", 1)) is None
