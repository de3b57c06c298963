"""The state backup when Redis loses part of it: never a store wiped, never a backup silently partial.

Each test plays "hosts" as state dirs of their own and runs workers in this process with
``until_idle``. A key's ``total`` counts the entries of that key applied, so the sum of all totals
is the number of entries whose effect the state holds.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Producer, Settings, Worker
from pspf.errors import BrokerDataLost, StateError
from pspf.keys import app_key, backup_keys, stream_key, topic_key
from pspf.partition.batch import iter_state
from pspf.service import Service
from pspf.state_stores import open_store, stored_partitions
from tests.conftest import Names, RedisServer, pspf_command, subprocess_env
from tests.integration.failures_support import WorkerThread, read_state, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration

APP_KEYS = 10


def host_settings(make_settings: Callable[..., Settings], tmp_path: Path, host: str) -> Settings:
    return make_settings(PSPF_STATE_DIR=str(tmp_path / host), PSPF_LEASE_TTL_MS=1000)


def send(settings: Settings, topic: str, n: int, start: int = 0, every: int = 1) -> None:
    """``n`` entries to the keys ``k{i % APP_KEYS}`` for i from ``start``, stepping by ``every``."""
    with Producer(settings=settings) as producer:
        for i in range(start, start + n * every, every):
            producer.send(topic, {"n": 1}, key=f"k{i % APP_KEYS}")


def run(app: App, settings: Settings) -> None:
    Worker(app, settings).run(until_idle=True)


def applied(settings: Settings, app: str, partitions: int = 1) -> int:
    return sum(v["total"] for v in read_state(settings.state.dir, app, partitions).values())


def backup_present(client: Any, topic: str, app: str, partition: int = 0) -> list[str]:
    return [k for k in backup_keys(topic, partition, app) if client.exists(k)]


def test_a_refused_takeover_uploads_nothing_and_the_store_with_the_only_copy_goes_on(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """Host A applied 500 entries; the backup is deleted by hand; 100 more come. A new host B,
    with no store, is behind the group: it refuses, and must not upload its empty store as the
    backup first. Then A, whose store is the only copy and is not behind, goes on: 600 applied."""
    topic, name = make_topic(1), names.app()
    a, b = (host_settings(make_settings, tmp_path, h) for h in ("a", "b"))
    send(a, topic, 500)
    run(summing_app(name, topic), a)
    assert applied(a, name) == 500
    rclient.delete(*backup_keys(topic, 0, name))
    send(a, topic, 100, start=500)

    with pytest.raises(StateError, match="behind its consumer group"):
        run(summing_app(name, topic), b)
    assert backup_present(rclient, topic, name) == [], "the refused takeover wrote a backup"

    run(summing_app(name, topic), a)
    assert applied(a, name) == 600
    run(summing_app(name, topic), b)  # the backup A uploaded follows the partition to B
    assert applied(b, name) == 600


def test_values_deleted_under_a_running_owner_are_uploaded_again_from_its_store(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """Only the backup's values hash is deleted (its meta kept) between two runs of the owner:
    the owner's next acknowledgement must not recreate it from one batch's changes; it finds it
    damaged and uploads its whole store again, so another host restores every key."""
    topic, name = make_topic(1), names.app()
    a, b = (host_settings(make_settings, tmp_path, h) for h in ("a", "b"))
    send(a, topic, 100)
    run(summing_app(name, topic), a)
    rclient.delete(backup_keys(topic, 0, name).values)
    send(a, topic, 1, start=100)
    run(summing_app(name, topic), a)
    assert applied(a, name) == 101

    run(summing_app(name, topic), b)
    state = read_state(b.state.dir, name, 1)
    assert len(state) == APP_KEYS
    assert sum(v["total"] for v in state.values()) == 101


def test_a_damaged_backup_is_refused_by_a_host_without_a_current_store(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """The values hash deleted while nobody runs: a new host cannot tell what is missing and
    refuses loudly (restoring the rest would lose state); the host whose store matches the
    backup's identity uploads it again, and then the new host restores all of it."""
    topic, name = make_topic(1), names.app()
    a, b = (host_settings(make_settings, tmp_path, h) for h in ("a", "b"))
    send(a, topic, 100)
    run(summing_app(name, topic), a)
    rclient.delete(backup_keys(topic, 0, name).values)
    send(a, topic, 10, start=100)

    with pytest.raises(StateError, match="damaged"):
        run(summing_app(name, topic), b)
    run(summing_app(name, topic), a)
    assert applied(a, name) == 110
    send(a, topic, 10, start=110)
    run(summing_app(name, topic), b)
    assert applied(b, name) == 120
    assert len(read_state(b.state.dir, name, 1)) == APP_KEYS


