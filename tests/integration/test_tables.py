"""Tables and global tables against a real server: lookups see the row current at their entry."""

from __future__ import annotations

import random
import subprocess
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import redis

from pspf import App, Context, Settings, Worker, windows
from pspf.errors import ConfigError
from pspf.keys import StreamId, dlq_key, partition_for, stream_key
from pspf.state_stores import open_store
from tests.conftest import pspf_command, subprocess_env

pytestmark = pytest.mark.integration


def xadd(rclient: redis.Redis, topic: str, partitions: int, key: str, value: Any) -> bytes:
    """One entry, added now (ids follow the order of the calls, across topics)."""
    stream = stream_key(topic, partition_for(key.encode(), partitions))
    return bytes(rclient.xadd(stream, {b"key": key.encode(), b"value": msgspec.json.encode(value)}))


def enrichment_app(name: str, orders: str, customers: str, products: str | None = None) -> App:
    """Each order records the customer's tier (and the product's price) its lookup saw."""
    app = App(name)
    app.table(customers)
    if products is not None:
        app.global_table(products)

    @app.handler(orders)
    def order(value: dict[str, Any], ctx: Context) -> None:
        row = ctx.table(customers)
        seen = [value["n"], None if row is None else row["tier"]]
        if products is not None:
            product = ctx.table(products, key=value["product"])
            seen.append(None if product is None else product["price"])
        ctx.state["seen"] = [*ctx.state.get("seen", []), seen]

    return app


@pytest.mark.parametrize("layout", ["interleaved", "updates first"])
def test_a_lookup_sees_every_update_before_its_entry_and_none_after(
    layout: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    """Updates and orders in id order, read in small batches across both topics.

    "updates first": the orders' reads run far ahead of the table's, so they are held back for
    many batches (and what was read ahead of them with them).
    """
    orders, customers = make_topic(2), make_topic(2)
    rng = random.Random(5)
    users = [f"c{i}" for i in range(6)]
    events: list[tuple[StreamId, int, str, Any]] = []
    for n in range(600):
        user = rng.choice(users)
        if (n < 200) if layout == "updates first" else (rng.random() < 0.3):
            tier = rng.choice(["gold", "silver", None])
            entry_id = xadd(rclient, customers, 2, user, None if tier is None else {"tier": tier})
            events.append((StreamId.parse(entry_id), 0, user, tier))
        else:
            entry_id = xadd(rclient, orders, 2, user, {"n": n})
            events.append((StreamId.parse(entry_id), 1, user, n))
    # The reference: id order across the topics; an update with an order's own id comes first.
    current: dict[str, str | None] = {}
    expected: dict[str, list[list[Any]]] = {}
    for _, kind, user, value in sorted(events, key=lambda e: e[:2]):
        if kind == 0:
            current[user] = value
        else:
            expected.setdefault(user, []).append([value, current.get(user)])
    app = enrichment_app(names.app(), orders, customers)
    settings = make_settings(PSPF_BATCH_SIZE=7)
    summary = Worker(app, settings).run(until_idle=True)
    assert (summary.handled, summary.dead_lettered, summary.failed) == (600, 0, 0)
    for partition in range(2):
        with open_store("sqlite", settings.state.dir, app.name, partition, readonly=True) as store:
            for user, raw in store.items("state"):
                assert msgspec.msgpack.decode(raw)["seen"] == expected.pop(user)
    assert expected == {}


def test_global_table_is_loaded_before_the_first_entry_and_followed_after(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
    running: Callable[[Worker], None],
) -> None:
    """12,000 product rows (more than one read) then orders: every order sees the last row."""
    orders, customers, products = make_topic(2), make_topic(2), make_topic(3)
    pipe = rclient.pipeline(transaction=False)
    for i in range(12_000):
        key = f"p{i}"
        pipe.xadd(
            stream_key(products, partition_for(key.encode(), 3)),
            {b"key": key.encode(), b"value": msgspec.json.encode({"price": i})},
        )
    pipe.execute()
    xadd(rclient, products, 3, "marker", {"price": -1})
    for n in range(50):
        xadd(rclient, orders, 2, f"c{n % 5}", {"n": n, "product": "marker"})
    app = enrichment_app(names.app(), orders, customers, products)
    settings = make_settings()
    assert Worker(app, settings).run(until_idle=True).handled == 50
    seen = _seen(settings, app.name)
    assert sorted(s[0] for s in seen) == list(range(50))
    assert {s[2] for s in seen} == {-1}, "an entry was handled before the global table was loaded"

    # A running worker follows the table: a price changed after the start is seen by later orders.
    worker = Worker(app, settings)
    running(worker)
    update = StreamId.parse(xadd(rclient, products, 3, "marker", {"price": 7}))
    _wait_for(lambda: _followed_to(worker, stream_key(products, partition_for(b"marker", 3)), update))
    xadd(rclient, orders, 2, "c0", {"n": 50, "product": "marker"})
    _wait_for(lambda: any(s[0] == 50 for s in _seen(settings, app.name)))
    assert [s[2] for s in _seen(settings, app.name) if s[0] == 50] == [7]


def test_a_table_with_another_partition_count_is_refused_in_one_line(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], names: Any
) -> None:
    orders, customers = make_topic(4), make_topic(3)
    app = enrichment_app(names.app(), orders, customers)
    with pytest.raises(ConfigError) as caught:
        Worker(app, make_settings()).run(until_idle=True)
    message = str(caught.value)
    assert "\n" not in message
    assert f"table {customers!r}" in message and "has 3 partitions" in message and "have 4" in message


