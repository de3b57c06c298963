"""``pspf source files`` against a real server: every row once in its key's partition, in each format.

Objects in a local folder and in an S3 bucket (moto's server); a second run adds nothing, a new
object is picked up by the next run and by ``--follow``; a bad row stops the run with its object
and line, and a run after the fix goes on; mistakes exit with the codes scripts rely on.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Settings
from pspf.cli import cli
from pspf.keys import source_done_key, source_layouts_key
from pspf.service import Service
from pspf.source.files import FilesSource
from tests.conftest import pspf_command, subprocess_env
from tests.sources.support import encode_rows, topic_entries
from tests.support import wait_until

pytestmark = pytest.mark.integration

PARTITIONS = 3
EXTENSION = {"jsonl": "jsonl", "csv": "csv", "parquet": "parquet"}


def rows_of(obj: int, count: int) -> list[dict[str, Any]]:
    return [{"user": f"u{(obj * 7 + n) % 11}", "n": n, "obj": obj} for n in range(count)]


def run_source(redis_url: str, url: str, topic: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["source", "files", url, topic, "--broker", redis_url, *args])


class StopAfterFirstLook(threading.Event):
    """Unset when the source first looks (before its first object), set from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > 1


class Objects:
    """Writes objects under a local folder or an S3 prefix; the URL the source reads."""

    def __init__(self, url: str, put: Callable[[str, bytes], None]) -> None:
        self.url = url
        self.put = put


@pytest.fixture(params=["local", "s3"])
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> Objects:
    if request.param == "local":
        root = tmp_path / "in"
        root.mkdir()

        def put_local(name: str, data: bytes) -> None:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)

        return Objects(str(root), put_local)
    bucket = request.getfixturevalue("s3_bucket")
    client = boto3.client("s3")

    def put_s3(name: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=f"exports/{name}", Body=data)

    return Objects(f"s3://{bucket}/exports", put_s3)


def expected(rows: list[dict[str, Any]], fmt: str) -> list[tuple[str, dict[str, Any]]]:
    """(key, value) of each row as the topic holds it: CSV values are strings."""
    if fmt == "csv":
        rows = [{name: str(value) for name, value in row.items()} for row in rows]
    return sorted(((row["user"], row) for row in rows), key=json.dumps)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_every_row_once_in_its_keys_partition_and_a_second_run_adds_nothing(
    objects: Objects, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis, fmt: str
) -> None:
    topic = make_topic(PARTITIONS)
    written = []
    for obj, name in enumerate([f"a.{fmt}", f"sub/b.{fmt}", f"sub/deeper/c.{fmt}"]):
        rows = rows_of(obj, 40 + obj)
        objects.put(name, encode_rows(rows, fmt))
        written += rows
    objects.put("notes.txt", b"not an object of the format")
    objects.put(f".hidden.{fmt}", encode_rows(rows_of(9, 5), fmt))

    first = run_source(redis_url, objects.url, topic, "--format", fmt, "--key-field", "user")
    assert first.exit_code == 0, first.output
    assert f"added {len(written)} rows from 3 objects" in first.output
    found = topic_entries(rclient, topic, PARTITIONS)
    assert sorted(((key, value) for _, key, value in found), key=json.dumps) == expected(written, fmt)

    again = run_source(redis_url, objects.url, topic, "--format", fmt, "--key-field", "user")
    assert again.exit_code == 0, again.output
    assert "added 0 rows from 0 objects" in again.output and "3 objects done before" in again.output
    assert len(topic_entries(rclient, topic, PARTITIONS)) == len(written)

    later = rows_of(5, 25)
    objects.put(f"sub/d.{fmt}", encode_rows(later, fmt))
    third = run_source(redis_url, objects.url, topic, "--format", fmt, "--key-field", "user", "--json")
    assert third.exit_code == 0, third.output
    summary = json.loads(third.stdout)
    assert (summary["rows_added"], summary["objects"], summary["objects_done_before"]) == (25, 1, 3)
    found = topic_entries(rclient, topic, PARTITIONS)
    assert sorted(((key, value) for _, key, value in found), key=json.dumps) == expected(written + later, fmt)


def test_an_object_cut_short_is_finished_by_the_next_run_without_doubles(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis
) -> None:
    """Rows a killed run added are recorded with them: a run from the object's start skips them."""
    topic = make_topic(PARTITIONS)
    folder = tmp_path / "in"
    folder.mkdir()
    rows = rows_of(1, 2500)
    (folder / "big.jsonl").write_bytes(encode_rows(rows, "jsonl"))
    source = FilesSource(str(folder), topic, "jsonl", key_field="user", name="cut")
    settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
    cut = source.run(settings, stop=StopAfterFirstLook())  # what a kill between two chunks leaves
    assert cut.objects == 0 and 0 < cut.rows_added < len(rows)
    assert rclient.smembers(source_done_key("cut", topic)) == set()

    rest = source.run(settings)
    assert rest.objects == 1 and rest.rows_added == len(rows) - cut.rows_added
    assert rest.rows_already == cut.rows_added
    found = topic_entries(rclient, topic, PARTITIONS)
    assert sorted(value["n"] for _, _, value in found) == list(range(len(rows)))


