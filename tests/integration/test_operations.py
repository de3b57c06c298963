"""``pspf groups``, ``pspf lag`` and ``pspf replay`` against a real server.

Replay's promise: after a replay with the state reset, running the app again gives the state of
the first run (not double); a replay interrupted between moving the group and resetting the
state applies nothing twice; it is refused while a worker holds the app's leases.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import keys
from pspf.broker import Broker
from pspf.cli import cli
from pspf.keys import StreamId, stream_key
from pspf.settings import Settings
from tests.conftest import Names
from tests.integration.test_cli import one_line_error

pytestmark = pytest.mark.integration


class Ops:
    """Runs the CLI in-process against the test server with one state directory."""

    def __init__(self, redis_url: str, state_dir: Path, names: Names) -> None:
        self.redis_url = redis_url
        self.env = {"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(state_dir), "PSPF_BLOCK_MS": "100"}
        self.topic, self.app = names.topic(), names.app()

    def __call__(self, *args: str, input: str | None = None, **env: str) -> Result:
        return CliRunner().invoke(cli, list(args), input=input, env={**self.env, **env})

    def produce(self, users: int, amount: int, topic: str | None = None) -> None:
        lines = "".join(json.dumps({"user": f"u{i}", "amount": amount}) + "\n" for i in range(users))
        result = self("produce", topic or self.topic, "--key-field", "user", input=lines)
        assert result.exit_code == 0, result.output

    def run(self, topic: str | None = None) -> Result:
        env = {"PSPF_TEST_TOPIC": topic or self.topic, "PSPF_TEST_APP": self.app}
        result = self("run", "tests.integration.cli_apps:make", "--until-idle", **env)
        assert result.exit_code == 0, result.output
        return result

    def state(self, key: str) -> dict[str, Any]:
        result = self("state", "get", self.app, key, "--json")
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.output))

    def lag(self) -> dict[str, Any]:
        result = self("lag", self.app, "--json")
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.output))


@pytest.fixture
def ops(
    redis_url: str, tmp_path: Path, names: Names, monkeypatch: pytest.MonkeyPatch
) -> Callable[[int], Ops]:
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR", "PSPF_UNTIL_IDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])

    def make(partitions: int) -> Ops:
        o = Ops(redis_url, tmp_path / "state", names)
        assert o("topic", "create", o.topic, "--partitions", str(partitions)).exit_code == 0
        return o

    return make


def broker(redis_url: str) -> Broker:
    return Broker(Settings.load({"PSPF_BROKER": redis_url}, environ={}).redis)


def test_lag_shows_checkpoint_lag_pending_and_owner_per_partition(
    ops: Callable[[int], Ops], redis_url: str, rclient: redis.Redis
) -> None:
    o = ops(2)
    o.produce(40, 1)
    o.run()
    ran = o.lag()
    assert ran["lag"] == 0 and ran["pending"] == 0 and ran["owners"] == []
    for d in ran["detail"]:
        assert d["checkpoint"] == d["last_id"] == d["delivered_id"]
        assert d["lag"] == 0

    # 30 new entries: not delivered yet.
    o.produce(30, 1)
    waiting = o.lag()
    lengths = [int(rclient.xlen(stream_key(o.topic, p))) for p in range(2)]
    assert sum(lengths) == 70
    assert waiting["lag"] == 30
    # A consumer that died holding 7 entries of partition 0: pending, and still part of the lag.
    stream = stream_key(o.topic, 0)
    rclient.xreadgroup(o.app, "dead-consumer", {stream: ">"}, count=7)
    time.sleep(0.05)
    held = o.lag()
    p0 = next(d for d in held["detail"] if d["partition"] == 0)
    assert p0["pending"] == 7
    assert held["lag"] == 30 and held["pending"] == 7
    assert p0["oldest_pending_age_s"] is not None and p0["oldest_pending_age_s"] >= 0.05
    # A worker holding the lease of partition 1 is its owner.
    b = broker(redis_url)
    try:
        value = b.leases.acquire_lease(
            keys.lease_key(o.topic, 1, o.app), keys.fence_key(o.topic, 1, o.app), "host-a/123/ab", 10_000
        )
        assert value is not None
        owned = o.lag()
        assert [d["owner"] for d in owned["detail"]] == [None, "host-a/123/ab"]
        assert owned["owners"] == ["host-a/123/ab"]
    finally:
        b.conn.client.delete(keys.lease_key(o.topic, 1, o.app))
        b.close()

    table = o("lag", o.app)
    assert table.exit_code == 0
    assert table.output.splitlines()[0].split()[:4] == ["TOPIC", "PARTITION", "LAST", "ID"]


def test_lag_of_a_store_its_worker_is_creating_shows_no_checkpoint_for_it(
    ops: Callable[[int], Ops], tmp_path: Path
) -> None:
    o = ops(2)
    o.produce(10, 1)
    o.run()
    # A worker taking partition 1 has created its file and not its tables yet.
    for stale in (tmp_path / "state" / o.app).glob("p1.sqlite*"):
        stale.unlink()
    (tmp_path / "state" / o.app / "p1.sqlite").touch()
    detail = {d["partition"]: d for d in o.lag()["detail"]}
    assert detail[0]["checkpoint"] == detail[0]["last_id"] is not None
    assert detail[1]["checkpoint"] is None


def test_lag_is_counted_when_the_server_cannot_say(ops: Callable[[int], Ops], rclient: redis.Redis) -> None:
    """A deleted entry after the group's position: Redis 7 answers lag nil, 6.2 has no lag field."""
    o = ops(1)
    o.produce(10, 1)
    o.run()
    o.produce(5, 1)
    stream = stream_key(o.topic, 0)
    newest = rclient.xrevrange(stream, count=5)
    rclient.xdel(stream, newest[2][0])
    assert o.lag()["lag"] == 4


