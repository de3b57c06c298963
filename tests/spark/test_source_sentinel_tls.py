"""The Spark source over Sentinel with mutual TLS: the TLS files as options of the broker URL.

The deployment (a master, a replica and three sentinels on TLS ports only, each asking for a
client certificate) and its certificates are test_sentinel_tls.py's; nothing is reachable unless
the URL's TLS options reach both the sentinels and the master, in the tasks as on the driver.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark source needs Java 17+)", allow_module_level=True)

from pyspark.sql import SparkSession

from pspf import Producer, Settings
from pspf.broker import Broker
from pspf.embedded import LocalSentinel
from tests.conftest import Names
from tests.integration import test_sentinel_tls, test_tls
from tests.integration.test_tls import Certs

pytestmark = [pytest.mark.integration, pytest.mark.spark]

certs = test_tls.certs
tls_binary = test_tls.tls_binary
tls_sentinel = test_sentinel_tls.tls_sentinel


def tls_url(sentinel: LocalSentinel, certs: Certs) -> str:
    files = {"ssl_ca_certs": certs.ca, "ssl_certfile": certs.client, "ssl_keyfile": certs.client_key}
    return sentinel.url + "?" + "&".join(f"{name}={quote(str(path))}" for name, path in files.items())


def test_batch_and_streaming_reads_over_sentinel_with_mutual_tls(
    spark: SparkSession, tls_sentinel: LocalSentinel, certs: Certs, names: Names, tmp_path: Path
) -> None:
    url = tls_url(tls_sentinel, certs)
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    topic = names.topic()
    broker = Broker(settings.redis)
    try:
        broker.topics.create_topic(topic, 2)
    finally:
        broker.close()
    with Producer(settings=settings) as producer:
        for i in range(300):
            producer.send(topic, {"n": i}, key=f"k{i % 7}", headers={"h": str(i)})

    rows = spark.read.format("pspf").option("broker", url).option("topic", topic).load().collect()
    assert sorted(int(r.headers["h"]) for r in rows) == list(range(300))

    query = (
        spark.readStream.format("pspf")
        .option("broker", url)
        .option("topic", topic)
        .load()
        .select("key", "value")
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    assert spark.read.parquet(str(tmp_path / "out")).count() == 300
