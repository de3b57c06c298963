"""The Iceberg sink against a real server and real pyiceberg catalogs (SQL on SQLite; disk or S3).

The conformance suite (``test_sink_conformance.py``) kills it under load; these check what it
writes (rows, one snapshot per commit with the position), that a re-run after the positions are
lost from memory writes nothing twice, that a worker taken over writes nothing, and how it
refuses a mistake.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from pyiceberg.catalog import load_catalog
from pyiceberg.schema import Schema
from pyiceberg.types import NestedField, StringType

from pspf import Producer, Settings
from pspf.errors import ConfigError, SinkUnavailable
from pspf.keys import StreamId, stream_key
from pspf.sink.base import SinkRecord
from pspf.sink.iceberg import IcebergSink
from pspf.sink.idempotent import Position
from tests.conftest import pspf_command, subprocess_env
from tests.sinks.iceberg_read import catalog_env, iceberg_rows, sql_catalog

pytestmark = pytest.mark.integration

TABLE = "lake.orders"


def produce(redis_url: str, topic: str, start: int, count: int) -> None:
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={}), batch_size=7) as producer:
        for n in range(start, start + count):
            producer.send(topic, {"n": n, "name": f"é{n}"}, key=f"k{n % 5}", headers={"src": "t"})


def cli(redis_url: str, topic: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = pspf_command("sink", "iceberg", topic, "--broker", redis_url, "--until-idle", *args)
    return subprocess.run(command, env=subprocess_env(**env), capture_output=True, text=True, timeout=120)


def positions(properties: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """Each snapshot's (operation, summary), oldest first."""
    table = load_catalog("default", **properties).load_table(TABLE)
    return [(s.summary.operation.value, dict(s.summary.additional_properties)) for s in table.snapshots()]


def checkpoint(summary: dict[str, str], key: str, topic: str) -> StreamId:
    position = msgspec.msgpack.decode(base64.b64decode(summary[key]), type=Position)
    return StreamId(*position.checkpoints[topic])