def test_groups_lists_every_app_with_its_totals(ops: Callable[[int], Ops]) -> None:
    o = ops(2)
    o.produce(20, 1)
    o.run()
    o.produce(5, 1)
    listed = o("groups", "--json")
    assert listed.exit_code == 0, listed.output
    mine = [g for g in json.loads(listed.output) if g["app"] == o.app]
    assert len(mine) == 1
    assert mine[0]["topics"] == [o.topic] and mine[0]["partitions"] == 2 and mine[0]["lag"] == 5
    assert mine[0] == o.lag()
    table = o("groups")
    assert any(line.split()[:5] == [o.app, o.topic, "2", "5", "0"] for line in table.output.splitlines())


def test_replay_from_start_rebuilds_the_same_state_not_double(ops: Callable[[int], Ops]) -> None:
    o = ops(2)
    o.produce(50, 3)
    o.produce(50, 4)
    o.run()
    first = {f"u{i}": o.state(f"u{i}") for i in range(50)}
    assert first["u7"] == {"total": 7, "count": 2}

    dry = o("replay", o.app, "--topic", o.topic, "--from-start", "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["entries_to_replay"] == 100
    assert o.lag()["lag"] == 0  # a dry run moves nothing

    done = o("replay", o.app, "--topic", o.topic, "--from-start", "--yes")
    assert done.exit_code == 0, done.output
    assert "100 entries to replay" in done.output
    after = o.lag()
    assert after["lag"] == 100
    assert all(d["checkpoint"] is None for d in after["detail"])
    assert o("state", "get", o.app, "u7").exit_code == 4  # the state is gone until the app runs

    o.run()
    assert {f"u{i}": o.state(f"u{i}") for i in range(50)} == first


def test_replay_keep_state_warns_and_applies_the_entries_again(ops: Callable[[int], Ops]) -> None:
    o = ops(1)
    o.produce(10, 5)
    o.run()
    replayed = o("replay", o.app, "--topic", o.topic, "--from-start", "--keep-state", "--yes")
    assert replayed.exit_code == 0, replayed.output
    assert "warning: --keep-state" in replayed.output
    o.run()
    assert o.state("u3") == {"total": 10, "count": 2}


def test_replay_to_time_replays_only_the_later_entries(
    ops: Callable[[int], Ops], rclient: redis.Redis
) -> None:
    o = ops(2)
    o.produce(20, 1)
    time.sleep(0.02)
    cut_ms = int(rclient.time()[0]) * 1000 + int(rclient.time()[1]) // 1000
    time.sleep(0.02)
    o.produce(20, 10)
    o.run()
    assert o.state("u1") == {"total": 11, "count": 2}

    moved = o("replay", o.app, "--topic", o.topic, "--to-time", str(cut_ms), "--yes", "--json")
    assert moved.exit_code == 0, moved.output
    result = json.loads(moved.output)
    assert result["entries_to_replay"] == 20
    assert StreamId.parse(result["position"]) < StreamId(cut_ms, 0)
    o.run()
    # The state is rebuilt from the entries after that time only.
    assert o.state("u1") == {"total": 10, "count": 1}


def test_replay_is_refused_while_a_worker_holds_leases(ops: Callable[[int], Ops], redis_url: str) -> None:
    o = ops(2)
    o.produce(10, 1)
    o.run()
    before = o.lag()
    b = broker(redis_url)
    try:
        assert b.leases.acquire_lease(
            keys.lease_key(o.topic, 0, o.app), keys.fence_key(o.topic, 0, o.app), "host-b/9/cd", 10_000
        )
        refused = o("replay", o.app, "--topic", o.topic, "--from-start", "--yes")
        assert refused.exit_code == 6
        assert "host-b/9/cd" in one_line_error(refused) and "stop it first" in refused.output
    finally:
        b.conn.client.delete(keys.lease_key(o.topic, 0, o.app))
        b.close()
    assert o.lag() == before  # nothing moved
    assert o.state("u1") == {"total": 1, "count": 1}


def test_replay_interrupted_after_moving_the_group_applies_nothing_twice(
    ops: Callable[[int], Ops], redis_url: str
) -> None:
    """The group was moved but the stores not reset (a crash in between): the old checkpoints
    skip the re-delivered entries; replay run again completes the reset."""
    o = ops(2)
    o.produce(30, 2)
    o.run()
    b = broker(redis_url)
    try:
        for p in range(2):
            b.apps.reset_group(stream_key(o.topic, p), o.app, "0")
    finally:
        b.close()
    o.run()
    assert o.state("u4") == {"total": 2, "count": 1}

    assert o("replay", o.app, "--topic", o.topic, "--from-start", "--yes").exit_code == 0
    o.run()
    assert o.state("u4") == {"total": 2, "count": 1}


def test_replay_user_errors_are_one_line_with_exit_codes(ops: Callable[[int], Ops], tmp_path: Path) -> None:
    o = ops(1)
    o.produce(5, 1)
    o.run()
    before = o.lag()
    cases: list[tuple[tuple[str, ...], dict[str, str], int, str]] = [
        ((o.app, "--topic", o.topic, "--yes"), {}, 2, "exactly one of"),
        ((o.app, "--topic", o.topic, "--from-start", "--to-id", "1-0", "--yes"), {}, 2, "exactly one of"),
        ((o.app, "--topic", o.topic, "--to-id", "nope", "--yes"), {}, 2, "invalid stream id"),
        ((o.app, "--topic", o.topic, "--to-time", "yesterday", "--yes"), {}, 2, "invalid time"),
        ((o.app, "--topic", o.topic, "--to-id", "99999999999999-0", "--yes"), {}, 2, "only moves back"),
        ((o.app, "--topic", "other", "--from-start", "--yes"), {}, 4, "does not read"),
        (("no-such-app", "--topic", o.topic, "--from-start", "--yes"), {}, 4, "never run"),
        (
            (o.app, "--topic", o.topic, "--from-start", "--yes"),
            {"PSPF_STATE_DIR": str(tmp_path / "elsewhere")},
            4,
            "no state of app",
        ),
    ]
    for args, env, code, text in cases:
        result = o("replay", *args, **env)
        assert result.exit_code == code, (args, result.output)
        assert text in one_line_error(result), (args, result.output)
    assert o.lag() == before
    assert o.state("u1") == {"total": 1, "count": 1}


def test_replay_of_an_app_with_two_topics_needs_both_or_keep_state(ops: Callable[[int], Ops]) -> None:
    o = ops(1)
    second = o.topic + "-b"
    assert o("topic", "create", second).exit_code == 0
    o.produce(5, 1)
    o.produce(5, 2, topic=second)
    o.run(topic=f"{o.topic},{second}")
    assert o.state("u1") == {"total": 3, "count": 2}

    one = o("replay", o.app, "--topic", o.topic, "--from-start", "--yes")
    assert one.exit_code == 2
    assert "also reads" in one_line_error(one)

    both = o("replay", o.app, "--topic", o.topic, "--topic", second, "--from-start", "--yes")
    assert both.exit_code == 0, both.output
    assert "10 entries to replay" in both.output
    o.run(topic=f"{o.topic},{second}")
    assert o.state("u1") == {"total": 3, "count": 2}


def test_groups_lists_an_app_it_cannot_read_with_the_reason(
    ops: Callable[[int], Ops], rclient: redis.Redis
) -> None:
    """A regression test: one app whose stream key has the wrong type made ``groups`` fail for all."""
    good, bad = ops(1), ops(1)
    good.produce(3, 1)
    good.run()
    bad.produce(3, 1)
    bad.run()
    rclient.delete(stream_key(bad.topic, 0))
    rclient.set(stream_key(bad.topic, 0), "not a stream")

    listed = good("groups", "--json")
    assert listed.exit_code == 0, listed.output
    by_app = {g["app"]: g for g in json.loads(listed.stdout)}
    assert by_app[good.app]["error"] is None and by_app[good.app]["lag"] == 0
    assert "wrong Redis type" in by_app[bad.app]["error"]
    assert bad("lag", bad.app).exit_code == 3
