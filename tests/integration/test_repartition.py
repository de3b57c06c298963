"""Repartitioning a topic with two apps, one of them lagging: each handles exactly what it had not."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
import redis

from pspf import App, Context, Producer, Settings, Worker, windows
from pspf.broker import Broker
from pspf.codec import KEY
from pspf.errors import AppRunning, BrokerError, ConfigError, NotFound, StateError
from pspf.keys import layout_key, lease_key, partition_for, stream_key, topic_key
from pspf.repartition.run import Repartition, make_plan, plan_key
from pspf.service import Service
from tests.conftest import Names, pspf_command, subprocess_env
from tests.integration.failures_support import WorkerThread, summing_app
from tests.support import wait_until

pytestmark = pytest.mark.integration

KEYS = 37


def totals(n_from: int, n_to: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for n in range(n_from, n_to):
        found[f"k{n % KEYS}"] = found.get(f"k{n % KEYS}", 0) + n
    return found


def state_of(service: Service, app: str) -> dict[str, int]:
    return {f"k{k}": service.state_get(app, f"k{k}")["total"] for k in range(KEYS)}


def every_entry_in_its_partition(rclient: redis.Redis, topic: str, count: int) -> int:
    seen = 0
    for partition in range(count):
        for _, fields in rclient.xrange(stream_key(topic, partition)):
            assert partition_for(fields[KEY], count) == partition
            seen += 1
    return seen


def repartition_cli(
    redis_url: str, topic: str, *args: str, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``pspf topic repartition TOPIC ARGS --yes`` in a process of its own (killed at ``crash_at``).

    Its claim's lease lives 1 s: a ``--resume`` after a kill waits that long for it to lapse.
    """
    crash = {} if crash_at is None else {"PSPF_REPARTITION_CRASH_AT": crash_at}
    env = subprocess_env(PSPF_LEASE_TTL_MS="1000", **crash)
    command = pspf_command("topic", "repartition", topic, *args, "--yes", "--broker", redis_url)
    return subprocess.run(command, env=env, capture_output=True, text=True)


@pytest.mark.parametrize(("before", "after"), [(4, 8), (8, 3)])
def test_two_apps_one_lagging_each_handle_exactly_what_they_had_not(
    before: int,
    after: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, ahead, behind = make_topic(before), names.app(), names.app()
    service = Service(make_settings())
    settings = {app: make_settings(PSPF_STATE_DIR=str(tmp_path / app)) for app in (ahead, behind)}
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000)])
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(1000, 4000)])
    Worker(summing_app(ahead, topic), settings[ahead]).run(until_idle=True)
    assert state_of(service, behind) == totals(0, 1000)  # lags by 3,000 entries

    broker = Broker(make_settings().redis)
    plan = make_plan(broker, topic, after)
    assert plan.topics == [topic] and sorted(plan.apps) == sorted([ahead, behind])
    Repartition(broker, plan).run()
    assert len(service.topics.describe_topic(topic).partitions) == after
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(4000, 5000)])
    assert every_entry_in_its_partition(rclient, topic, after) == 5000

    handled = {
        app: Worker(summing_app(app, topic), settings[app]).run(until_idle=True).handled
        for app in (ahead, behind)
    }
    assert handled == {ahead: 1000, behind: 4000}
    for app in (ahead, behind):
        assert state_of(service, app) == totals(0, 5000), app


def crash_points(topic: str, app: str) -> list[str]:
    return ["copy", f"copied {topic}", f"staged {app}", "switch", f"switched {topic} 0"]


@pytest.mark.parametrize("point", range(5))
def test_a_repartition_killed_at_any_step_is_resumed_to_the_same_exact_result(
    point: int,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    topic, ahead, behind = make_topic(4), names.app(), names.app()
    service = Service(make_settings())
    settings = {app: make_settings(PSPF_STATE_DIR=str(tmp_path / app)) for app in (ahead, behind)}
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(500)])
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(500, 2000)])
    Worker(summing_app(ahead, topic), settings[ahead]).run(until_idle=True)

    where = crash_points(topic, ahead)[point]
    killed = repartition_cli(redis_url, topic, "--partitions", "6", crash_at=where)
    assert killed.returncode == -9, killed.stderr
    again = repartition_cli(redis_url, topic, "--partitions", "6")
    # the killed command's claim has not lapsed yet: refused as under way (exit 6), naming --resume
    assert again.returncode == 6 and "--resume" in again.stderr, again.stderr
    resumed = repartition_cli(redis_url, topic, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed the repartition" in resumed.stdout
    assert len(service.topics.describe_topic(topic).partitions) == 6

    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(2000, 2300)])
    assert every_entry_in_its_partition(rclient, topic, 6) == 2300
    for app in (ahead, behind):
        Worker(summing_app(app, topic), settings[app]).run(until_idle=True)
        assert state_of(service, app) == totals(0, 2300), app


