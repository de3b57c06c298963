"""Savepoints against a real server: taken while the app runs, restored as a fork, into another count."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

from pspf import App, Context, RetryPolicy, Settings, Worker
from pspf.broker import Broker
from pspf.errors import ConfigError, NotFound, StateError, StateOutOfReach, UnderWay
from pspf.keys import StreamId, app_key, partition_for, savepoints_key, stream_key
from pspf.repartition.run import Repartition, make_plan
from pspf.savepoint.manifest import Location
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import WorkerThread
from tests.integration.test_repartition import carried_app
from tests.support import wait_until

pytestmark = pytest.mark.integration

KEYS = 29


def totals(numbers: range) -> dict[str, int]:
    found: dict[str, int] = {}
    for n in numbers:
        found[f"k{n % KEYS}"] = found.get(f"k{n % KEYS}", 0) + n
    return found


def running_totals(name: str, topic: str, out: str, pause_s: float = 0.0) -> App:
    """Adds each entry's ``n`` to its key's total and emits the total reached, with ``n``."""
    app = App(name)

    @app.handler(topic)
    def add(value: dict[str, int], ctx: Context) -> None:
        time.sleep(pause_s)
        total = ctx.state.get("total", 0) + value["n"]
        ctx.state["total"] = total
        ctx.emit(out, {"n": value["n"], "total": total}, key=ctx.key)

    return app


def lag_of(service: Service, app: str) -> int:
    """The app's lag; all of it before its worker recorded the app."""
    try:
        return service.apps.lag(app).lag
    except NotFound:
        return 1 << 62


def state_of(service: Service, app: str) -> dict[str, int]:
    return {f"k{k}": service.state_get(app, f"k{k}")["total"] for k in range(KEYS)}


def outputs(rclient: redis.Redis, topic: str, partitions: int) -> list[tuple[int, int]]:
    """Every (n, total) emitted into ``topic``."""
    return [
        (found["n"], found["total"])
        for p in range(partitions)
        for _, fields in rclient.xrange(stream_key(topic, p))
        for found in [json.loads(fields[b"value"])]
    ]


def after_the_cut(rclient: redis.Redis, topic: str, partitions: int, path: str) -> set[int]:
    """The ``n`` of every input entry after its partition's checkpoint in the savepoint at ``path``."""
    manifest = Location(path).read_manifest()
    found = set()
    for part in manifest.parts:
        checkpoint = part.topics[topic].checkpoint
        cut = StreamId.parse(checkpoint) if checkpoint else StreamId(0, 0)
        for entry_id, fields in rclient.xrange(stream_key(topic, part.partition)):
            if StreamId.parse(entry_id) > cut:
                found.add(json.loads(fields[b"value"])["n"])
    assert len(manifest.parts) == partitions
    return found


def test_a_savepoint_taken_under_load_forks_into_the_same_state_and_the_outputs_after_the_cut(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, out, fork_out = make_topic(3), make_topic(2), make_topic(2)
    app, fork = names.app(), names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000)])
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_BATCH_SIZE="50")
    with WorkerThread(running_totals(app, topic, out, pause_s=0.0005), settings) as worker:
        produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000, 4000)])
        wait_until(lambda: lag_of(service, app) < 3000, 30, "the app to handle 1,000 entries")
        taken = service.savepoints.take(app, str(tmp_path / "savepoints"), "mid-run")
        produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(4000, 5000)])
        assert worker.alive()
    assert not taken.stopped and taken.partitions == 3 and taken.path.endswith("/mid-run")
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    assert state_of(service, app) == totals(range(5000))

    cut = after_the_cut(rclient, topic, 3, taken.path)
    assert 1000 < len(cut) < 4000  # the cut fell inside the run
    restored = service.savepoints.restore(app, taken.path, as_app=fork)
    assert restored.fork and restored.mode == "same" and restored.entries_to_handle == len(cut)
    with pytest.raises(ConfigError, match="exists: it was restored from this savepoint already"):
        service.savepoints.restore(app, taken.path, as_app=fork)  # e.g. again after a kill at its end
    fork_settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "fork"))
    Worker(running_totals(fork, topic, fork_out), fork_settings).run(until_idle=True)

    assert state_of(service, fork) == state_of(service, app)
    forked = outputs(rclient, fork_out, 2)
    assert sorted(n for n, _ in forked) == sorted(cut)  # each entry after the cut, once
    original = {n: total for n, total in outputs(rclient, out, 2)}
    assert len(original) == 5000
    assert {n: total for n, total in forked} == {n: original[n] for n in cut}
    listed = service.savepoints.listed(app)
    assert [(e.name, e.state, e.keys) for e in listed] == [("mid-run", "complete", KEYS)]


