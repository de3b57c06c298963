"""The idempotent tier, with the test directory sink: a rewrite replaces, the position comes back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf import Settings
from pspf.context import Context
from pspf.keys import StreamId, dlq_key, stream_key
from pspf.sink import BatchName, IdempotentSink, SinkRecord, SinkRefused, TransactionalSink
from pspf.sink.idempotent import BatchPartition
from pspf.sink_postgres import PostgresSink
from tests.sinks.dir_sink import DirPartition, DirSink, delivered


def records(partition: int, *ids: str) -> list[SinkRecord]:
    return [
        SinkRecord(topic="t", partition=partition, entry_id=i, key="k", value={"id": i}, headers={})
        for i in ids
    ]


def test_each_sink_names_its_tier() -> None:
    assert issubclass(PostgresSink, TransactionalSink) and PostgresSink.tier == "transactional"
    assert issubclass(DirSink, IdempotentSink) and DirSink.tier == "idempotent"


def test_a_batch_written_again_replaces_its_file_and_a_new_owner_reads_the_position_back(
    tmp_path: Path,
) -> None:
    batch = records(2, "5-0", "3-1", "4-0")
    assert str(BatchName.of(batch)) == "3-1_5-0"
    first = BatchPartition(DirPartition(tmp_path / "2"))
    assert first.claim() == ({}, {})
    first.commit(batch, {("__consumers", "a"): b"1"}, {"t": StreamId(5, 0)})
    first.commit(batch, {}, {"t": StreamId(5, 0)})  # an outcome lost, the same batch again
    first.commit([], {("__dead", "t/6-0"): b"x"}, {"t": StreamId(6, 0)})  # no record: no file
    assert [p.name for p in (tmp_path / "2").iterdir()] == ["3-1_5-0.jsonl"]
    assert sorted(r["entry_id"] for r in delivered(tmp_path)) == ["3-1", "4-0", "5-0"]
    first.commit(records(2, "7-0"), {("__consumers", "b"): b"2"}, {"t": StreamId(7, 0)})
    # A new owner: the position of the latest file, bookkeeping and checkpoints together.
    values, checkpoints = BatchPartition(DirPartition(tmp_path / "2")).claim()
    assert checkpoints == {"t": StreamId(7, 0)}
    assert values == {("__consumers", "a"): b"1", ("__consumers", "b"): b"2", ("__dead", "t/6-0"): b"x"}


class PickyDirSink(DirSink):
    """Refuses the value 13, as a target refuses a record it cannot hold."""

    def record(self, value: Any, ctx: Context) -> SinkRecord:
        if value["n"] == 13:
            raise SinkRefused("13 is refused")
        return super().record(value, ctx)


@pytest.mark.integration
def test_a_refused_entry_goes_to_the_dlq_and_the_others_are_written_once(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    for n in range(40):
        rclient.xadd(stream_key(topic, 0), {"key": f"k{n}", "value": msgspec.json.encode({"n": n})})
    sink = PickyDirSink(tmp_path / "out", name=f"sink-{topic}")
    summary = sink.run(topic, make_settings(PSPF_BATCH_SIZE=7), until_idle=True)
    assert summary.handled == 39 and summary.dead_lettered == 1
    written = sorted(r["value"]["n"] for r in delivered(tmp_path / "out"))
    assert written == [n for n in range(40) if n != 13]
    dead = rclient.xrange(dlq_key(topic, 0))
    assert len(dead) == 1 and dead[0][1][b"error_type"] == b"SinkRefused"
    assert sink.run(topic, make_settings(), until_idle=True).handled == 0
