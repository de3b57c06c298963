"""The Spark sink and ``pspf topic repartition``: writes go to the topic's current partitions.

Covers: a write after a repartition (4 to 8) and one during it, every entry in its key's new
partition; a task routed with the old count and layout (the driver read them before the switch)
whose chunks the guard refuses and that routes them again, also when the switch came between its
partitions (8 to 3: no entry in a partition that is gone, none lost, none twice); and a write
while the topic record says a repartition runs, which fails after ``repartition_wait_s`` having
written nothing, on the driver and in a task.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import RedisCluster

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

import msgspec
import pyarrow as pa
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pspf import Producer
from pspf.broker import Broker
from pspf.codec import KEY, VALUE
from pspf.keys import layout_key, partition_for, sink_marker_key, stream_key, topic_key
from pspf.repartition.run import Repartition, make_plan
from pspf.settings import RedisSettings
from pspf.spark import PSPFBatchWriter, SinkCommitMessage, SinkOptions
from pspf.spark.writer import sink_options
from tests.conftest import client_for
from tests.spark.conftest import TopicReader, arrow_batch_rows

pytestmark = [pytest.mark.integration, pytest.mark.spark]

USERS = 101
SCHEMA = StructType([StructField("id", LongType()), StructField("user", StringType())])


def repartition(url: str, topic: str, partitions: int) -> None:
    """What ``pspf topic repartition TOPIC --partitions N`` does for a topic no app reads."""
    broker = Broker(RedisSettings(url=url))
    try:
        Repartition(broker, make_plan(broker, topic, partitions)).run()
    finally:
        broker.close()


def users(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "id", f"concat('u', cast(id % {USERS} as string)) as user"
    )


def batches(rows: range) -> Iterator[pa.RecordBatch]:
    """The rows of ``users`` as the Arrow batches a task of the sink receives."""
    yield pa.record_batch(
        [pa.array(rows, pa.int64()), pa.array([f"u{i % USERS}" for i in rows], pa.string())],
        schema=pa.schema([("id", pa.int64()), ("user", pa.string())]),
    )


def written(client: redis.Redis | RedisCluster, topic: str, partitions: int) -> dict[int, int]:
    """id -> how many entries of the topic carry it, checking each is in its key's partition."""
    counts: dict[int, int] = {}
    for partition in range(partitions):
        for _, fields in client.xrange(stream_key(topic, partition)):
            assert partition_for(fields[KEY], partitions) == partition, (fields, partition)
            n = msgspec.json.decode(fields[VALUE])["id"]
            assert fields[KEY] == f"u{n % USERS}".encode()
            counts[n] = counts.get(n, 0) + 1
    return counts


def no_stream_beyond(client: redis.Redis | RedisCluster, topic: str, partitions: int, old: int) -> None:
    """No stream of a partition the topic no longer has: a stale write would have made one."""
    assert not any(client.exists(stream_key(topic, p)) for p in range(partitions, old))


def seal_by_hand(client: redis.Redis | RedisCluster, topic: str, partitions: range) -> None:
    """What a repartition's seal does (topic record first, then each partition's guard)."""
    client.hset(topic_key(topic), "moving", "1")
    for partition in partitions:
        client.set(layout_key(topic, partition), "moving")


def test_a_write_after_a_repartition_goes_to_the_new_partitions(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis | RedisCluster,
) -> None:
    topic = make_topic(4)
    broker = Broker(RedisSettings(url=redis_url))
    with Producer(broker) as producer:
        for n in range(-500, 0):
            producer.send(topic, {"id": n}, key=f"u{n % USERS}")
    broker.close()
    repartition(redis_url, topic, 8)

    users(spark, 20_000, 2).write.format("pspf").options(
        broker=redis_url, topic=topic, key="user", idempotency_key="after"
    ).mode("append").save()

    assert written(rclient, topic, 8) == {n: 1 for n in range(-500, 20_000)}
    assert all(rclient.xlen(stream_key(topic, p)) > 0 for p in range(4, 8))
    # The markers name the layout they were written in.
    assert any(rclient.exists(sink_marker_key(topic, p, "batch:after:0:0:g1")) for p in range(8))
    assert not any(rclient.exists(sink_marker_key(topic, p, "batch:after:0:0")) for p in range(8))


def test_a_repartition_during_a_write_loses_nothing_and_doubles_nothing(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis | RedisCluster,
    topics: TopicReader,
) -> None:
    """One task; at row 12,000 its input runs the repartition (4 to 8), once it has written entries.

    The input is a UDF's column, 200 bytes a row: the UDF's worker sends its rows on as its output
    buffer fills, so the task's writer has rows before the UDF holds row 12,000 back.
    """
    topic = make_topic(4)
    url, started = redis_url, f"{topic}:started"

    def note(i: int) -> str:
        if i == 12_000:
            client = client_for(url)
            try:
                if client.set(started, 0, nx=True):  # once, whatever Spark retries
                    deadline = time.monotonic() + 10
                    count = TopicReader(client).count(topic, 4)
                    while count == 0 and time.monotonic() < deadline:
                        time.sleep(0.05)
                        count = TopicReader(client).count(topic, 4)
                    client.set(started, count)
                    repartition(url, topic, 8)
            finally:
                client.close()
        return f"{i:0200d}"

    udf = F.udf(note, StringType(), useArrow=False).asNondeterministic()
    with arrow_batch_rows(spark, 1_000):
        users(spark, 30_000, 1).withColumn("note", udf("id")).write.format("pspf").options(
            broker=redis_url, topic=topic, key="user", idempotency_key="during"
        ).mode("append").save()

    before = int(rclient.get(started) or 0)
    assert 0 < before < 30_000, "the switch came while the task wrote"
    assert topics.settled_count(topic, 8) == 30_000
    assert written(rclient, topic, 8) == {n: 1 for n in range(30_000)}