@pytest.mark.parametrize(("before", "after"), [(4, 3), (2, 5)])
def test_a_restore_after_a_repartition_splits_the_state_by_key_exactly(
    before: int,
    after: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(before), make_topic(1)
    app, fork = names.app(), names.app()
    service = Service(make_settings())
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1500)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "before")
    assert taken.stopped
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1500, 3000)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)

    broker = Broker(make_settings().redis)
    Repartition(broker, make_plan(broker, topic, after)).run()
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(3000, 3500)])
    with pytest.raises(ConfigError, match=f"have {after} partitions now, not {before}"):
        service.savepoints.restore(app, taken.path, as_app=fork, partitions=before)

    forked = service.savepoints.restore(app, taken.path, as_app=fork, partitions=after)
    assert forked.mode == "split" and forked.partitions == after and forked.entries_to_handle == 2000
    itself = service.savepoints.restore(app, taken.path)
    assert itself.mode == "split" and not itself.fork
    for name, folder in ((fork, "fork"), (app, "b")):
        handled = Worker(
            running_totals(name, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / folder))
        ).run(until_idle=True)
        assert handled.handled == 2000, name
        assert state_of(service, name) == totals(range(3500)), name


@pytest.mark.parametrize("after_the_cut", ["there then", "added since"])
def test_a_restore_is_refused_when_the_entries_after_the_cut_were_trimmed(
    after_the_cut: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Entries after the cut that were in the stream when it was taken, or added since (a server
    that counts what it added, Redis 7+ and Valkey, says how many are gone; Redis 6.2 cannot tell,
    every entry of the cut being gone, and is refused all the same)."""
    topic, out = make_topic(2), make_topic(1)
    app = names.app()
    service = Service(make_settings())
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(400)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    if after_the_cut == "there then":
        produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(400, 800)])
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "cut")
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(800, 1200)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    before = state_of(service, app)
    last = rclient.xrevrange(stream_key(topic, 1), count=1)[0][0]
    rclient.xtrim(stream_key(topic, 1), minid=last.decode(), approximate=False)  # retention went past the cut
    with pytest.raises(StateOutOfReach, match=r"topic '.*' partition 1 no longer holds the entries"):
        service.savepoints.restore(app, taken.path)
    assert state_of(service, app) == before  # nothing was restored, nothing staged
    assert not list(rclient.scan_iter(match=f"*{app}:next"))


def test_the_cli_takes_lists_restores_and_deletes_and_a_worker_waits_for_a_switch(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    import subprocess

    topic, out = make_topic(2), make_topic(1)
    app = names.app()
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(300)])
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)

    def pspf(*args: str) -> subprocess.CompletedProcess[str]:
        command = pspf_command("app", *args, "--broker", redis_url)
        return subprocess.run(command, env=subprocess_env(), capture_output=True, text=True)

    taken = pspf("savepoint", app, "--to", str(tmp_path / "sp"), "--name", "one")
    assert taken.returncode == 0, taken.stderr
    path = taken.stdout.strip().splitlines()[-1]
    assert path == str(tmp_path / "sp" / "one") and (tmp_path / "sp" / "one" / "manifest.json").exists()
    again = pspf("savepoint", app, "--to", str(tmp_path / "sp"), "--name", "one")
    assert again.returncode != 0 and "has a savepoint named 'one' already" in again.stderr
    assert "Traceback" not in again.stderr
    listed = pspf("savepoints", app, "--json")
    assert [e["name"] for e in msgspec.json.decode(listed.stdout)] == ["one"]
    dry = pspf("restore", app, "--from", path, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert msgspec.json.decode(dry.stdout)["dry_run"] is True
    missing = pspf("restore", app, "--from", str(tmp_path / "nowhere"), "--yes")
    assert missing.returncode != 0 and "holds no savepoint" in missing.stderr

    # A switch recorded and not finished keeps the app's workers from starting.
    service = Service(make_settings())
    broker = Broker(make_settings().redis)
    from pspf.savepoint import restoring

    done = restoring.prepare(broker, Location(path), app, app, None, write=True)
    rclient.hset(app_key(app), restoring.RESTORING, msgspec.json.encode(done.plan))
    with pytest.raises(UnderWay, match=r"a restore of app .* is under way"):
        Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    resumed = pspf("restore", app, "--resume", "--yes")
    assert resumed.returncode == 0, resumed.stderr
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    assert state_of(service, app) == totals(range(300))

    deleted = pspf("savepoint", app, "--delete", "one", "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert not (tmp_path / "sp" / "one").exists()
    assert msgspec.json.decode(pspf("savepoints", app, "--json").stdout) == []


def test_the_app_restored_to_an_earlier_savepoint_publishes_nothing_twice(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Invariant 14: back at the cut, the app emits again what it emitted after it, and those
    entries are the ones its producers' records already hold: each output is in its topic once."""
    topic, out = make_topic(3), make_topic(2)
    app = names.app()
    service = Service(make_settings())
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000, 2500)])
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    first_run = sorted(outputs(rclient, out, 2))

    restored = service.savepoints.restore(app, taken.path)
    assert restored.entries_to_handle == 1500 and not restored.fork
    again = Worker(running_totals(app, topic, out), settings).run(until_idle=True)
    assert again.handled == 1500  # the store here was rebuilt from the restored backup
    assert state_of(service, app) == totals(range(2500))
    assert sorted(outputs(rclient, out, 2)) == first_run  # 2,500 outputs, none twice
    assert len(first_run) == 2500