def test_lookup_of_a_key_of_another_partition_fails_its_entry_naming_both(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    orders, customers = make_topic(4), make_topic(4)
    app = App(names.app())
    app.table(customers)

    @app.handler(orders)
    def order(value: dict[str, Any], ctx: Context) -> None:
        ctx.state["row"] = ctx.table(customers, key=value["other"])

    home = partition_for(b"c1", 4)
    other = next(k for k in (f"k{i}" for i in range(100)) if partition_for(k.encode(), 4) != home)
    xadd(rclient, orders, 4, "c1", {"other": other})
    settings = make_settings(PSPF_MAX_RETRIES=1)
    assert Worker(app, settings).run(until_idle=True).dead_lettered == 1
    dlq = rclient.xrange(dlq_key(orders, partition_for(b"c1", 4)))
    messages = b" ".join(fields.get(b"message", b"") for _, fields in dlq)
    assert f"partition {partition_for(other.encode(), 4)}".encode() in messages
    assert f"entry's partition is {partition_for(b'c1', 4)}".encode() in messages


def _seen(settings: Settings, app: str) -> list[list[Any]]:
    seen: list[list[Any]] = []
    for partition in range(2):
        with open_store("sqlite", settings.state.dir, app, partition, readonly=True) as store:
            for _, raw in store.items("state"):
                seen += msgspec.msgpack.decode(raw)["seen"]
    return seen


def _followed_to(worker: Worker, stream: str, entry_id: StreamId) -> bool:
    """Whether a running worker's global tables have read ``stream`` up to ``entry_id``."""
    lookups = worker.processor.lookups
    if lookups is None or lookups.global_tables is None:
        return False
    position = lookups.global_tables.positions.get(stream)
    return position is not None and position >= entry_id


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_pspf_run_refuses_a_table_of_another_partition_count_with_exit_2_and_one_line(
    make_topic: Callable[[int], str], redis_url: str, names: Any, tmp_path: Any
) -> None:
    orders, customers = make_topic(4), make_topic(2)
    env = subprocess_env(PSPF_TEST_APP=names.app(), PSPF_TEST_TOPIC=orders, PSPF_TEST_TABLE=customers)
    args = ["run", "tests.integration.cli_apps:enrich", "--broker", redis_url, "--until-idle"]
    done = subprocess.run(
        pspf_command(*args, "--state-dir", str(tmp_path / "state")),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert f"table {customers!r}" in errors[0] and "has 2 partitions" in errors[0] and "have 4" in errors[0]


def test_pspf_run_refuses_a_literal_undeclared_table_before_any_entry_with_exit_2(
    make_topic: Callable[[int], str], rclient: redis.Redis, redis_url: str, names: Any, tmp_path: Any
) -> None:
    orders, customers = make_topic(2), make_topic(2)
    xadd(rclient, orders, 2, "c1", {"n": 1})
    env = subprocess_env(PSPF_TEST_APP=names.app(), PSPF_TEST_TOPIC=orders, PSPF_TEST_TABLE=customers)
    args = ["run", "tests.integration.cli_apps:misspelled_table", "--broker", redis_url, "--until-idle"]
    done = subprocess.run(
        pspf_command(*args, "--state-dir", str(tmp_path / "state")),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert "looks up table 'custmers'" in errors[0] and "cli_apps.py:" in errors[0]
    assert not rclient.exists(dlq_key(orders, partition_for(b"c1", 2)))


def test_table_updates_move_no_stream_time_when_the_app_has_scheduled_callbacks(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Any,
) -> None:
    """With a callback registered, each entry's stream time was moved by table updates too: windows
    then closed early and dropped their later entries as late (found carrying state across a
    repartition)."""
    orders, customers, counts = make_topic(4), make_topic(4), make_topic(4)
    users = [f"u{i}" for i in range(12)]
    expected: Counter[tuple[str, int]] = Counter()
    for n in range(1, 400):
        user = users[n % 12]
        partition = partition_for(user.encode(), 4)
        if n % 7 == 0:
            fields = {b"key": user.encode(), b"value": msgspec.json.encode({"tier": f"t{n}"})}
            rclient.xadd(stream_key(customers, partition), fields, id=f"{n * 50 + 1}-0")  # type: ignore[arg-type]
        fields = {b"key": user.encode(), b"value": msgspec.json.encode({"ts": n * 50})}
        rclient.xadd(stream_key(orders, partition), fields, id=f"{n * 50 + 2}-0")  # type: ignore[arg-type]
        expected[(user, n * 50 // 1000 * 1000)] += 1
    app = App(names.app())
    app.table(customers)

    @app.handler(orders)
    def order(value: dict[str, int], ctx: Context) -> None:
        ctx.state["tier"] = ctx.table(customers)

    @app.window(orders, windows.tumbling(timedelta(seconds=1)), timestamp="ts", emit_to=counts)
    def per_second(total: int | None, value: dict[str, int]) -> int:
        return (total or 0) + 1

    @app.on_schedule("never")
    def never(payload: Any, ctx: Context) -> None:
        raise AssertionError("nothing schedules it")

    summary = Worker(app, make_settings(PSPF_BATCH_SIZE=25)).run(until_idle=True)
    assert summary.late == 0
    emitted = {
        (window["key"], window["start"]): window["value"]
        for partition in range(4)
        for _, fields in rclient.xrange(stream_key(counts, partition))
        for window in [msgspec.json.decode(fields[b"value"])]
    }
    # every window that closed (those before each partition's last second) counted all its orders
    assert len(emitted) >= len(expected) - len(users)
    assert all(expected[window] == count for window, count in emitted.items())
