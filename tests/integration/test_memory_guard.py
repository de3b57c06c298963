"""Producers near the server's maxmemory: they slow down, then stop with a clear error, before
the server evicts keys or refuses writes."""

from __future__ import annotations

import logging
import re
import subprocess

import pytest

from pspf import Producer, Settings
from pspf.errors import MemoryFull
from pspf.service import Service
from tests.conftest import RedisServer, pspf_command, standalone_only, subprocess_env

pytestmark = [pytest.mark.integration, standalone_only]


def limit_memory(server: RedisServer, spare_bytes: int) -> int:
    """Set maxmemory to what the server uses now plus ``spare_bytes`` (noeviction); the limit."""
    with server.client() as client:
        limit = max(int(client.info("memory")["used_memory"]) + spare_bytes, 1)
        client.config_set("maxmemory", limit)
        client.config_set("maxmemory-policy", "noeviction")
    return limit


def test_a_producer_slows_down_then_stops_before_the_server_refuses_a_write(
    own_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings.load({"PSPF_BROKER": own_server.url}, environ={})
    Service(settings).create_topic("big", 2)
    limit = limit_memory(own_server, 4_000_000)
    sent = 0
    producer = Producer(settings=settings, batch_size=100)
    with caplog.at_level(logging.WARNING, logger="pspf.broker"), pytest.raises(MemoryFull) as info:
        while sent < 100_000:  # until the guard says no
            producer.send_raw("big", b"x" * 1000, key=str(sent))
            sent += 1
    # It stops at PSPF_MEMORY_FAIL_AT (0.95) or within the last batch above it (shown rounded: up to
    # 100%), and never at the server's limit: nothing was refused (below).
    shown = re.search(r"uses (\d+)% of its maxmemory", str(info.value))
    assert shown is not None and 95 <= int(shown.group(1)) <= 100, info.value
    assert "producing slows down" in caplog.text
    with own_server.client() as client:
        used = int(client.info("memory")["used_memory"])
        assert used < limit  # stopped before the server had to refuse: no OOM error was ever sent
        stats = client.info("errorstats")
        assert "errorstat_OOM" not in stats, stats
    assert 1000 < sent < 4000  # it wrote what fitted under the limit


def test_pspf_produce_exits_3_with_one_line_when_the_server_is_full(own_server: RedisServer) -> None:
    settings = Settings.load({"PSPF_BROKER": own_server.url}, environ={})
    Service(settings).create_topic("full", 1)
    with own_server.client() as client:  # other writers filled it: 98% of its maxmemory in use
        limit_memory(own_server, -int(client.info("memory")["used_memory"]) // 50)
    done = subprocess.run(
        pspf_command("produce", "full", "--broker", own_server.url, '{"n": 1}'),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "of its maxmemory: producing stops" in lines[0], done.stderr