def test_a_fork_carries_windows_tables_and_schedules_and_emits_what_the_original_emitted_after(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """The app of the repartition test (a table lookup, a schedule, a window), forked mid-way."""
    orders, customers, reminders, counts = (make_topic(3) for _ in range(4))
    fork_reminders, fork_counts = make_topic(3), make_topic(3)
    app, fork = names.app(), names.app()
    users = [f"u{i}" for i in range(12)]

    def produce(first: int, last: int) -> None:
        for n in range(first, last):
            user = users[n % len(users)]
            partition = partition_for(user.encode(), 3)
            if n % 7 == 0:
                table_row = {b"key": user.encode(), b"value": f'{{"tier": "t{n}"}}'.encode()}
                rclient.xadd(stream_key(customers, partition), table_row, id=f"{n * 50 + 1}-0")
            order = {b"key": user.encode(), b"value": f'{{"ts": {n * 50}}}'.encode()}
            rclient.xadd(stream_key(orders, partition), order, id=f"{n * 50 + 2}-0")

    def emitted(topic: str) -> list[bytes]:
        return sorted(
            fields[b"value"] for p in range(3) for _, fields in rclient.xrange(stream_key(topic, p))
        )

    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_BATCH_SIZE=25)
    produce(1, 200)
    Worker(carried_app(app, orders, customers, reminders, counts), settings).run(until_idle=True)
    service = Service(make_settings())
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "half")
    before = {topic: emitted(topic) for topic in (reminders, counts)}
    produce(200, 400)
    Worker(carried_app(app, orders, customers, reminders, counts), settings).run(until_idle=True)

    service.savepoints.restore(app, taken.path, as_app=fork)
    fork_settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "fork"), PSPF_BATCH_SIZE=25)
    Worker(carried_app(fork, orders, customers, fork_reminders, fork_counts), fork_settings).run(
        until_idle=True
    )
    states = {name: {user: service.state_get(name, user) for user in users} for name in (app, fork)}
    assert states[fork] == states[app]
    assert all(state["n"] > 20 and any(state["tiers"]) for state in states[app].values())
    for original, forked in ((reminders, fork_reminders), (counts, fork_counts)):
        after = emitted(original)
        for value in before[original]:
            after.remove(value)
        assert after and emitted(forked) == after  # what the original emitted after the cut, once
    assert len(emitted(fork_reminders)) == len(users)  # each key's schedule came due after the cut


def test_a_savepoint_to_s3_restores_from_the_path_it_printed(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app, fork = names.app(), names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(700)])
    Worker(running_totals(app, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))).run(
        until_idle=True
    )
    taken = service.savepoints.take(app, f"s3://{s3_bucket}/savepoints", "s3-one")
    assert taken.path == f"s3://{s3_bucket}/savepoints/s3-one" and taken.bytes > 0
    manifest = Location(taken.path).read_manifest()
    assert manifest.keys == KEYS and [part.partition for part in manifest.parts] == [0, 1]
    service.savepoints.restore(app, taken.path, as_app=fork)
    Worker(running_totals(fork, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "f"))).run(
        until_idle=True
    )
    assert state_of(service, fork) == totals(range(700))
    service.savepoints.delete(app, "s3-one")
    with pytest.raises(NotFound, match="holds no savepoint"):
        Location(taken.path).read_manifest()


def test_a_savepoint_with_stop_stops_the_workers_after_their_batch_and_lets_new_ones_run_after(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app, fork = names.app(), names.app()
    service = Service(make_settings(PSPF_LEASE_TTL_MS="1500"))
    settings = make_settings(
        PSPF_STATE_DIR=str(tmp_path / "a"), PSPF_LEASE_TTL_MS="1500", PSPF_BATCH_SIZE="100"
    )
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(3000)])
    with WorkerThread(running_totals(app, topic, out, pause_s=0.002), settings) as worker:
        wait_until(lambda: lag_of(service, app) < 2900, 30, "the app to handle 100 entries")
        taken = service.savepoints.take(app, str(tmp_path / "sp"), "stopped", stop=True, timeout_s=30)
        assert not worker.alive() and worker.error is None  # it stopped, as on SIGTERM
    assert taken.stopped
    at_stop = state_of(service, app)
    assert sum(at_stop.values()) < sum(totals(range(3000)).values())  # it stopped mid-way
    assert Broker(make_settings().redis).apps.stop_requested(app) is None  # the request is gone

    service.savepoints.restore(app, taken.path, as_app=fork)
    Worker(running_totals(app, topic, out), settings).run(until_idle=True)  # new workers run
    Worker(running_totals(fork, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "f"))).run(
        until_idle=True
    )
    assert state_of(service, app) == state_of(service, fork) == totals(range(3000))


