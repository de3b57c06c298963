"""``pspf sink files`` against a real server: objects named by their ids, the Spark source's columns.

The conformance suite (``test_sink_conformance.py``) kills it under load; these check what it
writes and how it refuses a mistake.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result

from pspf import Producer, Settings
from pspf.cli import cli
from pspf.errors import ConfigError
from pspf.keys import StreamId
from pspf.sink.files import FilesSink
from tests.sinks.files_read import files_delivered
from tests.support import wait_until

pytestmark = pytest.mark.integration


def deliver(redis_url: str, topic: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["sink", "files", topic, "--broker", redis_url, "--until-idle", *args])


def produce(redis_url: str, topic: str, count: int) -> None:
    with Producer(settings=Settings.load({"PSPF_BROKER": redis_url}, environ={}), batch_size=7) as producer:
        for n in range(count):
            producer.send(topic, {"n": n, "name": f"é{n}"}, key=f"k{n % 5}", headers={"src": "t"})


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_each_batch_is_one_object_named_by_its_ids_with_the_spark_sources_columns(
    make_topic: Callable[[int], str], redis_url: str, tmp_path: Path, fmt: str
) -> None:
    topic = make_topic(2)
    produce(redis_url, topic, 60)
    out = tmp_path / "lake"
    result = deliver(redis_url, topic, "--url", str(out), "--format", fmt, "--batch-size", "25")
    assert result.exit_code == 0, result.output
    records = list(files_delivered(str(out)))
    assert sorted(json.loads(r["value"])["n"] for r in records) == list(range(60))
    assert set(records[0]) == {"topic", "partition", "id", "key", "value", "encoding", "headers", "timestamp"}
    first = records[0]
    headers: Any = first["headers"]
    assert dict(headers) == {"src": "t"} and first["encoding"] == "json" and first["topic"] == topic
    assert first["timestamp"] == StreamId.parse(first["id"]).ms
    objects = sorted(out.glob(f"{topic}/*/*.{fmt}"))
    per_partition = [sum(1 for r in records if r["partition"] == p) for p in (0, 1)]
    assert len(objects) == sum(-(-n // 25) for n in per_partition)  # batches of up to 25
    for path in objects:
        first_id, _, last_id = path.stem.partition("_")
        if fmt == "parquet":
            rows = pq.read_table(path).to_pylist()
        else:
            rows = [json.loads(line) for line in path.read_bytes().splitlines()[1:]]
        assert (rows[0]["id"], rows[-1]["id"]) == (first_id, last_id)
        assert {r["partition"] for r in rows} == {int(path.parent.name)}
    again = deliver(redis_url, topic, "--url", str(out), "--format", fmt)
    assert again.exit_code == 0, again.output
    assert sorted(out.glob(f"{topic}/*/*.{fmt}")) == objects  # nothing new to deliver


def test_s3_objects_through_the_aws_variables(
    make_topic: Callable[[int], str], redis_url: str, s3_bucket: str
) -> None:
    topic = make_topic(1)
    produce(redis_url, topic, 30)
    url = f"s3://{s3_bucket}/raw"
    result = deliver(redis_url, topic, "--url", url, "--format", "parquet")
    assert result.exit_code == 0, result.output
    fs, root = fsspec.core.url_to_fs(url)
    names = [p.rpartition("/")[2] for p in fs.find(root)]
    assert names and all(n.endswith(".parquet") and "_" in n for n in names)
    assert sorted(json.loads(r["value"])["n"] for r in files_delivered(url)) == list(range(30))


def test_a_url_fsspec_cannot_use_is_one_line_exit_2(make_topic: Callable[[int], str], redis_url: str) -> None:
    result = deliver(redis_url, make_topic(1), "--url", "nosuchprotocol://x/y")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot use 'nosuchprotocol://x/y'" in lines[0], result.output


def test_a_missing_topic_exits_4_and_writes_nothing(redis_url: str, tmp_path: Path) -> None:
    result = deliver(redis_url, "no-such-topic", "--url", str(tmp_path / "lake"))
    assert result.exit_code == 4, result.output
    assert "does not exist" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "lake").exists()


def _object_sizes(out: Path, topic: str) -> list[int]:
    return sorted(len(path.read_bytes().splitlines()) - 1 for path in out.glob(f"{topic}/*/*.jsonl"))


def test_roll_entries_caps_each_object(
    make_topic: Callable[[int], str], redis_url: str, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    topic = make_topic(1)
    produce(redis_url, topic, 250)
    out = tmp_path / "rolled"
    FilesSink(str(out), roll_entries=100).run(topic, make_settings(), until_idle=True)
    assert _object_sizes(out, topic) == [50, 100, 100]


def test_roll_seconds_gathers_what_arrives_meanwhile_into_one_object(
    make_topic: Callable[[int], str], redis_url: str, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Ten bursts 100 ms apart: without a linger each read makes an object; with 2 s, two or three."""
    topic = make_topic(1)
    out = tmp_path / "lingered"
    worker = FilesSink(str(out), roll_seconds=2).worker(topic, make_settings(PSPF_BLOCK_MS="100"))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: worker.processor.owned, 20, "the sink owns its partition")
        for _ in range(10):
            produce(redis_url, topic, 5)
            time.sleep(0.1)
        wait_until(lambda: sum(_object_sizes(out, topic)) == 50, 20, "every entry in an object")
    finally:
        worker.stop()
        thread.join(20)
    assert len(_object_sizes(out, topic)) <= 3, _object_sizes(out, topic)


def test_bad_roll_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="roll entries must be 1-100,000"):
        FilesSink(str(tmp_path), roll_entries=0)
    with pytest.raises(ConfigError, match="roll seconds must be 0-600"):
        FilesSink(str(tmp_path), roll_seconds=-1)


def test_the_cli_rolls_objects_and_refuses_a_bad_roll_in_one_line(
    make_topic: Callable[[int], str], redis_url: str, tmp_path: Path
) -> None:
    topic = make_topic(1)
    produce(redis_url, topic, 250)
    out = tmp_path / "cli-rolled"
    result = deliver(redis_url, topic, "--url", str(out), "--roll-entries", "100", "--roll-seconds", "0")
    assert result.exit_code == 0, result.output
    assert _object_sizes(out, topic) == [50, 100, 100]
    refused = deliver(redis_url, topic, "--url", str(out), "--roll-entries", "0")
    assert refused.exit_code == 2 and "roll entries must be 1-100,000" in refused.output
    assert "Traceback" not in refused.output