def test_an_object_cut_short_before_a_repartition_is_finished_in_the_new_layout_without_doubles(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis, service: Service
) -> None:
    """The layouts an unfinished object went out in are remembered: the old records still count."""
    topic = make_topic(PARTITIONS)
    folder = tmp_path / "in"
    folder.mkdir()
    rows = rows_of(2, 3500)
    (folder / "big.jsonl").write_bytes(encode_rows(rows, "jsonl"))
    source = FilesSource(str(folder), topic, "jsonl", key_field="user", name="moved")
    settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
    cut = source.run(settings, stop=StopAfterFirstLook())
    assert 0 < cut.rows_added < len(rows)
    assert rclient.hget(source_layouts_key("moved", topic), "big.jsonl") == f"0:{PARTITIONS}".encode()

    service.repartition.repartition_topic(topic, partitions=PARTITIONS + 2)
    rest = source.run(settings)
    assert (rest.objects, rest.rows_added, rest.rows_already) == (
        1,
        len(rows) - cut.rows_added,
        cut.rows_added,
    )
    found = topic_entries(rclient, topic, PARTITIONS + 2)  # each in its key's partition of the new count
    assert sorted(value["n"] for _, _, value in found) == list(range(len(rows)))
    assert rclient.hlen(source_layouts_key("moved", topic)) == 0


def test_a_bad_line_stops_the_run_naming_it_and_a_run_after_the_fix_goes_on(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis
) -> None:
    topic = make_topic(PARTITIONS)
    folder = tmp_path / "in"
    folder.mkdir()
    good = rows_of(0, 6)
    lines = [json.dumps(row) for row in good]
    broken = [*lines[:3], '{"user": "u1", "n": ', *lines[3:]]
    (folder / "a.jsonl").write_text("\n".join(broken) + "\n")
    (folder / "b.jsonl").write_bytes(encode_rows(rows_of(1, 4), "jsonl"))

    result = run_source(redis_url, str(folder), topic, "--key-field", "user")
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 2  # the start line and the error
    assert "a.jsonl line 4: invalid JSON" in result.output and "Traceback" not in result.output
    assert sorted(value["n"] for _, _, value in topic_entries(rclient, topic, PARTITIONS)) == [0, 1, 2]

    (folder / "a.jsonl").write_text(
        "\n".join([*lines[:3], '{"user": "u1", "n": 99, "obj": 0}', *lines[3:]]) + "\n"
    )
    fixed = run_source(redis_url, str(folder), topic, "--key-field", "user")
    assert fixed.exit_code == 0, fixed.output
    found = sorted((value["obj"], value["n"]) for _, _, value in topic_entries(rclient, topic, PARTITIONS))
    assert found == sorted([(0, n) for n in [*range(6), 99]] + [(1, n) for n in range(4)])


def test_a_row_without_its_key_field_stops_the_run_naming_the_object_and_row(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str
) -> None:
    topic = make_topic(1)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_bytes(encode_rows([{"user": "u1", "n": 1}, {"user": "", "n": 2}], "csv"))
    result = run_source(redis_url, str(folder), topic, "--format", "csv", "--key-field", "customer")
    assert result.exit_code == 2
    assert "a.csv row 1: no field 'customer'" in result.output


def test_mistakes_exit_with_one_line_and_their_code(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str
) -> None:
    topic = make_topic(1)
    missing = run_source(redis_url, str(tmp_path), "no-such-topic", "--key-field", "user")
    assert missing.exit_code == 4 and "no-such-topic" in missing.output
    assert "Traceback" not in missing.output
    for url in ("nosuch://bucket/x", str(tmp_path / "absent")):
        bad = run_source(redis_url, url, topic)
        assert bad.exit_code == 2, bad.output
        last = bad.output.splitlines()[-1]
        assert last.startswith("Error: source files: ") and "Traceback" not in bad.output
    fmt = run_source(redis_url, str(tmp_path), topic, "--format", "xml")
    assert fmt.exit_code == 2


def test_follow_picks_up_new_objects_until_sigterm(
    tmp_path: Path, make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis
) -> None:
    topic = make_topic(PARTITIONS)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(encode_rows(rows_of(0, 30), "jsonl"))
    args = ["source", "files", str(folder), topic, "--key-field", "user", "--follow", "--interval", "0.2"]
    process = subprocess.Popen(
        pspf_command(*args, "--broker", redis_url),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(topic_entries(rclient, topic, PARTITIONS)) == 30, 20, "the first object")
        (folder / "b.jsonl").write_bytes(encode_rows(rows_of(1, 20), "jsonl"))
        wait_until(lambda: len(topic_entries(rclient, topic, PARTITIONS)) == 50, 20, "the new object")
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "added 50 rows from 2 objects" in err
    assert len(topic_entries(rclient, topic, PARTITIONS)) == 50
