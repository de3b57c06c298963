"""DLQ operations end to end: list, show, redrive (dry run, interrupted, twice), purge, errors."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import App, Context, Settings, Worker
from pspf.cli import cli
from pspf.failures import DeadLetter
from pspf.keys import dlq_key, partition_for, stream_key
from pspf.service import Service
from tests.conftest import Names

pytestmark = pytest.mark.integration

ENTRIES = 3_000


@pytest.fixture
def invoke(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Result]:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    base = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state"), "PSPF_BLOCK_MS": "100"}

    def run(*args: str, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), env={**base, **(env or {})})

    return run


def error_line(result: Result) -> str:
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def dlq_length(rclient: redis.Redis, topic: str, partitions: int) -> int:
    return sum(rclient.xlen(dlq_key(topic, p)) for p in range(partitions))


def stream_length(rclient: redis.Redis, topic: str, partitions: int) -> int:
    return sum(rclient.xlen(stream_key(topic, p)) for p in range(partitions))


def test_dead_letters_listed_shown_redriven_once_and_state_exact(
    invoke: Callable[..., Result],
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    redis_url: str,
    tmp_path: Path,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(2), names.app()
    records = [(f"u{n % 50}", {"n": n, "amount": n, "bad": n % 3 == 0}) for n in range(ENTRIES)]
    produce(topic, records)
    bad = [value for _, value in records if value["bad"]]
    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app}

    # A second app reads the same topic and succeeds everywhere: a redrive must not reach it.
    other = App(names.app())
    other_counts: Counter[str] = Counter()

    @other.handler(topic)
    def count(value: dict[str, Any], ctx: Context) -> None:
        other_counts[ctx.key] += 1

    settings = Settings.load(
        {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "state"), "PSPF_BLOCK_MS": 100},
        environ={},
    )
    assert Worker(other, settings).run(until_idle=True).handled == ENTRIES

    first = invoke("run", "tests.integration.dlq_apps:make", "--until-idle", env=env)
    assert first.exit_code == 0, first.output
    assert f"{len(bad)} dead-lettered" in first.output
    assert dlq_length(rclient, topic, 2) == len(bad)

    listed = json.loads(invoke("dlq", "list", topic, "--json").output)
    assert len(listed) == len(bad)
    assert {row["error_type"] for row in listed} == {"NonRetryableError"}
    assert {row["attempts"] for row in listed} == {1}
    assert {row["app"] for row in listed} == {app}
    assert len(json.loads(invoke("dlq", "list", topic, "--limit", "5", "--json").output)) == 5
    assert json.loads(invoke("dlq", "list", topic, "--error-type", "KeyError", "--json").output) == []
    assert json.loads(invoke("dlq", "list", topic, "--app", "someone-else", "--json").output) == []
    table = invoke("dlq", "list", topic, "--limit", "3")
    assert table.exit_code == 0 and "NonRetryableError" in table.output

    shown = json.loads(invoke("dlq", "show", topic, listed[0]["dlq_id"], "--json").output)
    n = shown["value"]["n"]
    assert shown["value"] == {"n": n, "amount": n, "bad": True}
    assert shown["key"] == f"u{n % 50}" and shown["source_topic"] == topic
    assert f"order {n} is marked bad" in shown["message"]
    assert "NonRetryableError" in shown["traceback"]

    dry = invoke("dlq", "redrive", topic, "--all", "--dry-run")
    assert dry.exit_code == 0 and f"would redrive {len(bad)} entries" in dry.output
    assert dlq_length(rclient, topic, 2) == len(bad)
    assert stream_length(rclient, topic, 2) == ENTRIES

    # A redrive killed midway: each call is atomic, so stopping between calls is what a kill does.
    service = Service(settings)
    progress = {"n": 0}

    def die_at_400(step: int) -> None:
        progress["n"] += step
        if progress["n"] == 400:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        service.dlq.dlq_redrive(topic, all_entries=True, progress=die_at_400)
    assert dlq_length(rclient, topic, 2) == len(bad) - 400
    assert stream_length(rclient, topic, 2) == ENTRIES + 400

    rest = invoke("dlq", "redrive", topic, "--all", "--yes")
    assert rest.exit_code == 0, rest.output
    assert f"redrove {len(bad) - 400} of {len(bad) - 400}" in rest.output
    again = invoke("dlq", "redrive", topic, "--all", "--yes")
    assert again.exit_code == 0 and "redrove 0 of 0" in again.output
    assert dlq_length(rclient, topic, 2) == 0
    assert stream_length(rclient, topic, 2) == ENTRIES + len(bad)  # each moved exactly once

    fixed = invoke(
        "run", "tests.integration.dlq_apps:make", "--until-idle", env={**env, "PSPF_TEST_FIXED": "1"}
    )
    assert fixed.exit_code == 0, fixed.output
    assert f"processed {len(bad)} entries" in fixed.output
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, value in records:
        assert key is not None
        totals[key][0] += value["amount"]
        totals[key][1] += 1
    for key, (total, count_) in totals.items():
        got = json.loads(invoke("state", "get", app, key, "--json").output)
        assert got == {"total": total, "count": count_}

    # The other app skips the redriven entries: they were meant for the app that failed them.
    rerun = Worker(other, settings).run(until_idle=True)
    assert rerun.handled == 0 and rerun.skipped == len(bad)
    assert sum(other_counts.values()) == ENTRIES


def test_redrive_keeps_key_and_headers_and_marks_the_redrive(
    names: Names,
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
) -> None:
    topic = make_topic(1)
    rclient.xadd(stream_key(topic, 0), {"key": "k1", "value": b"{broken", "headers": b'{"trace": "t-1"}'})
    app = App(names.app())

    @app.handler(topic)
    def handle(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["seen"] = True

    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).dead_lettered == 1
    service = Service(settings)
    [row] = service.dlq.dlq_list(topic)
    assert row.error_type == "DecodeError" and row.attempts == 1
    service.dlq.dlq_redrive(topic, [row.dlq_id])
    service.dlq.dlq_redrive(topic, all_entries=True)  # nothing left: moves nothing twice
    entries = rclient.xrange(stream_key(topic, 0))
    assert len(entries) == 2
    fields = entries[1][1]
    assert fields[b"key"] == b"k1" and fields[b"value"] == b"{broken"
    headers = json.loads(fields[b"headers"])
    assert headers["trace"] == "t-1"
    assert headers["pspf-redrive-count"] == "1"
    assert headers["pspf-original-id"] == entries[0][0].decode()
    assert headers["pspf-redrive-app"] == app.name
    # Still broken: it dies again and its redrive count grows on the next redrive.
    Worker(app, settings).run(until_idle=True)
    [row] = service.dlq.dlq_list(topic)
    service.dlq.dlq_redrive(topic, [row.dlq_id])
    last = rclient.xrange(stream_key(topic, 0))[-1][1]
    assert json.loads(last[b"headers"])["pspf-redrive-count"] == "2"


def test_purge_and_error_paths(
    invoke: Callable[..., Result], names: Names, make_topic: Callable[[int], str], rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    for n in range(5):
        rclient.xadd(dlq_key(topic, 0), _dead_fields(topic, n))
    ids = [f"0:{entry_id.decode()}" for entry_id, _ in rclient.xrange(dlq_key(topic, 0))]

    missing_topic = invoke("dlq", "list", names.topic())
    assert missing_topic.exit_code == 4 and "does not exist" in error_line(missing_topic)
    unknown = invoke("dlq", "show", topic, "0:1-1")
    assert unknown.exit_code == 4 and "no DLQ entry 0:1-1" in error_line(unknown)
    bad_id = invoke("dlq", "show", topic, "nonsense")
    assert bad_id.exit_code == 2 and "invalid DLQ id" in error_line(bad_id)
    nothing = invoke("dlq", "redrive", topic, "--yes")
    assert nothing.exit_code == 2 and "nothing selected" in error_line(nothing)
    both = invoke("dlq", "purge", topic, ids[0], "--all", "--yes")
    assert both.exit_code == 2 and "not both" in error_line(both)
    bad_duration = invoke("dlq", "purge", topic, "--older-than", "soon", "--yes")
    assert bad_duration.exit_code == 2 and "invalid duration" in error_line(bad_duration)
    unknown_ids = invoke("dlq", "redrive", topic, "0:1-1", "--yes")
    assert unknown_ids.exit_code == 4

    recent = invoke("dlq", "purge", topic, "--older-than", "1d", "--yes")
    assert recent.exit_code == 0 and "deleted 0 entries" in recent.output
    dry = invoke("dlq", "purge", topic, "--all", "--dry-run")
    assert "would delete 5 entries" in dry.output and rclient.xlen(dlq_key(topic, 0)) == 5
    one = invoke("dlq", "purge", topic, ids[0], "--yes")
    assert one.exit_code == 0 and "deleted 1 entry" in one.output
    refused = invoke("dlq", "purge", topic, "--all")  # no --yes and no terminal: changes nothing
    assert refused.exit_code == 2 and "pass --yes" in error_line(refused)
    assert rclient.xlen(dlq_key(topic, 0)) == 4
    everything = invoke("dlq", "purge", topic, "--all", "--yes")
    assert everything.exit_code == 0 and rclient.xlen(dlq_key(topic, 0)) == 0


def _dead_fields(topic: str, n: int) -> dict[bytes, bytes]:
    return DeadLetter(
        source_topic=topic,
        source_partition=0,
        source_id=f"1-{n}",
        app="a",
        consumer="c",
        original={b"key": b"k", b"value": b'{"n": %d}' % n},
        error_type="ValueError",
        message="boom",
        traceback="",
        attempts=3,
        first_failed_ms=1,
        last_failed_ms=int(time.time() * 1000) - 60_000,
    ).to_fields()


def test_entry_in_the_wrong_partition_goes_to_the_dlq_and_the_batch_goes_on(
    invoke: Callable[..., Result],
    names: Names,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    rclient: redis.Redis,
) -> None:
    """A producer that partitions otherwise puts a key where `pspf state get` never looks."""
    topic, app = make_topic(4), names.app()
    records = [(f"u{n % 5}", {"n": n, "amount": 1}) for n in range(40)]
    produce(topic, records)
    home = partition_for(b"u1", 4)
    wrong = (home + 1) % 4
    misplaced_id = rclient.xadd(
        stream_key(topic, wrong), {"key": "u1", "value": json.dumps({"n": 99, "amount": 1000})}
    ).decode()
    # an entry without a key may sit in any partition
    rclient.xadd(stream_key(topic, wrong), {"value": json.dumps({"n": 100, "amount": 7})})
    env = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app}

    done = invoke("run", "tests.integration.dlq_apps:make", "--until-idle", env=env)
    assert done.exit_code == 0, done.output
    assert "processed 41 entries" in done.output  # the 40 in place and the one without a key
    assert "1 dead-lettered" in done.output

    listed = json.loads(invoke("dlq", "list", topic, "--json").output)
    assert len(listed) == 1
    [dead] = listed
    assert dead["error_type"] == "WrongPartition"
    assert dead["attempts"] == 1
    assert dead["key"] == "u1" and dead["source_id"] == misplaced_id
    assert f"key 'u1' belongs to partition {home}" in dead["message"]
    assert f"is in partition {wrong}" in dead["message"]
    table = invoke("dlq", "list", topic)
    assert table.exit_code == 0 and "WrongPartition" in table.output

    for n in range(5):
        got = json.loads(invoke("state", "get", app, f"u{n}", "--json").output)
        assert got == {"total": 8, "count": 8}