def test_a_worker_started_while_a_stop_is_asked_stops_before_it_takes_a_partition(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app = names.app()
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100)])
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100, 200)])
    broker = Broker(make_settings().redis)
    broker.apps.request_stop(app, "a test")
    assert Worker(running_totals(app, topic, out), make_settings()).run().handled == 0
    broker.apps.request_stop(app, None)
    assert Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True).handled == 100


def test_a_deleted_app_loses_its_list_of_savepoints_but_is_restored_from_a_path(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app = names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(200)])
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "kept")
    removal = service.retire.delete_app(app)
    assert savepoints_key(app) in removal.keys and not rclient.exists(savepoints_key(app))
    assert service.savepoints.listed(app) == []
    service.savepoints.restore(app, taken.path)  # the files stay: the app comes back from them
    handled = Worker(running_totals(app, topic, out), make_settings(PSPF_STATE_DIR=str(tmp_path / "b")))
    assert handled.run(until_idle=True).handled == 0
    assert state_of(service, app) == totals(range(200))


def test_a_savepoint_of_another_app_is_refused_before_anything_is_staged(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app, other = names.app(), names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(50)])
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"))
    with pytest.raises(ConfigError, match=f"is of app '{app}', not '{other}'"):
        service.savepoints.restore(other, taken.path)
    assert not [key for key in rclient.scan_iter(match=f"*{other}*")]  # nothing staged, nothing made


def test_a_damaged_savepoint_file_is_refused_and_leaves_nothing_staged(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    topic, out = make_topic(2), make_topic(1)
    app = names.app()
    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(300)])
    Worker(running_totals(app, topic, out), make_settings()).run(until_idle=True)
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "cut")
    damaged = tmp_path / "sp" / "cut" / "partition-1.state"
    raw = bytearray(damaged.read_bytes())
    raw[-3] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with pytest.raises(StateError, match=r"the file partition-1\.state is damaged"):
        service.savepoints.restore(app, taken.path)
    assert not list(rclient.scan_iter(match=f"*{app}:next"))
    assert state_of(service, app) == totals(range(300))


def test_a_retry_parked_at_the_cut_is_tried_again_by_the_fork_and_refused_once_trimmed(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """An entry parked for a retry at the cut, below the checkpoint, is delivered to the fork again."""
    topic = make_topic(2)
    app, fork = names.app(), names.app()
    failing = {7, 8}
    policy = RetryPolicy(mode="deferred", max_retries=20, base_delay_ms=1000, factor=1.0, max_delay_ms=1000)

    def summing(name: str) -> App:
        made = App(name)

        @made.handler(topic, retry=policy)
        def add(value: dict[str, int], ctx: Context) -> None:
            if value["n"] in failing:
                raise RuntimeError("not yet")
            ctx.state["total"] = ctx.state.get("total", 0) + value["n"]

        return made

    service = Service(make_settings())
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100)])
    with WorkerThread(summing(app), make_settings(PSPF_STATE_DIR=str(tmp_path / "a"))):
        wait_until(lambda: lag_of(service, app) <= 2, 30, "all but the failing entries handled")
    taken = service.savepoints.take(app, str(tmp_path / "sp"), "parked")
    waiting = {e for part in Location(taken.path).read_manifest().parts for e in part.topics[topic].waiting}
    assert len(waiting) == 2  # both parked, at or below their checkpoints

    failing.clear()
    service.savepoints.restore(app, taken.path, as_app=fork)
    forked = Worker(summing(fork), make_settings(PSPF_STATE_DIR=str(tmp_path / "f"))).run(until_idle=True)
    assert forked.handled == 2 and state_of(service, fork) == totals(range(100))

    for partition in range(2):  # retention removes everything but the last entry of each partition
        last = rclient.xrevrange(stream_key(topic, partition), count=1)[0][0]
        rclient.xtrim(stream_key(topic, partition), minid=last.decode(), approximate=False)
    with pytest.raises(StateOutOfReach, match="which still needed a handler, was trimmed"):
        service.savepoints.restore(app, taken.path, as_app=names.app())