def test_a_task_routed_in_the_old_layout_routes_its_refused_chunks_again(
    make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis | RedisCluster
) -> None:
    """The driver read 8 partitions; the topic has 3 when the task writes."""
    topic = make_topic(8)
    options = {"broker": redis_url, "topic": topic, "key": "user", "idempotency_key": "stale"}
    stale = sink_options(options, SCHEMA)
    assert (stale.partitions, stale.layout) == (8, "0")
    repartition(redis_url, topic, 3)

    done = PSPFBatchWriter(stale, SCHEMA).write(batches(range(3_000)))

    assert done == SinkCommitMessage(written=3_000, skipped_chunks=0)
    no_stream_beyond(rclient, topic, 3, 8)
    assert written(rclient, topic, 3) == {n: 1 for n in range(3_000)}
    # Chunk 0, refused whole, went again without markers; chunk 1 was cut in the new layout.
    assert not any(rclient.exists(sink_marker_key(topic, p, "batch:stale:0:0:g1")) for p in range(3))
    assert any(rclient.exists(sink_marker_key(topic, p, "batch:stale:0:1:g1")) for p in range(3))


def test_a_switch_between_a_chunks_partitions_loses_nothing_and_doubles_nothing(
    make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis | RedisCluster
) -> None:
    """Partitions 0-3 take chunk 0 (with its markers), 4-7 are sealed: the repartition (8 to 3)
    moves what 0-3 took, and the task routes what 4-7 refused again. Markers of chunk 0 are then
    in partitions 0-2 of both layouts: entries routed again under them would be skipped."""
    topic = make_topic(8)
    options = {"broker": redis_url, "topic": topic, "key": "user", "idempotency_key": "half"}
    stale = sink_options({**options, "repartition_wait_s": "60"}, SCHEMA)
    seal_by_hand(rclient, topic, range(4, 8))
    outcome: list[SinkCommitMessage | BaseException] = []

    def task() -> None:
        try:
            outcome.append(PSPFBatchWriter(stale, SCHEMA).write(batches(range(3_000))))
        except BaseException as exc:  # reported by the test thread
            outcome.append(exc)

    thread = threading.Thread(target=task)
    thread.start()
    deadline = time.monotonic() + 20
    while not all(rclient.xlen(stream_key(topic, p)) for p in range(4)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(rclient.xlen(stream_key(topic, p)) for p in range(4))
    assert not any(rclient.exists(stream_key(topic, p)) for p in range(4, 8))  # refused, waiting
    assert thread.is_alive()
    assert any(rclient.exists(sink_marker_key(topic, p, "batch:half:0:0")) for p in range(3))
    repartition(redis_url, topic, 3)
    thread.join(30)

    assert not thread.is_alive()
    assert outcome == [SinkCommitMessage(written=3_000, skipped_chunks=0)]
    no_stream_beyond(rclient, topic, 3, 8)
    assert written(rclient, topic, 3) == {n: 1 for n in range(3_000)}


def test_a_write_while_a_repartition_runs_fails_after_the_wait_and_writes_nothing(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis | RedisCluster,
    topics: TopicReader,
) -> None:
    topic = make_topic(4)
    options = {"broker": redis_url, "topic": topic, "key": "user", "repartition_wait_s": "0.5"}
    before: SinkOptions = sink_options(options, SCHEMA)  # a driver that read the topic before the seal
    seal_by_hand(rclient, topic, range(4))

    started = time.monotonic()
    with pytest.raises(AnalysisException) as on_driver:
        users(spark, 1_000, 2).write.format("pspf").options(**options).mode("append").save()
    assert time.monotonic() - started < 30
    text = str(on_driver.value)
    assert f"topic {topic!r} is being repartitioned and was not done within 0.5s" in text
    assert "PYTHON_DATA_SOURCE_ERROR" in text  # the driver's check: no task ran

    with pytest.raises(RuntimeError) as in_task:
        PSPFBatchWriter(before, SCHEMA).write(batches(range(1_000)))
    text = str(in_task.value)
    assert text.startswith("pspf sink writing to redis")
    assert f"topic {topic!r} is being repartitioned and was not done within 0.5s" in text

    assert topics.count(topic, 4) == 0
    assert all(rclient.get(layout_key(topic, p)) == b"moving" for p in range(4))
