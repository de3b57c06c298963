"""State that follows its partition: workers on two "hosts" (two state dirs) killed with SIGKILL in
turn, each restart on the other dir, then a third, empty dir finishes the job: exact state.

Every takeover meets a store that is missing (the first time), behind (the other host moved the
partition on), or ahead (killed between its local commit and the acknowledging call): each must be
repaired from the state backup in Redis before any entry is applied.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pspf.keys import stream_key
from tests.conftest import pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import assert_exact, expected_state, order_records, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 4
ENTRIES = 20_000
KILLS = 6


def acknowledged(client: Any, topic: str, app: str, partitions: int = PARTITIONS) -> int:
    """Entries of the topic the app has acknowledged (delivered and no longer pending)."""
    done = 0
    for p in range(partitions):
        stream = stream_key(topic, p)
        groups = [g for g in client.xinfo_groups(stream) if g["name"] == app.encode()]
        if not groups:
            continue
        delivered = groups[0]["last-delivered-id"].decode()
        done += len(client.xrange(stream, "-", delivered)) - int(groups[0]["pending"])
    return done


def test_partitions_move_between_state_dirs_under_kill9_and_the_state_stays_exact(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Any,
    rclient: Any,
) -> None:
    topic, app = make_topic(PARTITIONS), names.app()
    records = order_records(ENTRIES, 1_000, seed=21)
    produce(topic, records)
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    options = ["--broker", redis_url, "--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "1000"]
    last = 0
    for kill in range(KILLS):
        state_dir = hosts[kill % 2]
        worker = spawn(
            f"w{kill}",
            topic,
            app,
            *options,
            "--state-dir",
            str(state_dir),
            env={"PSPF_TEST_WORK_US": "150"},
            cli_settings=False,
        )
        target = last + ENTRIES // (KILLS + 2)
        wait_until(lambda t=target: acknowledged(rclient, topic, app) >= t, 60, f"progress past {target}")
        assert worker.kill9() == -9
        last = acknowledged(rclient, topic, app)
        print(f"kill {kill} on {state_dir.name}: {last} acknowledged")
    assert last < ENTRIES, "the workers finished before the last kill"

    final_dir = tmp_path / "host-c"
    final = spawn(
        "final", topic, app, *options, "--state-dir", str(final_dir), "--until-idle", cli_settings=False
    )
    assert final.wait(120) == 0, final.tail()
    log = final.log.read_text()
    assert "state backup restored" in log, final.tail()
    assert_exact(rclient, final_dir, topic, app, PARTITIONS, records)

    # Any machine reads the state from the backup: no state dir here.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    want = expected_state(records)
    for key in sorted(want)[:5]:
        got = subprocess.run(
            pspf_command("state", "get", app, key, "--json", "--broker", redis_url),
            capture_output=True,
            text=True,
            timeout=60,
            cwd=elsewhere,
            env=subprocess_env(),
        )
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == {"count": want[key][0], "total": want[key][1]}


def test_with_the_backup_off_a_missing_store_is_refused_and_nothing_is_acknowledged(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Any,
    rclient: Any,
) -> None:
    topic, app = make_topic(2), names.app()
    produce(topic, order_records(1_000, 50, seed=22))
    options = ["--broker", redis_url, "--block-ms", "100", "--state-backup", "off", "--until-idle"]
    first = spawn("first", topic, app, *options, "--state-dir", str(tmp_path / "a"), cli_settings=False)
    assert first.wait(60) == 0, first.tail()
    produce(topic, order_records(500, 50, seed=23))
    before = acknowledged(rclient, topic, app, 2)

    other = spawn("other", topic, app, *options, "--state-dir", str(tmp_path / "b"), cli_settings=False)
    assert other.wait(60) == 5, other.tail()
    log = other.log.read_text()
    assert "is behind its consumer group" in log and "none (no state)" in log, other.tail()
    assert "Traceback" not in log
    assert acknowledged(rclient, topic, app, 2) == before == 1_000
