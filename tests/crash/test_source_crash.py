"""SIGKILL ``pspf source files`` at random moments, several times, then run it to the end.

Several objects of thousands of rows each: whatever a kill interrupted (a round of publishing
calls, an object between its last rows and its done mark), the topic ends with every row exactly
once, each in its key's partition (invariant 13).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf.keys import source_done_key, source_layouts_key, stream_key
from tests.conftest import subprocess_env
from tests.crash.support import WorkerProcess
from tests.sources.support import encode_rows, topic_entries
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
OBJECTS = 8
ROWS = 5000
KILLS = 6


def topic_length(client: redis.Redis, topic: str) -> int:
    pipe = client.pipeline(transaction=False)
    for partition in range(PARTITIONS):
        pipe.xlen(stream_key(topic, partition))
    return sum(pipe.execute())


def write_objects(folder: Path, fmt: str, rng: random.Random) -> None:
    """OBJECTS objects of ROWS rows each, two to a sub-folder."""
    for obj in range(OBJECTS):
        rows = [{"user": f"u{rng.randrange(500)}", "obj": obj, "n": n} for n in range(ROWS)]
        path = folder / f"part-{obj // 2}" / f"{obj}.{fmt}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_rows(rows, fmt))


def kill_at_random(
    start: Callable[[str], WorkerProcess], rclient: redis.Redis, topic: str, rng: random.Random
) -> int:
    """Start the source KILLS times, each SIGKILLed at a random moment after it added rows.

    Returns how many of the kills interrupted a run (a run may end before its kill).
    """
    killed_mid_run = 0
    for life in range(KILLS):
        before = topic_length(rclient, topic)
        process = start(f"life-{life}")
        try:
            wait_until(
                lambda: topic_length(rclient, topic) > before or not process.alive(),  # noqa: B023
                60,
                "the source to add rows",
                interval=0.005,
            )
            time.sleep(rng.uniform(0, 0.04))
        finally:
            if process.alive():
                process.kill9()
                killed_mid_run += 1
        if topic_length(rclient, topic) == OBJECTS * ROWS:
            break  # all in: a further life would only read and skip
    return killed_mid_run


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_random_sigkills_of_the_files_source_leave_every_row_once(
    make_topic: Callable[[int], str], rclient: redis.Redis, redis_url: str, tmp_path: Path, fmt: str
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    topic = make_topic(PARTITIONS)
    folder = tmp_path / "in"
    write_objects(folder, fmt, rng)
    args = [
        str(folder),
        topic,
        "--format",
        fmt,
        "--key-field",
        "user",
        "--name",
        "crash",
        "--broker",
        redis_url,
    ]

    def start(label: str) -> WorkerProcess:
        return WorkerProcess(
            tmp_path / f"{label}.log", args, subprocess_env(), tmp_path, command=("source", "files")
        )

    killed_mid_run = kill_at_random(start, rclient, topic, rng)
    print(f"{killed_mid_run} kills interrupted a run")
    assert killed_mid_run >= 3, "the kills came too late to interrupt the source"

    last = start("last")
    assert last.wait(120) == 0, last.tail()
    assert b"added" in last.log.read_bytes()

    found = topic_entries(rclient, topic, PARTITIONS)  # each keyed entry checked in its key's partition
    counts = Counter((value["obj"], value["n"]) for _, _, value in found)
    assert len(counts) == OBJECTS * ROWS, "rows missing"
    assert max(counts.values()) == 1, f"rows twice: {[row for row, c in counts.items() if c > 1][:5]}"
    assert all(key == value["user"] for _, key, value in found)
    done = rclient.smembers(source_done_key("crash", topic))
    assert len(done) == OBJECTS and rclient.hlen(source_layouts_key("crash", topic)) == 0
