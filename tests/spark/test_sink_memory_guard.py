"""The Spark sink near the server's maxmemory: its tasks stop with the producers' clear error
before the server has to refuse a write, and a write that fits goes through whole.

Against a server of the test's own (its maxmemory is changed) and a local Spark session.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None:
    pytest.skip("no java on PATH (the Spark sink needs Java 17+)", allow_module_level=True)

from pyspark.sql import SparkSession

from pspf import Settings
from pspf.keys import stream_key
from pspf.service import Service
from tests.conftest import RedisServer, standalone_only
from tests.integration.test_memory_guard import limit_memory
from tests.spark.test_sink_batch import orders, pspf_write

pytestmark = [pytest.mark.integration, pytest.mark.spark, standalone_only]


def test_a_write_into_a_full_server_fails_with_one_clear_reason_and_writes_nothing(
    spark: SparkSession, own_server: RedisServer
) -> None:
    settings = Settings.load({"PSPF_BROKER": own_server.url}, environ={})
    Service(settings).create_topic("sunk", 2)
    pspf_write(orders(spark, 1_000, 2), own_server.url, "sunk", key="user")  # fits: written whole
    with own_server.client() as client:
        assert sum(client.xlen(stream_key("sunk", p)) for p in range(2)) == 1_000
        # Other writers filled the server: 98% of its maxmemory in use.
        limit_memory(own_server, -int(client.info("memory")["used_memory"]) // 50)

    with pytest.raises(Exception) as failed:
        pspf_write(orders(spark, 1_000, 2), own_server.url, "sunk", key="user")

    text = str(failed.value)
    assert "of its maxmemory: producing stops" in text, text[:2000]
    with own_server.client() as client:
        assert sum(client.xlen(stream_key("sunk", p)) for p in range(2)) == 1_000  # nothing more
        assert "errorstat_OOM" not in client.info("errorstats")  # the server never had to refuse