def test_entries_with_the_same_id_in_two_old_partitions_are_merged_and_handled_once(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Two streams hand out the same ids; merged into one partition, the later copy gets the next id.

    The app handled partition 0's entries and only the first half of partition 1's: after the
    merge its handled and unhandled entries share ids, and it handles the unhandled ones alone.
    """
    topic, app = make_topic(2), names.app()
    keys_of = {
        p: [f"k{i}" for i in range(400) if partition_for(f"k{i}".encode(), 2) == p][:5] for p in (0, 1)
    }
    expected: dict[str, int] = {}

    def add(partition: int, numbers: range) -> None:
        for n in numbers:
            key = keys_of[partition][n % 5]
            value = 1000 * partition + n
            fields = {b"key": key.encode(), b"value": f'{{"n": {value}}}'.encode()}
            rclient.xadd(stream_key(topic, partition), fields, id=f"{1000 + n}-0")
            expected[key] = expected.get(key, 0) + value

    add(0, range(1, 201))
    add(1, range(1, 101))
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "s"), PSPF_BATCH_SIZE=30)
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 300
    add(1, range(101, 201))  # unhandled, with the ids of partition 0's handled entries

    broker = Broker(make_settings().redis)
    Repartition(broker, make_plan(broker, topic, 1)).run()
    merged = rclient.xrange(stream_key(topic, 0))
    ids = [tuple(map(int, entry_id.split(b"-"))) for entry_id, _ in merged]
    assert len(merged) == 400 and ids == sorted(ids) and len(set(ids)) == 400
    assert sum(b"pspf-moved-id" in f.get(b"headers", b"") for _, f in merged) == 200
    assert Worker(summing_app(app, topic), settings).run(until_idle=True).handled == 100
    service = Service(make_settings())
    assert {k: service.state_get(app, k)["total"] for k in expected} == expected


def carried_app(name: str, orders: str, customers: str, reminders: str, counts: str) -> App:
    """A table lookup, a scheduled callback and a window: what a repartition must carry."""
    app = App(name)
    app.table(customers)

    @app.handler(orders)
    def order(value: dict[str, int], ctx: Context) -> None:
        row = ctx.table(customers)
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        ctx.state["tiers"] = [*ctx.state.get("tiers", []), None if row is None else row["tier"]]
        if ctx.state["n"] == 1:  # due after the repartition: the schedule must move with its key
            ctx.schedule(15_000, "remind", value["ts"])

    @app.on_schedule("remind")
    def remind(ts: int, ctx: Context) -> None:
        ctx.emit(reminders, {"key": ctx.key, "ts": ts})

    @app.window(orders, windows.tumbling(timedelta(seconds=1)), timestamp="ts", emit_to=counts)
    def per_second(total: int | None, value: dict[str, int]) -> int:
        return (total or 0) + 1

    return app


def test_a_window_a_table_and_a_schedule_give_the_same_results_across_a_repartition(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """The same entries into two copies of the app; one copy's topics go from 4 to 3 partitions."""
    users = [f"u{i}" for i in range(12)]
    runs = {}
    for label in ("reference", "repartitioned"):
        orders, customers, reminders, counts = (make_topic(4) for _ in range(4))
        runs[label] = (names.app(), orders, customers, reminders, counts)
    settings = {
        label: make_settings(PSPF_STATE_DIR=str(tmp_path / label), PSPF_BATCH_SIZE=25) for label in runs
    }

    def produce(first: int, last: int, partitions: int) -> None:
        for label, (_, orders, customers, _, _) in runs.items():
            count = partitions if label == "repartitioned" else 4
            for n in range(first, last):
                user = users[n % len(users)]
                if n % 7 == 0:
                    fields = {b"key": user.encode(), b"value": f'{{"tier": "t{n}"}}'.encode()}
                    rclient.xadd(
                        stream_key(customers, partition_for(user.encode(), count)),
                        fields,
                        id=f"{n * 50 + 1}-0",
                    )
                fields = {b"key": user.encode(), b"value": f'{{"ts": {n * 50}}}'.encode()}
                rclient.xadd(
                    stream_key(orders, partition_for(user.encode(), count)), fields, id=f"{n * 50 + 2}-0"
                )

    def run_all() -> None:
        for label, (app, orders, customers, reminders, counts) in runs.items():
            Worker(carried_app(app, orders, customers, reminders, counts), settings[label]).run(
                until_idle=True
            )

    produce(1, 200, 4)
    run_all()
    app, orders = runs["repartitioned"][:2]
    broker = Broker(make_settings().redis)
    plan = make_plan(broker, orders, 3)
    assert plan.topics == sorted([orders, runs["repartitioned"][2]]) and plan.apps == [app]
    Repartition(broker, plan).run()
    produce(200, 400, 3)
    run_all()

    service = Service(make_settings())
    states = {
        label: {user: service.state_get(app_name, user) for user in users}
        for label, (app_name, *_) in runs.items()
    }
    assert states["repartitioned"] == states["reference"]
    assert all(state["n"] > 20 and any(state["tiers"]) for state in states["reference"].values())

    def emitted(topic: str, partitions: int, until_ms: int, field: str) -> list[bytes]:
        found = [
            fields[b"value"]
            for p in range(partitions)
            for _, fields in rclient.xrange(stream_key(topic, p))
            if msgspec.json.decode(fields[b"value"])[field] <= until_ms
        ]
        return sorted(found)

    for index, field in ((3, "ts"), (4, "end")):
        reference = emitted(runs["reference"][index], 4, 18_000, field)
        assert reference and emitted(runs["repartitioned"][index], 4, 18_000, field) == reference
    assert len(emitted(runs["reference"][3], 4, 18_000, "ts")) == len(users)  # one reminder a key


def test_producers_write_nothing_in_the_old_layout_and_wait_for_a_repartition_to_finish(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    redis_url: str,
) -> None:
    topic = make_topic(4)
    broker = Broker(make_settings().redis)
    stale = Producer(broker, batch_size=10_000)
    stale.send(topic, {"n": -1}, key="first")
    stale.flush()  # it knows the topic as 4 partitions, layout 0

    # Killed after sealing: producers wait, bounded, and lose nothing.
    killed = repartition_cli(redis_url, topic, "--partitions", "6", crash_at="copy")
    assert killed.returncode == -9
    for n in range(100):
        stale.send(topic, {"n": n}, key=f"k{n}")
    stale.repartition_wait_s = 0.3
    with pytest.raises(BrokerError, match="being repartitioned"):
        stale.flush()
    with pytest.raises(ConfigError, match="is being repartitioned"):  # no worker starts either
        Worker(summing_app("late-starter", topic), make_settings()).run(until_idle=True)
    impatient = Producer(settings=make_settings(PSPF_REPARTITION_WAIT_S="0.2"))
    with pytest.raises(BrokerError, match=r"not done within 0\.2s"):
        impatient.send(topic, {"n": 0}, key="new")
    impatient.close()
    assert sum(rclient.xlen(stream_key(topic, p)) for p in range(4)) == 1  # nothing written meanwhile

    stale.repartition_wait_s = 30
    waiting = threading.Thread(target=stale.flush)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive(), "the flush waits for the repartition"
    resumed = repartition_cli(redis_url, topic, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    waiting.join(30)
    assert not waiting.is_alive() and stale.sent == 101
    assert every_entry_in_its_partition(rclient, topic, 6) == 101


def test_a_producer_of_the_old_count_writes_nothing_into_a_retired_partition(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
) -> None:
    """8 -> 3: a producer still routing with 8 is refused on partitions 3..7 too, and re-routes.

    A retired partition's guard must not read as "generation 0" (an absent key), or the stale
    producer would recreate a stream no app reads. Deleting the topic takes the guards with it.
    """
    topic = make_topic(8)
    broker = Broker(make_settings().redis)
    stale = Producer(broker, batch_size=10_000)
    stale.send(topic, {"n": -1}, key="first")
    stale.flush()  # it knows the topic as 8 partitions, layout 0
    Repartition(broker, make_plan(broker, topic, 3)).run()
    for n in range(200):
        stale.send(topic, {"n": n}, key=f"k{n}")
    stale.flush()
    assert stale.sent == 201
    assert every_entry_in_its_partition(rclient, topic, 3) == 201
    assert not any(rclient.exists(stream_key(topic, p)) for p in range(3, 8))

    Service(make_settings()).retire.delete_topic(topic)
    assert not rclient.keys(f"*{{{topic}:*")  # no guard left behind
    broker.topics.create_topic(topic, 8)
    fresh = Producer(broker)
    for n in range(50):
        fresh.send(topic, {"n": n}, key=f"k{n}")
    fresh.flush()
    assert every_entry_in_its_partition(rclient, topic, 8) == 50


def forwarding_app(name: str, source: str, target: str) -> App:
    """An app that emits each entry of ``source`` to ``target`` under its key."""
    app = App(name)

    @app.handler(source)
    def forward(value: dict[str, int], ctx: Context) -> None:
        ctx.emit(target, value, key=ctx.key)

    return app


@pytest.mark.parametrize("across", ["running", "restarted"])
def test_an_app_emitting_into_a_repartitioned_topic_routes_its_rows_again(
    across: str,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The emitting app reads another topic, so it runs on; its relay is refused while the
    repartition runs and then routes its waiting rows with the new count: each once.

    ``running``: the same worker sees the switch. ``restarted``: it stops while its rows wait and
    a worker on another state dir publishes them from the backup.
    """
    source, target = make_topic(2), make_topic(4)
    forwarder, reader = names.app(), names.app()
    reading = make_settings(PSPF_STATE_DIR=str(tmp_path / "reader"))
    produce(target, [(f"k{n % KEYS}", {"n": n}) for n in range(100)])
    Worker(summing_app(reader, target), reading).run(until_idle=True)

    sealed = repartition_cli(redis_url, target, "--partitions", "6", crash_at="copy")
    assert sealed.returncode == -9
    produce(source, [(f"k{n % KEYS}", {"n": n}) for n in range(100, 400)])
    first = make_settings(PSPF_STATE_DIR=str(tmp_path / "first"))
    with WorkerThread(forwarding_app(forwarder, source, target), first, until_idle=True) as running:
        deadline = time.monotonic() + 20
        service = Service(make_settings())

        def pending() -> int:
            try:
                return len(service.outbox.outbox_list(forwarder, "pending"))
            except NotFound:  # no backup yet
                return 0

        while pending() < 300:
            running.check()
            assert time.monotonic() < deadline, "the rows never waited"
            time.sleep(0.1)
        assert sum(rclient.xlen(stream_key(target, p)) for p in range(4)) == 100  # nothing written
        if across == "restarted":
            running.stop()
        resumed = repartition_cli(redis_url, target, "--resume")
        assert resumed.returncode == 0, resumed.stderr
        if across == "running":
            running.thread.join(30)
            assert not running.alive()
            running.check()
    if across == "restarted":
        second = make_settings(PSPF_STATE_DIR=str(tmp_path / "second"))
        Worker(forwarding_app(forwarder, source, target), second).run(until_idle=True)

    assert every_entry_in_its_partition(rclient, target, 6) == 400
    values = sorted(
        msgspec.json.decode(fields[b"value"])["n"]
        for p in range(6)
        for _, fields in rclient.xrange(stream_key(target, p))
    )
    assert values == list(range(400))  # each once
    Worker(summing_app(reader, target), reading).run(until_idle=True)
    assert state_of(Service(make_settings()), reader) == totals(0, 400)


def test_state_of_keyless_entries_is_refused_before_anything_moves(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """Keyless entries' state belongs to a partition: merging would keep one partition's."""
    topic, app = make_topic(2), names.app()
    produce(topic, [(None, {"n": n}) for n in range(10)])
    Worker(summing_app(app, topic), make_settings(PSPF_STATE_DIR=str(tmp_path))).run(until_idle=True)
    broker = Broker(make_settings().redis)
    with pytest.raises(ConfigError, match="keeps state for keyless entries"):
        make_plan(broker, topic, 1)
    assert rclient.hgetall(topic_key(topic)).get(b"moving") is None


def test_a_worker_started_after_the_plan_is_found_after_the_seal_and_nothing_moves(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    tmp_path: Path,
) -> None:
    """The plan's check passed; a worker starts before the seal: the command refuses, unsealed."""
    topic, app = make_topic(2), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    broker = Broker(make_settings().redis)
    plan = make_plan(broker, topic, 4)
    with WorkerThread(summing_app(app, topic), settings) as running:
        leases = [lease_key(topic, p, app) for p in range(2)]
        wait_until(lambda: any(broker.leases.lease_holders(leases)), 30, "the worker's leases")
        with pytest.raises(AppRunning, match="is running"):
            Repartition(broker, plan).run()
        assert rclient.hget(topic_key(topic), "moving") is None
        assert not rclient.exists(plan_key(topic))
        produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100, 200)])  # no wait: unsealed
        wait_until(lambda: state_of(Service(make_settings()), app) == totals(0, 200), 20, "the rest handled")
        running.check()
    assert len(Service(make_settings()).topics.describe_topic(topic).partitions) == 2


