"""The state backup's log: a store a few updates behind catches up from it, a break in it means a
full restore, and readers without the lease (``pspf state export`` from any machine) get one
consistent snapshot while the owner keeps writing."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

from pspf import Settings, keys
from pspf.broker import AckRequest, BackupUpdate, Broker
from pspf.partition import backup
from pspf.partition.backup import LogGap, LogReader, locate
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import assert_exact, order_records
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]


def _run(spawn: Spawner, label: str, topic: str, app: str, redis_url: str, state_dir: Path) -> str:
    worker = spawn(
        label,
        topic,
        app,
        "--broker",
        redis_url,
        "--batch-size",
        "50",
        "--block-ms",
        "100",
        "--state-dir",
        str(state_dir),
        "--until-idle",
        cli_settings=False,
    )
    assert worker.wait(120) == 0, worker.tail()
    return worker.log.read_text()


def test_a_store_some_updates_behind_catches_up_from_the_log_and_a_trimmed_log_means_a_full_restore(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    a, b = tmp_path / "a", tmp_path / "b"
    records = order_records(1_000, 100, seed=51)
    produce(topic, records)
    _run(spawn, "a1", topic, app, redis_url, a)
    more = order_records(500, 100, seed=52)
    produce(topic, more)
    _run(spawn, "b1", topic, app, redis_url, b)  # B moves the partition on by 10 batches

    log = _run(spawn, "a2", topic, app, redis_url, a)
    assert f"state backup caught up app={app} partition=0 updates=" in log, log
    assert "a full restore" not in log
    assert_exact(rclient, a, topic, app, 1, records + more)

    # B is behind now too, but the log no longer leads there: B restores the whole backup.
    last = order_records(200, 100, seed=53)
    produce(topic, last)
    _run(spawn, "a3", topic, app, redis_url, a)
    rclient.delete(keys.backup_log_key(topic, 0, app))
    log = _run(spawn, "b2", topic, app, redis_url, b)
    assert f"state backup restored app={app} partition=0 values=" in log and "(a full restore)" in log, log
    assert_exact(rclient, b, topic, app, 1, records + more + last)


def test_a_break_in_the_log_is_never_read_across(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app = make_topic(1), names.app()
    produce(topic, order_records(300, 30, seed=54))
    _run(spawn, "first", topic, app, redis_url, tmp_path / "a")
    backup_keys = keys.backup_keys(topic, 0, app)
    entries = rclient.xrange(backup_keys.log)
    assert len(entries) >= 6  # one per batch of 50
    identity = entries[1][1][b"id"].decode()  # a store that stands at the second update
    broker = Broker(Settings.load({"PSPF_BROKER": redis_url}).redis)
    try:
        reader = locate(broker.acks, backup_keys, identity)
        assert reader is not None
        assert [u.identity for u in reader.read()] == [e[1][b"id"].decode() for e in entries[2:]]

        rclient.xdel(backup_keys.log, entries[3][0])  # an update lost from the log
        reader = LogReader(broker.acks, backup_keys.log, entries[1][0], identity)
        with pytest.raises(LogGap):
            reader.read()
        assert locate(broker.acks, backup_keys, "999999-1") is None  # a history the log never had
    finally:
        broker.close()


def test_state_export_reads_the_backup_from_any_machine_in_one_consistent_snapshot(
    spawn: Spawner,
    tmp_path: Path,
    redis_url: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic, app = make_topic(2), names.app()
    records = order_records(20_000, 2_000, seed=55)
    produce(topic, records)
    owner = spawn(
        "owner",
        topic,
        app,
        "--broker",
        redis_url,
        "--batch-size",
        "20",
        "--block-ms",
        "100",
        "--state-dir",
        str(tmp_path / "a"),
        "--until-idle",
        env={"PSPF_TEST_WORK_US": "100"},
        cli_settings=False,
    )
    for p in range(2):
        meta = keys.backup_meta_key(topic, p, app)
        wait_until(lambda m=meta: rclient.hget(m, keys.BACKUP_IDENTITY), 30, "the first backups")
    # Small pages: the owner commits between them, so the scan alone would mix batches.
    monkeypatch.setattr(backup, "CHUNK", 20)
    service = Service(Settings.load({"PSPF_BROKER": redis_url, "PSPF_STATE_DIR": str(tmp_path / "none")}))
    exports = 0
    try:
        while owner.alive() and exports < 20:
            lines = [json.loads(line) for line in service.state.state_export(app)]
            exports += 1
            checkpoints = {}
            counts = dict.fromkeys(range(2), 0)
            for line in lines:
                if line["kind"] == "checkpoints":
                    checkpoints[line["partition"]] = line["checkpoints"].get(topic)
                elif line["namespace"] == keys.STATE_NAMESPACE:
                    counts[line["partition"]] += line["state"]["count"]
            for p in range(2):
                stream = keys.stream_key(topic, p)
                upto = 0 if checkpoints.get(p) is None else len(rclient.xrange(stream, "-", checkpoints[p]))
                assert counts[p] == upto, f"export {exports}, partition {p}: not one snapshot"
    finally:
        service.close()
    assert exports >= 3, "the owner finished before the exports"
    assert owner.wait(120) == 0, owner.tail()

    # The CLI, from a directory with no state, equals the owner's local stores.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run(
        pspf_command("state", "export", app, "--broker", redis_url),
        capture_output=True,
        timeout=60,
        cwd=elsewhere,
        env=subprocess_env(),
    )
    assert run.returncode == 0, run.stderr
    local = subprocess.run(
        pspf_command("state", "export", app, "--broker", redis_url, "--state-dir", str(tmp_path / "a")),
        capture_output=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert local.returncode == 0, local.stderr
    decode = msgspec.json.decode
    assert sorted(map(decode, run.stdout.splitlines()), key=str) == sorted(
        map(decode, local.stdout.splitlines()), key=str
    )
    assert sum(1 for line in run.stdout.splitlines() if b'"namespace":"state"' in line) == 2_000


def test_the_transaction_and_the_script_log_an_update_alike(
    redis_url: str, rclient: redis.Redis, names: Names
) -> None:
    """An acknowledgement without DLQ moves runs as MULTI/EXEC, one with them as ``lua/ack.lua``
    (on a cluster both are scripts): both write the values and one log entry that a reader turns
    back into the same update."""
    topic, app = names.topic(), names.app()
    stream, lease, dlq = keys.stream_key(topic, 0), keys.lease_key(topic, 0, app), keys.dlq_key(topic, 0)
    rclient.xgroup_create(stream, app, id="0", mkstream=True)
    ids = [rclient.xadd(stream, {"value": str(i)}) for i in range(3)]
    rclient.xreadgroup(app, "c", {stream: ">"})
    rclient.set(lease, "mine")
    backup_keys = keys.backup_keys(topic, 0, app)
    first = BackupUpdate(
        backup_keys, "7-1", {topic: ids[0].decode()}, [b"state\x00a", b"1", b"state\x00b", b"2"], []
    )
    second = BackupUpdate(
        backup_keys, "7-2", {topic: ids[2].decode()}, [b"state\x00c", b"3"], [b"state\x00a"], follows=["7-1"]
    )

    def calls(command: str) -> int:
        return int(rclient.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    broker = Broker(Settings.load({"PSPF_BROKER": redis_url}).redis)
    try:
        execs, scripts = calls("exec"), calls("evalsha")
        assert broker.acks.ack([AckRequest(stream, app, lease, "mine", [ids[0]], dlq, backup=first)]) == [
            (1, 0)
        ]
        if not broker.conn.cluster:
            assert (calls("exec") - execs, calls("evalsha") - scripts) == (1, 0)
        dead = [(ids[2], {b"error": b"boom"})]
        assert broker.acks.ack([AckRequest(stream, app, lease, "mine", [ids[1]], dlq, dead, second)]) == [
            (1, 1)
        ]
        if not broker.conn.cluster:
            assert calls("evalsha") > scripts

        updates = LogReader(broker.acks, backup_keys.log, b"0-0", "").read()
        identity = (keys.BACKUP_NAMESPACE, keys.BACKUP_IDENTITY)
        assert [(u.identity, u.checkpoints, u.updates) for u in updates] == [
            ("7-1", {topic: ids_(ids[0])}, {identity: b"7-1", ("state", "a"): b"1", ("state", "b"): b"2"}),
            ("7-2", {topic: ids_(ids[2])}, {identity: b"7-2", ("state", "c"): b"3", ("state", "a"): None}),
        ]
        # Both write the identity into the values too (a values hash deleted alone is noticed).
        values = {b"state\x00b": b"2", b"state\x00c": b"3", keys.BACKUP_MARK: b"7-2"}
        assert rclient.hgetall(backup_keys.values) == values
        assert rclient.hget(backup_keys.meta, "identity") == b"7-2"
    finally:
        broker.close()


def ids_(raw: bytes) -> keys.StreamId:
    return keys.StreamId.parse(raw)
