"""The Spark sink in batch mode against a local Spark session and a real server.

Covers: a 100,000-row write (count, partition of every key, every value), the key/value/columns
options, option errors raised before any write, a task that fails halfway and is retried (with and
without ``idempotency_key``), and that a broker password never shows in an error.
"""

from __future__ import annotations

import shutil
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pspf.embedded import free_port
from pspf.keys import sink_marker_key, stream_key
from tests.conftest import ClusterServer, Names, RedisServer, standalone_only
from tests.spark.conftest import TopicReader, arrow_batch_rows, failing_ids

pytestmark = [pytest.mark.integration, pytest.mark.spark]

ROWS = 100_000


def orders(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """Rows ``id, user, amount, note`` computed from the id, so any row can be checked alone."""
    return spark.range(0, rows, numPartitions=partitions).selectExpr(
        "id",
        "concat('u', cast(id * 7919 % 1000 as string)) as user",
        "id % 97 + 1 as amount",
        "concat('n-', cast(id as string)) as note",
    )


def expected_order(i: int) -> tuple[str, dict[str, Any]]:
    """The (key, value) the sink must write for the row with id ``i`` of ``orders``."""
    return f"u{i * 7919 % 1000}", {"id": i, "amount": i % 97 + 1, "note": f"n-{i}"}


def pspf_write(df: DataFrame, url: str, topic: str | None, **options: str) -> None:
    writer = df.write.format("pspf").option("broker", url)
    if topic is not None:
        writer = writer.option("topic", topic)
    writer.options(**options).mode("append").save()


def test_batch_100k_rows_exact_and_in_their_key_partition(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    topic = make_topic(4)

    pspf_write(orders(spark, ROWS, 4), redis_url, topic, key="user")

    entries = topics.entries(topic, 4)
    assert len(entries) == ROWS
    seen: dict[int, tuple[str, dict[str, Any]]] = {}
    for partition, fields in entries:
        assert set(fields) == {b"key", b"value"}
        key = fields[b"key"]
        assert zlib.crc32(key) % 4 == partition
        value = msgspec.json.decode(fields[b"value"])
        seen[value["id"]] = (key.decode(), value)
    assert len(seen) == ROWS  # no id twice
    assert seen == {i: expected_order(i) for i in range(ROWS)}
    assert all(topics.client.xlen(stream_key(topic, p)) > 0 for p in range(4))


def test_value_and_columns_options_and_rows_without_a_key(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    df = spark.range(0, 8, numPartitions=1).selectExpr(
        "id",
        "if(id % 3 = 0, null, concat('k', cast(id as string))) as k",
        "named_struct('n', id, 'tags', array('a', 'b')) as s",
        "to_json(named_struct('raw', id)) as js",
    )
    as_struct, as_text, as_list = make_topic(2), make_topic(2), make_topic(2)

    pspf_write(df, redis_url, as_struct, key="k", value="s")
    pspf_write(df, redis_url, as_text, key="k", value="js")
    pspf_write(df, redis_url, as_list, key="k", columns="id, s")

    def by_id(topic: str, field: str) -> dict[int, tuple[bytes | None, Any]]:
        out: dict[int, tuple[bytes | None, Any]] = {}
        for partition, fields in topics.entries(topic, 2):
            key = fields.get(b"key")
            if key is not None:
                assert zlib.crc32(key) % 2 == partition
            value = msgspec.json.decode(fields[b"value"])
            out[value["id"] if field == "id" else value[field]] = (key, value)
        return out

    def key(i: int) -> bytes | None:
        return None if i % 3 == 0 else f"k{i}".encode()

    assert by_id(as_struct, "n") == {i: (key(i), {"n": i, "tags": ["a", "b"]}) for i in range(8)}
    # A string value column is taken as JSON text already and written unchanged.
    assert by_id(as_text, "raw") == {i: (key(i), {"raw": i}) for i in range(8)}
    assert by_id(as_list, "id") == {
        i: (key(i), {"id": i, "s": {"n": i, "tags": ["a", "b"]}}) for i in range(8)
    }
    # Rows without a key (ids 0, 3, 6) go round robin over the rows: both partitions get some.
    keyless = Counter(p for p, f in topics.entries(as_struct, 2) if b"key" not in f)
    assert sorted(keyless) == [0, 1]


def test_column_types_become_json_values(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    """Maps (also nested in structs and arrays) become objects; dates, timestamps and decimals text.

    Arrow hands the writer maps as lists of pairs: a regression test for writing those as arrays.
    """
    topic = make_topic(2)
    df = spark.range(0, 3, numPartitions=1).selectExpr(
        "id",
        "map('a', id, 'b', id + 1) as m",
        "named_struct('inner', map('x', cast(id as string))) as s",
        "array(map('k', id)) as l",
        "if(id = 2, null, map('n', id)) as maybe",
        "date_add(date'2026-11-21', cast(id as int)) as d",
        "timestamp_micros(1700000000000000 + id) as ts",
        "cast(id + 0.25 as decimal(10, 2)) as dec",
        "cast('ab' as binary) as bin",
    )
    pspf_write(df, redis_url, topic)

    got = sorted(topics.values(topic, 2), key=lambda v: v["id"])
    assert got == [
        {
            "id": i,
            "m": {"a": i, "b": i + 1},
            "s": {"inner": {"x": str(i)}},
            "l": [{"k": i}],
            "maybe": None if i == 2 else {"n": i},
            "d": f"2026-11-2{1 + i}",
            "ts": "2023-11-14T22:13:20" + (f".00000{i}" if i else "") + "Z",  # UTC, RFC 3339
            "dec": f"{i}.25",
            "bin": "YWI=",
        }
        for i in range(3)
    ]


def test_binary_key_column_is_written_as_its_bytes(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    """Kafka-shaped rows (binary ``key`` and ``value``): the key is its bytes, not their repr.

    A regression test: the encoder once keyed by ``str(record[key])``, so ``b"user-1"`` became
    the key ``b"b'user-1'"`` (in the partition of that text).
    """
    topic = make_topic(4)
    df = spark.range(0, 100, numPartitions=1).selectExpr(
        "cast(concat('user-', cast(id as string)) as binary) as key",
        "cast(to_json(named_struct('id', id)) as binary) as value",
    )

    pspf_write(df, redis_url, topic, key="key", value="value")

    got = {}
    for partition, fields in topics.entries(topic, 4):
        got[msgspec.json.decode(fields[b"value"])["id"]] = (partition, fields[b"key"])
    want = {i: (zlib.crc32(f"user-{i}".encode()) % 4, f"user-{i}".encode()) for i in range(100)}
    assert got == want


BAD_OPTIONS = [
    pytest.param("no-topic", {}, 'needs .option("topic"', id="missing-topic"),
    pytest.param(
        "exists",
        {"broker": "http://127.0.0.1:6379/0"},
        "scheme must be one of redis://, rediss://, unix://",
        id="bad-url-scheme",
    ),
    pytest.param(
        "exists", {"key": "customer"}, "key column 'customer' is not in the DataFrame", id="key-not-in-schema"
    ),
    pytest.param("missing", {}, "does not exist", id="topic-does-not-exist"),
    pytest.param("exists", {"keys": "user"}, "unknown pspf sink option(s) ['keys']", id="unknown-option"),
    pytest.param("exists", {"value": "note", "columns": "id"}, "not both", id="value-and-columns"),
    pytest.param("exists", {"maxlen": "10k"}, "maxlen must be a whole number", id="bad-maxlen"),
    pytest.param(
        "exists",
        {"repartition_wait_s": "0"},
        "repartition_wait_s must be a positive",
        id="bad-repartition-wait",
    ),
]


@pytest.mark.parametrize(("which_topic", "options", "message"), BAD_OPTIONS)
def test_bad_options_fail_before_any_write(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
    topics: TopicReader,
    which_topic: str,
    options: dict[str, str],
    message: str,
) -> None:
    existing = make_topic(4)
    missing = names.topic()
    topic = {"exists": existing, "missing": missing, "no-topic": None}[which_topic]
    options = {"broker": redis_url, **options}
    url = options.pop("broker")

    with pytest.raises(AnalysisException) as failed:
        pspf_write(orders(spark, 1_000, 2), url, topic, **({"key": "user"} | options))

    text = str(failed.value)
    assert message in text
    assert "PYTHON_DATA_SOURCE_ERROR" in text  # raised by the driver's option check, no task ran
    assert topics.count(existing, 4) == 0
    assert not any(rclient.exists(stream_key(missing, p)) for p in range(4))


def retried_write(
    spark: SparkSession,
    url: str,
    topic: str,
    probe: Callable[[redis.Redis], int] | None = None,
    **options: str,
) -> None:
    """40,000 rows in two Spark partitions; the task of partition 0 fails once at row 15,000.

    With ``probe``, its retry stores ``probe(client)`` in key ``<topic>:probe`` as it starts.
    """
    ids = failing_ids(15_000, url=url, probe_at=0, probe=probe, probe_key=f"{topic}:probe")
    df = orders(spark, 40_000, 2).withColumn("id", ids(F.col("id")))
    pspf_write(df, url, topic, key="user", **options)


def test_batch_task_retry_without_idempotency_key_writes_duplicates(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    """Documents the batch default: a retried task writes its rows again (at-least-once).

    The rows the failed attempt wrote are in the topic twice: count > rows, nothing missing.
    """
    topic = make_topic(4)

    retried_write(spark, redis_url, topic)

    # The failed attempt's writer may still be writing when the job is done: wait for it.
    settled = topics.settled_count(topic, 4)
    counts = topics.id_counts(topic, 4)
    assert set(counts) == set(range(40_000))  # nothing missing
    duplicated = {i for i, n in counts.items() if n > 1}
    assert max(counts.values()) == 2
    # The failed attempt had written rows before it died; its retry wrote them again.
    assert duplicated
    assert duplicated <= set(range(15_000))  # only rows of the failed task, before the failure
    assert settled == 40_000 + len(duplicated)


def test_batch_task_retry_with_idempotency_key_writes_each_row_once(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    topics: TopicReader,
) -> None:
    topic = make_topic(4)
    pattern = f"pspf:{{{topic}:*}}:sink:batch:load-1:0:*"  # the markers of Spark partition 0

    retried_write(spark, redis_url, topic, probe=lambda c: len(c.keys(pattern)), idempotency_key="load-1")

    # The failed attempt of Spark partition 0 wrote chunks (and their markers) the retry skipped.
    assert int(rclient.get(f"{topic}:probe") or 0) > 0
    assert topics.settled_count(topic, 4) == 40_000

    counts = topics.id_counts(topic, 4)
    assert set(counts) == set(range(40_000))
    assert max(counts.values()) == 1
    assert topics.count(topic, 4) == 40_000
    # Each chunk (2,000 rows) of each Spark partition has its marker in the partitions it wrote to.
    for spark_partition in (0, 1):
        for chunk in range(10):
            token = f"batch:load-1:{spark_partition}:{chunk}"
            assert any(rclient.exists(sink_marker_key(topic, p, token)) for p in range(4))

    # The same job run again with the same key writes nothing.
    pspf_write(orders(spark, 40_000, 2), redis_url, topic, key="user", idempotency_key="load-1")
    assert topics.count(topic, 4) == 40_000


def test_batch_retry_after_a_truncated_input_with_idempotency_key_loses_no_rows(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    topics: TopicReader,
) -> None:
    """The retry must write the rows of a chunk its failed attempt wrote only in part.

    When a task fails upstream of the writer, Spark ends the failed attempt's row iterator
    cleanly after the Arrow batches it had sent. With Arrow batches that are not a multiple of
    the sink's 2,000-row chunk (here 2,100 rows; Spark also cuts batches at
    ``spark.sql.execution.arrow.maxBytesPerBatch``, 64 MiB, for wide rows) the attempt's last
    chunk is short. A regression test: when a marker only said "written", the retry skipped the
    whole chunk and the rows between the end of the short chunk and the end of the full one were
    never written (1,300 rows here).
    """
    topic = make_topic(4)
    pattern = f"pspf:{{{topic}:*}}:sink:batch:load-2:0:*"  # the markers of Spark partition 0
    ids = failing_ids(
        15_000,
        url=redis_url,
        probe_at=0,
        probe=lambda c: len(c.keys(pattern)),
        probe_key=f"{topic}:probe",
    )
    df = orders(spark, 40_000, 2).withColumn("id", ids(F.col("id")))

    with arrow_batch_rows(spark, 2_100):
        pspf_write(df, redis_url, topic, key="user", idempotency_key="load-2")

    assert int(rclient.get(f"{topic}:probe") or 0) > 0  # the failed attempt wrote chunks
    topics.settled_count(topic, 4)
    counts = topics.id_counts(topic, 4)
    assert sorted(set(range(40_000)) - set(counts)) == []  # nothing missing
    assert max(counts.values()) == 1


SECRET = "s3cret"


@standalone_only  # an ACL user and a URL of one server
def test_broker_password_never_shows_in_driver_errors(
    spark: SparkSession, make_topic: Callable[[int], str], redis_server: RedisServer | ClusterServer
) -> None:
    topic = make_topic(2)
    wrong_password = f"redis://pspf-nobody:{SECRET}@127.0.0.1:{redis_server.port}/0"
    nobody_listens = f"redis://pspf-nobody:{SECRET}@127.0.0.1:{free_port()}/0"

    for url, reason in [
        (wrong_password, "invalid username-password pair"),
        (nobody_listens, "Connection refused"),
    ]:
        with pytest.raises(AnalysisException) as failed:
            pspf_write(orders(spark, 100, 1), url, topic, key="user")
        text = str(failed.value)
        assert reason in text
        assert "pspf-nobody:***@127.0.0.1" in text
        assert SECRET not in text
        assert SECRET not in repr(failed.value)


@standalone_only  # an ACL user and a URL of one server
def test_broker_password_never_shows_in_task_errors(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    redis_server: RedisServer | ClusterServer,
    rclient: redis.Redis,
) -> None:
    """A write that fails inside the tasks (a stream key of the wrong type) names the URL masked."""
    topic = make_topic(2)
    user = f"pspf-spark-{topic}"
    rclient.acl_setuser(user, enabled=True, passwords=[f"+{SECRET}"], keys=["*"], commands=["+@all"])
    for p in range(2):
        rclient.set(stream_key(topic, p), "not a stream")
    try:
        url = f"redis://{user}:{SECRET}@127.0.0.1:{redis_server.port}/0"
        with pytest.raises(Exception) as failed:
            pspf_write(orders(spark, 100, 1), url, topic, key="user")
        text = str(failed.value)
        assert "WRONGTYPE" in text or "wrong Redis type" in text
        assert f"pspf sink writing to redis://{user}:***@127.0.0.1" in text
        assert SECRET not in text
    finally:
        rclient.acl_deluser(user)


def test_a_row_that_does_not_match_the_topics_schema_fails_the_write_naming_it(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, topics: TopicReader
) -> None:
    from pspf import Settings
    from pspf.service import Service

    topic = make_topic(1)
    service = Service(Settings.load({"PSPF_BROKER": redis_url}, environ={}))
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "amount": {"type": "integer", "maximum": 50}},
        "required": ["id", "amount"],
    }
    service.schemas.set_schema(topic, schema, "none")
    service.close()
    small = spark.range(0, 40, numPartitions=1).selectExpr("id", "id + 1 as amount")
    pspf_write(small, redis_url, topic)
    assert len(list(topics.entries(topic, 1))) == 40
    big = spark.range(0, 100, numPartitions=1).selectExpr("id", "id + 1 as amount")  # row 51: amount 51
    with pytest.raises(Exception, match=r"row 51 of the task: topic '.*' schema v1: Expected `int` <= 50"):
        pspf_write(big, redis_url, topic)
    assert len(list(topics.entries(topic, 1))) == 40  # its chunk (all 100 rows) wrote nothing