def test_a_producer_refused_by_a_guard_its_topic_record_contradicts_fails_after_the_wait(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], rclient: redis.Redis
) -> None:
    """Guards that disagree with the record, no repartition running: one clear error, no endless retry."""
    topic = make_topic(2)
    producer = Producer(settings=make_settings(PSPF_REPARTITION_WAIT_S="0.3"))
    producer.send(topic, {"n": 0}, key="first")
    rclient.set(layout_key(topic, 0), "9")
    rclient.set(layout_key(topic, 1), "9")
    for n in range(10):
        producer.send(topic, {"n": n}, key=f"k{n}")
    started = time.monotonic()
    with pytest.raises(BrokerError, match="its partitions refuse layout '0'"):
        producer.flush()
    assert time.monotonic() - started < 10
    assert sum(rclient.xlen(stream_key(topic, p)) for p in range(2)) == 0


def test_a_producer_refuses_a_partition_count_changed_behind_pspfs_back_as_the_worker_does(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The topic record edited from 4 to 8 partitions: the worker and the Producer refuse (exit 5)."""
    topic, app = make_topic(4), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path))
    produce(topic, [(f"k{n % KEYS}", {"n": n}) for n in range(100)])
    Worker(summing_app(app, topic), settings).run(until_idle=True)
    rclient.hset(topic_key(topic), "partitions", "8")
    with pytest.raises(StateError, match="was built for 4 partitions") as refused:
        Worker(summing_app(app, topic), settings).run(until_idle=True)
    assert refused.value.exit_code == 5
    producer = Producer(settings=make_settings())
    with pytest.raises(StateError, match=f"app {app!r} was built for 4 partitions") as refused:
        for n in range(100, 2100):
            producer.send(topic, {"n": n}, key=f"k{n % KEYS}")
        producer.flush()
    assert refused.value.exit_code == 5
    cli = subprocess.run(
        pspf_command("produce", topic, "--key", "k1", '{"n": 1}', "--broker", redis_url),
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 5 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert [rclient.xlen(stream_key(topic, p)) for p in range(4, 8)] == [0, 0, 0, 0]
    assert sum(rclient.xlen(stream_key(topic, p)) for p in range(4)) == 100


def test_a_dead_letter_is_redriven_into_its_keys_new_partition(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    topic, app_name = make_topic(2), names.app()
    fixed = {"yes": False}

    def app() -> App:
        built = App(app_name)

        @built.handler(topic, non_retryable=(ValueError,))
        def add(value: dict[str, int], ctx: Context) -> None:
            if value["n"] % 10 == 3 and not fixed["yes"]:
                raise ValueError("bad until fixed")
            ctx.state["total"] = ctx.state.get("total", 0) + value["n"]

        return built

    produce(topic, [(f"k{n % 7}", {"n": n}) for n in range(50)])
    settings = make_settings()
    assert Worker(app(), settings).run(until_idle=True).dead_lettered == 5
    broker = Broker(settings.redis)
    Repartition(broker, make_plan(broker, topic, 5)).run()
    service = Service(settings)
    dead = service.dlq.dlq_list(topic)
    assert len(dead) == 5
    assert all(d.partition == partition_for(d.key.encode(), 5) for d in dead if d.key is not None)
    assert service.dlq.dlq_redrive(topic, all_entries=True).changed == 5
    fixed["yes"] = True
    assert Worker(app(), settings).run(until_idle=True).handled == 5
    assert every_entry_in_its_partition(rclient, topic, 5) == 55
    assert {f"k{k}": service.state_get(app_name, f"k{k}")["total"] for k in range(7)} == {
        f"k{k}": sum(n for n in range(50) if n % 7 == k) for k in range(7)
    }