def test_a_partition_count_changed_behind_pspf_is_refused_naming_both_counts(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """The topic's record deleted and created again with another count: the app's state was
    built for 2 partitions (its keys' placement), so a worker refuses to run on 4."""
    topic, name = make_topic(2), names.app()
    settings = host_settings(make_settings, tmp_path, "a")
    send(settings, topic, 100)
    run(summing_app(name, topic), settings)
    rclient.delete(topic_key(topic))
    rclient.hset(topic_key(topic), "partitions", 4)
    for partition in (2, 3):
        rclient.xadd(stream_key(topic, partition), {"key": "k1", "value": b'{"n": 1}'})

    with pytest.raises(StateError, match=r"2 partitions.*4|4 partitions.*2"):
        run(summing_app(name, topic), settings)
    assert applied(settings, name, 2) == 100


def test_a_server_that_lost_the_app_is_refused_until_its_stores_are_adopted(
    own_server: RedisServer, make_settings: Callable[..., Settings], tmp_path: Path, names: Names
) -> None:
    """Redis comes back empty (no persistence, or flushed) while the app is stopped: a worker
    with the app's stores refuses (nothing processed: neither a restore from nothing nor a
    fresh start), until the operator adopts the stores; then it goes on from them."""
    name, topic = names.app(), "orders"
    a = make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_LEASE_TTL_MS=1000)
    Service(a).create_topic(topic, 2)
    send(a, topic, 200)
    run(summing_app(name, topic), a)
    client = own_server.client()
    client.flushall()
    Service(a).create_topic(topic, 2)
    send(a, topic, 50, start=200)

    with pytest.raises(BrokerDataLost, match="pspf state adopt"):
        run(summing_app(name, topic), a)
    assert all(not client.xinfo_groups(stream_key(topic, p)) for p in range(2)), "a group was created"

    adopt = pspf_command("state", "adopt", name, "--broker", own_server.url, "--state-dir", str(a.state.dir))
    done = subprocess.run(adopt, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == ["partition 0", "partition 1"]
    assert "adopted 2 partitions" in done.stderr
    again = subprocess.run(
        [*adopt, "--json"], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert json.loads(again.stdout) == {"app": name, "adopted": {}, "kept": [0, 1]}, "adopted twice"
    run(summing_app(name, topic), a)
    assert applied(a, name, 2) == 250
    b = make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / "b"), PSPF_LEASE_TTL_MS=1000)
    run(summing_app(name, topic), b)  # the backups the adopted stores became
    assert applied(b, name, 2) == 250


def test_running_workers_stop_when_the_server_loses_the_app_and_apply_nothing_anew(
    own_server: RedisServer, make_settings: Callable[..., Settings], tmp_path: Path, names: Names
) -> None:
    """Two hosts share the partitions; the server is flushed under them and the topic created
    again with new entries. A worker taking a partition whose group and backup are gone must not
    start it anew (whichever host's store it had): both stop, and no new entry is applied."""
    name, topic = names.app(), "orders"
    hosts = [
        make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / h), PSPF_LEASE_TTL_MS=1000)
        for h in ("a", "b")
    ]
    Service(hosts[0]).create_topic(topic, 4)
    send(hosts[0], topic, 400)
    client = own_server.client()
    runners = [WorkerThread(summing_app(name, topic), h) for h in hosts]
    try:
        wait_until(
            lambda: sum(acknowledged(client, topic, name, p) for p in range(4)) == 400, 30, "all applied"
        )
        client.flushall()
        Service(hosts[0]).create_topic(topic, 4)
        send(hosts[0], topic, 40, start=400)
        wait_until(lambda: not any(r.alive() for r in runners), 30, "both workers to stop")
    finally:
        for r in runners:
            r.worker.stop()
            r.thread.join(20)
    for r in runners:
        assert isinstance(r.error, BrokerDataLost), r.error
    assert sum(acknowledged(client, topic, name, p) for p in range(4)) == 0, "entries applied anew"
    totals = sum(v["total"] for h in hosts for p in range(4) for v in partition_state(h, name, p).values())
    assert totals == 400, "a store was wiped or applied new entries"