def test_every_entry_once_one_snapshot_per_commit_holding_the_position(
    make_topic: Callable[[int], str],
    redis_url: str,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    produce(redis_url, topic, 0, 60)
    properties = sql_catalog(tmp_path)
    sink = IcebergSink(TABLE, name="sink-ice", properties=properties)
    summary = sink.run(topic, make_settings(PSPF_BATCH_SIZE=25), until_idle=True)
    assert summary.handled == 60
    rows = iceberg_rows(TABLE, properties)
    assert sorted(json.loads(r["value"])["n"] for r in rows) == list(range(60))
    assert set(rows[0]) == {"topic", "partition", "id", "key", "value", "encoding", "headers", "timestamp"}
    for row in rows:
        assert row["topic"] == topic and row["encoding"] == "json" and dict(row["headers"]) == {"src": "t"}
        assert row["timestamp"] == StreamId.parse(row["id"]).ms
        assert row["key"] == f"k{json.loads(row['value'])['n'] % 5}"
    snapshots = positions(properties)
    per_partition = {p: [r for r in rows if r["partition"] == p] for p in (0, 1)}
    data = [s for _, s in snapshots if int(s.get("added-records", "0")) > 0]
    # one snapshot per batch of up to 25; the others, without rows, are claims and bookkeeping
    assert len(data) == sum(-(-len(r) // 25) for r in per_partition.values())
    assert all(sum(k.startswith("pspf.owner/sink-ice/") for k in s) == 1 for _, s in snapshots)
    assert all(op == "append" for op, _ in snapshots)
    for p, partition_rows in per_partition.items():
        key = f"pspf.position/sink-ice/{topic}/{p}"
        mine = [s for s in data if key in s]
        assert sum(int(s["added-records"]) for s in mine) == len(partition_rows)
        last = max(StreamId.parse(r["id"]) for r in partition_rows)
        assert checkpoint(mine[-1], key, topic) == last
        assert all(f"pspf.owner/sink-ice/{topic}/{p}" in s for s in mine)


def test_a_rerun_reading_everything_again_writes_nothing_twice(
    make_topic: Callable[[int], str],
    redis_url: str,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    topic = make_topic(2)
    produce(redis_url, topic, 0, 40)
    properties = sql_catalog(tmp_path)
    settings = make_settings(PSPF_BATCH_SIZE=15)
    IcebergSink(TABLE, name="sink-again", properties=properties).run(topic, settings, until_idle=True)
    # the group forgets what it acknowledged: only the table's positions keep the entries out
    client = redis.Redis.from_url(redis_url)
    for p in (0, 1):
        client.xgroup_setid(stream_key(topic, p), "sink-again", id="0")
    produce(redis_url, topic, 40, 10)
    again = IcebergSink(TABLE, name="sink-again", properties=properties)
    summary = again.run(topic, settings, until_idle=True)
    assert (summary.handled, summary.skipped) == (10, 40)
    ids = [(r["partition"], r["id"]) for r in iceberg_rows(TABLE, properties)]
    assert len(ids) == len(set(ids)) == 50


def record(topic: str, n: int) -> SinkRecord:
    return SinkRecord(topic=topic, partition=0, entry_id=f"{n}-0", key="k", value={"n": n}, headers={})


def prepared(properties: dict[str, str], topic: str) -> IcebergSink:
    sink = IcebergSink(TABLE, name="sink-parts", properties=properties)
    sink.topic = topic
    sink.prepare()
    return sink


def test_a_worker_taken_over_writes_nothing(tmp_path: Path) -> None:
    properties = sql_catalog(tmp_path)
    first = prepared(properties, "t").partition(0)
    assert first.claim() == ({}, {})
    first.commit([record("t", 1)], {}, {"t": StreamId(1, 0)})
    second = prepared(properties, "t").partition(0)  # another worker's
    assert second.claim() == ({}, {"t": StreamId(1, 0)})
    with pytest.raises(SinkUnavailable, match="taken over"):
        first.commit([record("t", 2)], {}, {"t": StreamId(2, 0)})
    second.commit([record("t", 2)], {("ns", "k"): b"v"}, {"t": StreamId(2, 0)})
    assert sorted(r["id"] for r in iceberg_rows(TABLE, properties)) == ["1-0", "2-0"]
    third = prepared(properties, "t").partition(0)
    assert third.claim() == ({("ns", "k"): b"v"}, {"t": StreamId(2, 0)})


def test_other_writers_commits_are_retried_and_a_commit_found_landed_is_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    properties = sql_catalog(tmp_path)
    one, two = prepared(properties, "t"), prepared(properties, "t")  # two processes' table objects
    zero, first = one.partition(0), two.partition(1)
    zero.claim()
    first.claim()  # its table object is behind zero's claim: a conflict, refreshed, retried
    zero.commit([record("t", 1)], {}, {"t": StreamId(1, 0)})
    first.commit([record("t", 2)], {}, {"t": StreamId(2, 0)})
    appended = one.append

    def lost_reply(rows: Any, summary: dict[str, str]) -> Any:
        appended(rows, summary)
        raise OSError("connection reset")  # landed, but the reply was lost

    monkeypatch.setattr(one, "append", lost_reply)
    with pytest.raises(SinkUnavailable):
        zero.commit([record("t", 3)], {}, {"t": StreamId(3, 0)})
    monkeypatch.undo()
    zero.commit([record("t", 3), record("t", 4)], {}, {"t": StreamId(4, 0)})  # the batch read again
    ids = sorted(r["id"] for r in iceberg_rows(TABLE, properties))
    assert ids == ["1-0", "2-0", "3-0", "4-0"]
    assert zero.checkpoints == {"t": StreamId(4, 0)}


def test_the_cli_through_pyiceberg_variables_into_s3(
    make_topic: Callable[[int], str], redis_url: str, s3_bucket: str, tmp_path: Path
) -> None:
    topic = make_topic(2)
    produce(redis_url, topic, 0, 30)
    properties = sql_catalog(tmp_path, bucket=s3_bucket)
    args = ("--table", TABLE, "--catalog", "lake", "--name", "sink-s3")
    result = cli(redis_url, topic, catalog_env("lake", properties), *args)
    assert result.returncode == 0, result.stderr
    assert f"sink sink-s3: {topic} into Iceberg table {TABLE} (catalog lake)" in result.stderr
    rows = iceberg_rows(TABLE, properties, "lake")
    assert sorted(json.loads(r["value"])["n"] for r in rows) == list(range(30))
    table = load_catalog("lake", **properties).load_table(TABLE)
    assert table.metadata.location.startswith(f"s3://{s3_bucket}/warehouse")
    again = cli(redis_url, topic, catalog_env("lake", properties), *args)
    assert again.returncode == 0, again.stderr
    assert len(iceberg_rows(TABLE, properties, "lake")) == 30


def test_the_cli_with_the_default_catalog_on_disk(
    make_topic: Callable[[int], str], redis_url: str, tmp_path: Path
) -> None:
    topic = make_topic(1)
    produce(redis_url, topic, 0, 20)
    properties = sql_catalog(tmp_path)
    result = cli(
        redis_url, topic, catalog_env("default", properties), "--table", TABLE, "--name", "sink-disk"
    )
    assert result.returncode == 0, result.stderr
    ids = [r["id"] for r in iceberg_rows(TABLE, properties)]
    assert len(ids) == len(set(ids)) == 20


def test_a_table_with_other_columns_is_refused_in_one_line_exit_2(
    make_topic: Callable[[int], str], redis_url: str, tmp_path: Path
) -> None:
    properties = sql_catalog(tmp_path)
    catalog = load_catalog("default", **properties)
    catalog.create_namespace("lake")
    catalog.create_table(TABLE, schema=Schema(NestedField(1, "id", StringType(), required=False)))
    result = cli(redis_url, make_topic(1), catalog_env("default", properties), "--table", TABLE)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "exists with other columns" in lines[0] and "Traceback" not in result.stderr
    assert catalog.load_table(TABLE).snapshots() == []


def test_a_bad_table_name_or_missing_catalog_is_one_line_exit_2(
    make_topic: Callable[[int], str], redis_url: str
) -> None:
    topic = make_topic(1)
    for args, words in (
        (("--table", "orders"), "NAMESPACE.TABLE"),
        (("--table", "lake.orders", "--catalog", "nosuch"), "catalog 'nosuch'"),
    ):
        result = cli(redis_url, topic, {}, *args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], result.stderr


def test_a_missing_topic_exits_4_and_creates_no_table(redis_url: str, tmp_path: Path) -> None:
    properties = sql_catalog(tmp_path)
    result = cli(redis_url, "no-such-topic", catalog_env("default", properties), "--table", TABLE)
    assert result.returncode == 4, result.stderr
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert not load_catalog("default", **properties).table_exists(TABLE)


def test_without_the_extra_the_sink_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyiceberg.catalog", None)  # an import of it fails
    with pytest.raises(ConfigError, match=r"pip install 'pspf\[iceberg\]'"):
        IcebergSink(TABLE)


def test_sinks_preparing_at_once_create_the_namespace_and_table_once(tmp_path: Path) -> None:
    """Sink processes started together race to create them; a SQL catalog's loser gets an insert error.

    An unreachable-looking catalog (SinkUnavailable) is tried again, as a sink's worker does.
    """
    properties = sql_catalog(tmp_path)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def prepare() -> None:
        sink = IcebergSink(TABLE, name="sink-race", properties=properties)
        start.wait()
        for _ in range(20):
            try:
                sink.prepare()
                return
            except SinkUnavailable:
                time.sleep(0.05)
            except BaseException as exc:
                errors.append(exc)
                return
        errors.append(TimeoutError("the catalog stayed unavailable"))

    threads = [threading.Thread(target=prepare) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert iceberg_rows(TABLE, properties) == []
