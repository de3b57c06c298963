"""A local Spark session shared by the Spark sink tests, and helpers to read what the sink wrote.

The session runs ``local[2,3]``: two task threads and up to three attempts per task, so a task
that fails once is retried as on a cluster. Its Python workers run this interpreter with the
checkout on ``PYTHONPATH``, so they import this ``pspf`` even where it is not installed. Building
a session takes several seconds, so there is one for the whole run.

The test modules skip themselves when pyspark, pyarrow or Java is missing; this file imports
pyspark only inside the fixture so that collecting them never fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec
import pytest
import redis
from redis.cluster import RedisCluster

from pspf.keys import stream_key
from tests.conftest import client_for

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql._typing import UserDefinedFunctionLike

ROOT = Path(__file__).resolve().parent.parent.parent


def spark_available() -> str | None:
    """Why Spark tests cannot run here, or None when they can."""
    for module in ("pyspark", "pyarrow"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install 'pspf[spark]')"
    if shutil.which("java") is None:
        return "no java on PATH (the Spark sink needs Java 17+)"
    return None


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    reason = spark_available()
    if reason:
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    import pspf.spark

    # The JVM and the Python workers it starts take these from the environment the JVM starts
    # with (and the context reads PYSPARK_PYTHON once): set them only while the session is built,
    # so that what the process starts later (a test's pip, a virtual environment) never finds
    # the checkout on its PYTHONPATH.
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    try:
        session = (
            SparkSession.builder.master("local[2,3]")
            .appName("pspf-spark-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .getOrCreate()
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    session.sparkContext.setLogLevel("ERROR")
    pspf.spark.register(session)
    try:
        yield session
    finally:
        session.stop()


class TopicReader:
    """Reads back the entries of a topic's partitions."""

    def __init__(self, client: redis.Redis | RedisCluster) -> None:
        self.client = client

    def count(self, topic: str, partitions: int) -> int:
        return sum(int(self.client.xlen(stream_key(topic, p))) for p in range(partitions))

    def settled_count(self, topic: str, partitions: int, quiet_s: float = 1.0, timeout_s: float = 20) -> int:
        """The entry count once it has not changed for ``quiet_s``.

        When a task fails, Spark starts its retry (and may even finish the job) while the failed
        attempt's Python writer still writes the rows it was handed: wait for such late writes.
        """
        deadline = time.monotonic() + timeout_s
        last, since = self.count(topic, partitions), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.count(topic, partitions)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def entries(self, topic: str, partitions: int) -> list[tuple[int, dict[bytes, bytes]]]:
        """(partition, fields) of every entry, in stream order per partition."""
        out: list[tuple[int, dict[bytes, bytes]]] = []
        for p in range(partitions):
            stream = stream_key(topic, p)
            last: bytes | str = "-"
            while True:
                batch = cast(
                    list[tuple[bytes, dict[bytes, bytes]]],
                    self.client.xrange(stream, min=last, max="+", count=10_000),
                )
                if last != "-":
                    batch = batch[1:]
                if not batch:
                    break
                out.extend((p, fields) for _, fields in batch)
                last = batch[-1][0]
        return out

    def values(self, topic: str, partitions: int) -> list[dict[str, Any]]:
        return [msgspec.json.decode(f[b"value"]) for _, f in self.entries(topic, partitions)]

    def id_counts(self, topic: str, partitions: int, column: str = "id") -> Counter[int]:
        """How many entries carry each value of ``column``: every count 1 means no duplicates."""
        return Counter(v[column] for v in self.values(topic, partitions))


@pytest.fixture
def topics(rclient: redis.Redis | RedisCluster) -> TopicReader:
    return TopicReader(rclient)


def failing_ids(
    fail_at: int,
    *,
    url: str = "",
    fail_while_key: str | None = None,
    probe_at: int | None = None,
    probe: Callable[[redis.Redis | RedisCluster], int] | None = None,
    probe_key: str = "",
) -> UserDefinedFunctionLike:
    """A UDF returning the ``id`` column unchanged, with a failure injected at row ``fail_at``.

    - By default attempt 0 of the task that holds row ``fail_at`` raises there, and Spark retries it.
    - With ``fail_while_key`` every attempt raises there while that Redis key exists (the task,
      and a streaming query, fail for good).
    - With ``probe``, the retry (attempt 1) stores ``probe(client)`` in Redis key ``probe_key`` at
      row ``probe_at``, the first row of its task: what the failed attempt left behind. It waits
      (up to 10 s) for a non-zero answer, as Spark starts the retry while the failed attempt's
      Python writer may still be writing the rows it had been handed.

    The pspf writer of the same task reads its rows from Spark as this column is computed, so the
    failure comes while it consumes its iterator: Spark hands the Python writer its input in Arrow
    batches of 10,000 rows, which it writes in chunks of 2,000, so a failure past row 10,000 of a
    task comes after the writer wrote the first batch's chunks.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    def ids(i: int) -> int:
        from pyspark import TaskContext

        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        if i == fail_at:
            if fail_while_key is None:
                if attempt == 0:
                    raise RuntimeError(f"injected failure at row {i}")
            else:
                client = client_for(url)
                try:
                    if client.exists(fail_while_key):
                        raise RuntimeError(f"injected failure at row {i} (attempt {attempt})")
                finally:
                    client.close()
        if probe is not None and i == probe_at and attempt == 1:
            client = client_for(url)
            try:
                deadline = time.monotonic() + 10
                found = probe(client)
                while not found and time.monotonic() < deadline:
                    time.sleep(0.05)
                    found = probe(client)
                client.set(probe_key, found)
            finally:
                client.close()
        return i

    return F.udf(ids, LongType(), useArrow=False).asNondeterministic()


ARROW_BATCH_ROWS = "spark.sql.execution.arrow.maxRecordsPerBatch"


@contextmanager
def arrow_batch_rows(spark: SparkSession, rows: int | None) -> Iterator[None]:
    """Spark hands Python writers Arrow batches of ``rows`` rows (None: Spark's default, 10,000)."""
    if rows is None:
        yield
        return
    saved = spark.conf.get(ARROW_BATCH_ROWS)
    spark.conf.set(ARROW_BATCH_ROWS, str(rows))
    try:
        yield
    finally:
        if saved is None:
            spark.conf.unset(ARROW_BATCH_ROWS)
        else:
            spark.conf.set(ARROW_BATCH_ROWS, saved)
