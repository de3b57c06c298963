"""The Spark sink's ``maxlen``/``minid`` trimming never deletes what an app has yet to acknowledge.

A topic is read by two apps (consumer groups): one has read part of it and acknowledged only some
of what it read (pending entries) and has not read the rest (undelivered entries); the other has
read and acknowledged everything. A Spark write that asks to trim far beyond them must keep every
pending and undelivered entry of the first app, and may trim only entries both apps acknowledged.
Against a real server (``PSPF_TEST_REDIS_SERVER`` for 6.2) and a local Spark session.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

from pyspark.sql import SparkSession

from pspf.keys import StreamId, stream_key
from tests.conftest import Names

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SEEDED = 3_000
READ = 1_500  # the lagging app has read the first READ entries ...
ACKED = 1_000  # ... and acknowledged the first ACKED of them
WRITTEN = 500


def seed(client: redis.Redis, stream: str) -> list[bytes]:
    """SEEDED entries in ``stream``; their ids in order."""
    pipe = client.pipeline(transaction=False)
    for i in range(SEEDED):
        pipe.xadd(stream, {"value": f'{{"old": {i}}}'})
    return [bytes(entry_id) for entry_id in pipe.execute()]


def read(client: redis.Redis, stream: str, group: str, count: int | None) -> list[bytes]:
    """Deliver ``count`` new entries (None: all) to ``group``; their ids."""
    reply = client.xreadgroup(group, "c1", {stream: ">"}, count=count)
    return [bytes(entry_id) for _, entries in reply for entry_id, _ in entries]


def write(spark: SparkSession, url: str, topic: str, **options: str) -> None:
    df = spark.range(0, WRITTEN, numPartitions=1).selectExpr("to_json(named_struct('new', id)) as v")
    df.write.format("pspf").option("broker", url).option("topic", topic).option("value", "v").options(
        **options
    ).mode("append").save()


def far_future_id() -> str:
    """A minid above every entry in the stream and every entry the write adds."""
    return f"{int(time.time() * 1000) + 10**9}-0"


@pytest.mark.parametrize("option", ["maxlen", "minid"])
def test_trimming_keeps_every_entry_an_app_has_not_acknowledged(
    spark: SparkSession,
    make_topic: Callable[[int], str],
    names: Names,
    redis_url: str,
    rclient: redis.Redis,
    option: str,
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    ids = seed(rclient, stream)
    lagging, ahead = names.app(), names.app()
    rclient.xgroup_create(stream, lagging, id="0")
    assert read(rclient, stream, lagging, READ) == ids[:READ]
    assert rclient.xack(stream, lagging, *ids[:ACKED]) == ACKED
    rclient.xgroup_create(stream, ahead, id="0")
    assert read(rclient, stream, ahead, None) == ids
    assert rclient.xack(stream, ahead, *ids) == SEEDED

    write(spark, redis_url, topic, **{option: "10" if option == "maxlen" else far_future_id()})

    kept = [bytes(entry_id) for entry_id, _ in rclient.xrange(stream)]
    floor = ids[ACKED]  # the lagging app's oldest pending entry
    at_or_above = [i for i in kept if StreamId.parse(i) >= StreamId.parse(floor)]
    # Every entry the lagging app has not acknowledged is still there, in order, with the new ones.
    assert at_or_above[: SEEDED - ACKED] == ids[ACKED:]
    assert len(at_or_above) == SEEDED - ACKED + WRITTEN
    pending = rclient.xpending_range(stream, lagging, min="-", max="+", count=SEEDED)
    assert [bytes(p["message_id"]) for p in pending] == ids[ACKED:READ]
    # It reads its undelivered entries, old and new, and reads each one in full.
    undelivered = rclient.xreadgroup(lagging, "c1", {stream: ">"})
    entries = [(bytes(entry_id), fields) for _, batch in undelivered for entry_id, fields in batch]
    assert [entry_id for entry_id, _ in entries[: SEEDED - READ]] == ids[READ:]
    assert len(entries) == SEEDED - READ + WRITTEN
    assert all(b"value" in fields for _, fields in entries)
    # Entries both apps acknowledged are trimmed (whole nodes of them: the trimming is approximate).
    below = len(kept) - len(at_or_above)
    assert below < ACKED // 2


def test_trimming_a_stream_without_apps_still_keeps_about_maxlen_entries(
    spark: SparkSession, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    stream = stream_key(topic, 0)
    seed(rclient, stream)

    write(spark, redis_url, topic, maxlen="100")

    # Approximate: whole nodes go, so a few more than maxlen may stay, never fewer.
    assert 100 <= rclient.xlen(stream) < 400
    last: Any = rclient.xrevrange(stream, count=1)[0][1]
    assert last == {b"value": b'{"new":499}'}
