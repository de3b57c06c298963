"""The Spark source in batch mode: topics, an app's state and its tables, against a real server.

Covers: a 4-partition topic of keyed and keyless entries, JSON, msgpack, flat and non-JSON values
and headers read with every field, each entry once; id and time bounds; a partition split into
id ranges gives the same rows as unsplit (and ``split_range`` covers every id once); the state
read equals ``service.state.state_export``; a table read; the errors raised on the driver.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark source needs Java 17+)", allow_module_level=True)

from pyspark.sql import DataFrame, SparkSession

from pspf import App, Context, Settings, Worker
from pspf.errors import ConfigError, NotFound
from pspf.keys import MAX_SEQ, StreamId, backup_keys, partition_for, stream_key
from pspf.ownership.membership import live_members
from pspf.service import Service
from pspf.spark import STATE_SCHEMA, TABLE_SCHEMA, TOPIC_SCHEMA, source_schema
from pspf.spark.state_read import plan_state_read
from pspf.spark.topic_batch import split_range
from tests.conftest import Names
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.spark]

PARTITIONS = 4
#: (partition, id) -> the row the source must give: topic, partition, id, key, value, encoding, headers, ts
Expected = dict[tuple[int, str], tuple[Any, ...]]


def read(spark: SparkSession, url: str, **options: str) -> DataFrame:
    return spark.read.format("pspf").option("broker", url).options(**options).load()


def rows_of(df: DataFrame) -> list[tuple[Any, ...]]:
    """The rows as tuples, values decoded from JSON where they are JSON, sorted by (partition, id)."""
    found = []
    for row in df.collect():
        value = json.loads(row.value) if row.encoding in ("json", "msgpack", "flat") else row.value
        headers = None if row.headers is None else dict(row.headers)
        found.append((row.topic, row.partition, row.id, row.key, value, row.encoding, headers, row.timestamp))
    return sorted(found, key=lambda r: (r[1], StreamId.parse(r[2])))


def fill(client: redis.Redis, topic: str, count: int) -> Expected:
    """``count`` entries of every kind the wire format allows, written with XADD; what each reads as."""
    expected: Expected = {}
    for i in range(count):
        kind = i % 6
        key = None if kind in (1, 4) else (f"ключ-{i % 37}" if kind == 3 else f"k{i % 41}")
        partition = i % PARTITIONS if key is None else partition_for(key.encode(), PARTITIONS)
        fields: dict[bytes, bytes] = {}
        headers: dict[str, str] = {}
        if key is not None:
            fields[b"key"] = key.encode()
        if kind == 2:
            value: Any = {"i": i, "list": [1, 2], "nested": {"x": None}}
            fields[b"value"] = msgspec.msgpack.encode(value)
            fields[b"encoding"] = b"msgpack"
            encoding = "msgpack"
        elif kind == 4:
            value = {"user": f"u{i}", "amount": str(i)}
            fields.update({b"user": f"u{i}".encode(), b"amount": str(i).encode()})
            encoding = "flat"
        elif kind == 5:
            value, encoding = f"not json {i}", "text"
            fields[b"value"] = value.encode()
        else:
            value, encoding = {"i": i, "text": "é"}, "json"
            fields[b"value"] = msgspec.json.encode(value)
        if kind in (0, 3, 4):
            headers = {"trace": f"t{i}", "source": "test"}
            fields[b"headers"] = msgspec.json.encode(headers)
        entry_id = client.xadd(stream_key(topic, partition), fields).decode()
        ms = int(entry_id.split("-")[0])
        expected[(partition, entry_id)] = (topic, partition, entry_id, key, value, encoding, headers, ms)
    return expected


def test_every_entry_once_with_its_key_value_and_headers(
    spark: SparkSession,
    redis_url: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
) -> None:
    topic = make_topic(PARTITIONS)
    expected = fill(rclient, topic, 1200)
    df = read(spark, redis_url, topic=topic)
    assert df.schema == TOPIC_SCHEMA
    assert df.rdd.getNumPartitions() >= PARTITIONS
    found = rows_of(df)
    assert len(found) == len(expected)  # none twice
    assert {(r[1], r[2]): r for r in found} == expected


def fill_ids(client: redis.Redis, topic: str) -> list[tuple[int, StreamId]]:
    """Entries with chosen ids: per partition ms 1000-1099 with seq 0-2, and ids at a ms boundary."""
    written = []
    for p in range(PARTITIONS):
        ids = [StreamId(ms, seq) for ms in range(1000, 1100) for seq in range(3)]
        ids += [StreamId(1100, MAX_SEQ), StreamId(1101, 0), StreamId(1101, 1)]
        pipe = client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xadd(stream_key(topic, p), {b"key": f"p{p}".encode(), b"value": b"1"}, id=str(entry_id))
        pipe.execute()
        written += [(p, entry_id) for entry_id in ids]
    return written


def ids_of(df: DataFrame) -> list[tuple[int, StreamId]]:
    return sorted((row.partition, StreamId.parse(row.id)) for row in df.select("partition", "id").collect())


def test_id_and_time_bounds_and_split_partitions(
    spark: SparkSession,
    redis_url: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
) -> None:
    topic = make_topic(PARTITIONS)
    written = fill_ids(rclient, topic)

    def within(first: StreamId, last: StreamId) -> list[tuple[int, StreamId]]:
        return sorted(w for w in written if first <= w[1] <= last)

    # start_id and end_id are inclusive.
    by_id = read(spark, redis_url, topic=topic, start_id="1010-1", end_id="1020-0")
    assert ids_of(by_id) == within(StreamId(1010, 1), StreamId(1020, 0))
    # start_time is inclusive, end_time exclusive; times are unix ms or ISO 8601.
    by_time = read(spark, redis_url, topic=topic, start_time="1970-01-01T00:00:01.050Z", end_time="1060")
    assert ids_of(by_time) == within(StreamId(1050, 0), StreamId(1059, MAX_SEQ))

    # Split into ranges of about 25 entries: the same rows, none twice.
    split = read(spark, redis_url, topic=topic, max_entries_per_split="25")
    assert split.rdd.getNumPartitions() > 4 * PARTITIONS
    assert ids_of(split) == sorted(written)
    bounded_split = read(spark, redis_url, topic=topic, start_id="1099-2", max_entries_per_split="1")
    assert ids_of(bounded_split) == within(StreamId(1099, 2), StreamId(1101, 1))


@pytest.mark.parametrize("seed", range(5))
def test_split_range_covers_every_id_once(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        first = StreamId(rng.randrange(0, 10_000), rng.choice([0, 1, MAX_SEQ]))
        last = StreamId(first.ms + rng.randrange(0, 500), rng.choice([0, 5, MAX_SEQ]))
        if last < first:
            continue
        ranges = split_range(first, last, rng.randrange(0, 50_000), rng.randrange(1, 1000))
        assert ranges[0][0] == first and ranges[-1][1] == last
        for (a, b), (c, _) in itertools.pairwise(ranges):
            assert a <= b and b.next() == c  # consecutive: no id twice, none left out
        assert all(a <= b for a, b in ranges)


def order_app(name: str, orders: str, customers: str, global_products: str | None = None) -> App:
    app = App(name)
    app.table(customers)
    if global_products is not None:
        app.global_table(global_products)

    @app.handler(orders)
    def count(value: dict[str, int], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + value["n"]
        ctx.state["last"] = {"i": value["i"], "tags": ["a", "b"]}

    return app


def test_state_read_equals_the_export_and_a_table_read_gives_its_rows(
    spark: SparkSession,
    redis_url: str,
    rclient: redis.Redis,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    orders, customers = make_topic(PARTITIONS), make_topic(PARTITIONS)
    produce(orders, [(f"k{i % 53}", {"n": i % 3, "i": i}) for i in range(3000)])
    rows: dict[str, Any] = {}
    records: list[tuple[str | None, Any]] = []
    for i in range(60):
        key, row = f"c{i % 25}", {"tier": ["gold", "silver"][i % 2], "seen": i}
        records.append((key, row))
        rows[key] = row
    records += [("c3", None), ("c4", 7)]  # a deleted row; a row need not be an object
    del rows["c3"]
    rows["c4"] = 7
    produce(customers, records)
    app = order_app(names.app(), orders, customers)
    settings = make_settings()
    Worker(app, settings).run(until_idle=True)
    shutil.rmtree(settings.state.dir)  # what is read is the backup in Redis

    state = read(spark, redis_url, state=app.name)
    assert state.schema == STATE_SCHEMA
    found = {(r.partition, r.key): json.loads(r.state) for r in state.collect() if r.error is None}
    service = Service(settings)
    try:
        lines = [msgspec.json.decode(line) for line in service.state.state_export(app.name)]
    finally:
        service.close()
    exported = {(x["partition"], x["key"]): x["state"] for x in lines if x.get("namespace") == "state"}
    assert len(exported) == 53
    assert found == exported
    assert state.count() == 53

    table = read(spark, redis_url, table=customers, app=app.name)
    assert table.schema == TABLE_SCHEMA
    got = table.collect()
    assert {r.key: json.loads(r.value) for r in got} == rows and len(got) == len(rows)
    assert all(r.partition == partition_for(r.key.encode(), PARTITIONS) and r.error is None for r in got)

    # A partition whose backup is gone: the read is refused rather than short of its rows.
    for name in backup_keys(orders, 2, app.name):
        rclient.delete(name)  # one key a call: a cluster's client refuses several slots in one
    with pytest.raises(NotFound, match=r"no state backup of partitions \[2\]"):
        plan_state_read({"broker": redis_url, "state": app.name}, "state")


def test_driver_errors(
    spark: SparkSession,
    redis_url: str,
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    running: Callable[[Worker], None],
) -> None:
    for options in [{}, {"topic": "a", "state": "b"}, {"state": "a", "table": "b"}]:
        with pytest.raises(ConfigError, match="give exactly one of"):
            source_schema(options)
    with pytest.raises(Exception, match="unknown pspf source option"):
        read(spark, redis_url, topic=make_topic(1), start="0").count()
    with pytest.raises(Exception, match="give start_id or start_time, not both"):
        read(spark, redis_url, topic=make_topic(1), start_id="1-0", start_time="1").count()
    with pytest.raises(NotFound, match="never run"):
        plan_state_read({"broker": redis_url, "state": "never-ran"}, "state")
    with pytest.raises(ConfigError, match="needs the app"):
        plan_state_read({"broker": redis_url, "table": "t"}, "table")

    orders, customers, products = make_topic(2), make_topic(2), make_topic(3)
    app = order_app(names.app(), orders, customers, products)
    running(Worker(app, make_settings()))
    service = Service(make_settings())
    try:
        wait_until(
            lambda: any(products in m.global_lag for m in live_members(service.broker.leases, app.name)),
            60,
            "the worker to say it follows the global table",
        )
    finally:
        service.close()
    with pytest.raises(NotFound, match="has no table 'nope'"):
        plan_state_read({"broker": redis_url, "table": "nope", "app": app.name}, "table")
    with pytest.raises(ConfigError, match="lives only in each worker's local store"):
        plan_state_read({"broker": redis_url, "table": products, "app": app.name}, "table")
