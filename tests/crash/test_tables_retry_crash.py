"""SIGKILL workers of an app whose orders look rows up in a table while some orders fail and are
retried (ordered) or parked (deferred): every order that succeeds sees the row current at its
entry, once, across kills and state dirs; a replay from the start sees the same rows."""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from pspf.keys import StreamId, partition_for, stream_key
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.conftest import Spawner
from tests.crash.support import backup_state, held_by, no_leases
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

PARTITIONS = 2
ORDERS = 1500
UPDATES = 500
USERS = 12
KILLS = 2
LEASE_TTL_MS = 1000
WORK_US = 400
TARGET = "tests.crash.apps_tables:retrying"


@pytest.mark.parametrize("mode", ["ordered", "deferred"])
def test_sigkills_and_a_replay_keep_every_lookup_at_its_entry_while_orders_fail(
    mode: str,
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    names: Names,
    rclient: redis.Redis,
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    orders, customers, app = make_topic(PARTITIONS), make_topic(PARTITIONS), names.app()
    kinds = ["order"] * ORDERS + ["update"] * UPDATES
    rng.shuffle(kinds)
    sent: list[tuple[str, str, Any, StreamId]] = []
    pipe = rclient.pipeline(transaction=False)
    pending: list[tuple[str, str, Any]] = []
    for n, kind in enumerate(kinds):
        user = f"c{rng.randrange(USERS)}"
        if kind == "order":
            value: Any = {"n": n}
            if rng.random() < 0.03:
                value["fail"] = rng.choice([1, 2, 99])  # 99: dead-lettered after its 3 attempts
            topic = orders
        else:
            value = None if rng.random() < 0.2 else {"tier": rng.choice(["gold", "silver", "bronze"])}
            topic = customers
        stream = stream_key(topic, partition_for(user.encode(), PARTITIONS))
        pipe.xadd(stream, {b"key": user.encode(), b"value": msgspec.json.encode(value)})
        pending.append((kind, user, value))
        if len(pipe) >= 200 or n == len(kinds) - 1:
            ids = pipe.execute()
            sent += [(k, u, v, StreamId.parse(i)) for (k, u, v), i in zip(pending, ids, strict=True)]
            pending = []
    expected = _expected(sent)
    assert any(v.get("fail") == 99 for k, _, v, _ in sent if k == "order")

    env = {
        "PSPF_TEST_CUSTOMERS": customers,
        "PSPF_TEST_COUNTER_URL": spawn.redis_url,
        "PSPF_TEST_RETRY_MODE": mode,
        "PSPF_TEST_WORK_US": str(WORK_US),
    }
    options = ["--batch-size", "20", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
    options += ["--broker", spawn.redis_url]
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]

    def applied() -> int:
        return sum(
            len(v["seen"]) for p in range(PARTITIONS) for v in backup_state(rclient, orders, app, p).values()
        )

    for life in range(KILLS):
        worker = spawn(
            f"life{life}",
            orders,
            app,
            *options,
            "--state-dir",
            str(dirs[life % 2]),
            env=env,
            cli_settings=False,
            target=TARGET,
        )
        wait_until(
            lambda w=worker: held_by(rclient, orders, app, PARTITIONS, w.pid) or not w.alive(),
            timeout=LEASE_TTL_MS / 1000 + 15,
            what="the worker to take every partition",
        )
        time.sleep(rng.uniform(0.3, 0.9))
        assert worker.alive(), f"worker exited by itself\n{worker.tail()}"
        assert worker.kill9() == -9
    assert 0 < applied() < ORDERS, "the kills should land mid-stream"
    wait_until(lambda: no_leases(rclient, orders, app, PARTITIONS), 10, "the dead worker's leases to expire")

    def run_to_the_end(label: str, state_dir: Path) -> None:
        final = spawn(
            label,
            orders,
            app,
            *options,
            "--state-dir",
            str(state_dir),
            "--until-idle",
            env=env,
            cli_settings=False,
            target=TARGET,
        )
        assert final.wait(timeout=180) == 0, final.tail()

    run_to_the_end("final", dirs[2])
    assert _seen(rclient, orders, app, mode) == expected

    # A replay from the first entry of both topics: the same lookups, whatever failed when.
    replay = subprocess.run(
        pspf_command(
            "replay", app, "--topic", orders, "--topic", customers, "--from-start", "--yes",
            "--broker", spawn.redis_url, "--state-dir", str(dirs[2]),
        ),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    run_to_the_end("replayed", dirs[2])
    assert _seen(rclient, orders, app, mode) == expected


def _expected(sent: list[tuple[str, str, Any, StreamId]]) -> dict[str, list[list[Any]]]:
    """Per customer, [n, tier] of each order that succeeds, with the row current at its id."""
    current: dict[str, str | None] = {}
    seen: dict[str, list[list[Any]]] = {}
    for kind, user, value, _ in sorted(sent, key=lambda e: (e[3], e[0] != "update")):
        if kind == "update":
            current[user] = None if value is None else value["tier"]
        elif value.get("fail", 0) < 3:
            seen.setdefault(user, []).append([value["n"], current.get(user)])
    return seen


def _seen(rclient: redis.Redis, topic: str, app: str, mode: str) -> dict[str, list[list[Any]]]:
    """What each customer's orders saw, by the state backup; in deferred mode in n order (a parked
    order is applied when due, after later ones)."""
    seen = {
        user: state["seen"]
        for partition in range(PARTITIONS)
        for user, state in backup_state(rclient, topic, app, partition).items()
    }
    if mode == "deferred":
        seen = {user: sorted(rows) for user, rows in seen.items()}
    return seen