def acknowledged(client: Any, topic: str, app: str, partition: int) -> int:
    stream = stream_key(topic, partition)
    if not client.exists(stream):
        return 0
    group = next((g for g in client.xinfo_groups(stream) if g["name"] == app.encode()), None)
    if group is None:
        return 0
    return len(client.xrange(stream, "-", group["last-delivered-id"])) - int(group["pending"])


def partition_state(settings: Settings, app: str, partition: int) -> dict[str, Any]:
    if partition not in stored_partitions("sqlite", settings.state.dir, app):
        return {}
    with open_store("sqlite", settings.state.dir, app, partition, readonly=True) as store:
        return dict(iter_state(store))


def test_a_slow_cleanup_deleting_the_meta_then_the_values_under_a_running_owner_loses_nothing(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """A cleanup script deletes the backup's meta, then 1.5 s later its values, while the owner
    applies a steady flow: the owner notices each (the meta: the backup went back; the values:
    damaged) and uploads its store again, so another host then restores every entry's effect,
    also of the keys no batch changed after the values went."""
    topic, name = make_topic(1), names.app()
    a, b = (host_settings(make_settings, tmp_path, h) for h in ("a", "b"))
    backup = backup_keys(topic, 0, name)
    sent = 0
    with WorkerThread(summing_app(name, topic), a) as runner:
        for step in range(30):
            if step <= 20:
                send(a, topic, 50, start=sent)
            else:  # after the values went, one key only: the others are in no batch's changes
                send(a, topic, 50, start=0, every=APP_KEYS)
            sent += 50
            if step in (10, 20):  # once the entries so far are in (the next batches change k0 only)
                wait_until(lambda n=sent: applied(a, name) == n, 10, "the entries so far applied")
                time.sleep(0.3)
                rclient.delete(backup.meta if step == 10 else backup.values)
            time.sleep(0.1)
            runner.check()
        wait_until(lambda: applied(a, name) == sent, 30, "every entry applied")
        wait_until(lambda: rclient.hget(backup.meta, "identity") is not None, 10, "the backup uploaded again")
        wait_until(
            lambda: rclient.hget(backup.meta, "partitions") == b"1", 5, "the count in the uploaded backup"
        )
    run(summing_app(name, topic), a)  # until idle: the last acknowledgement and its backup update
    run(summing_app(name, topic), b)
    assert applied(b, name) == sent == 1500
    assert len(read_state(b.state.dir, name, 1)) == APP_KEYS


def test_a_running_worker_whose_stream_went_back_with_the_app_lost_reports_lost_data(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """What a flush under a running worker can leave when another host made the group again:
    the stream empty (its last id below the checkpoint) with the group, and the app's record
    and backup gone. The worker sees the stream first; it must still say that Redis lost the
    app's data (exit code and remedy of BrokerDataLost), not only that the stream went back."""
    topic, name = make_topic(1), names.app()
    a = host_settings(make_settings, tmp_path, "a")
    send(a, topic, 50)
    with WorkerThread(summing_app(name, topic), a) as runner:
        wait_until(lambda: acknowledged(rclient, topic, name, 0) == 50, 30, "all applied")
        stream = stream_key(topic, 0)
        pipe = rclient.pipeline(transaction=True)
        pipe.delete(stream, app_key(name), *backup_keys(topic, 0, name))
        pipe.xgroup_create(stream, name, id="0", mkstream=True)
        pipe.execute()
        wait_until(lambda: not runner.alive(), 30, "the worker to stop")
    assert isinstance(runner.error, BrokerDataLost), runner.error
    assert applied(a, name) == 50
