"""Views under SIGKILL: a view equals the state that produced it (DESIGN, invariant 13).

Real ``pspf run`` workers of ``tests.crash.apps_views`` (a hash view and a sorted set view of
each key's running total, the hash field deleted at every seventh entry of half the keys) on two
state dirs, killed at random moments and moved between the dirs: at the end the views read with
HGETALL and ZRANGE equal what ``pspf state export`` says the state is, and while they run a view
never shows a total the state backup does not hold yet. A kill between a batch's acknowledgement
and its views' write must not lose the write: the partition's next owner writes it again, from
the committed view rows of the store (the same dir) or of the backup (another dir).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from pspf import keys
from pspf.outbox.views import PartitionViews, ViewKind
from pspf.state_stores import open_store
from tests.conftest import Names, pspf_command, subprocess_env
from tests.crash.apps_views import DELETE_EVERY, deletes
from tests.crash.conftest import Spawner
from tests.crash.support import (
    WorkerProcess,
    assert_backup_exact,
    backup_applied,
    backup_hash,
    backup_state,
    expected_state,
    no_leases,
    order_records,
    read_store,
)
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

TARGET = "tests.crash.apps_views:main"
KEYS = 200
#: Leases expire a second after a killed worker's last renewal: the next owner waits no longer.
OPTIONS = ["--batch-size", "100", "--block-ms", "100", "--lease-ttl-ms", "1000"]

State = dict[str, dict[str, Any]]


class Views:
    """One test's app, topic and views, and workers of the app on "hosts" (a state dir each)."""

    def __init__(self, spawn: Spawner, names: Names, topic: str, rclient: redis.Redis) -> None:
        self.spawn, self.topic, self.rclient = spawn, topic, rclient
        self.app = names.app()
        unique = names.app()
        #: a view's name is any Redis key, colons included
        self.hash, self.zset = f"views:{unique}:totals", f"views:{unique}:board"

    def run(
        self, label: str, state_dir: Path, *args: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        return self.spawn(
            label,
            self.topic,
            self.app,
            "--broker",
            self.spawn.redis_url,
            "--state-dir",
            str(state_dir),
            *OPTIONS,
            *args,
            env={"PSPF_TEST_HASH": self.hash, "PSPF_TEST_ZSET": self.zset, **(env or {})},
            cli_settings=False,
            target=TARGET,
        )

    def hash_view(self) -> dict[str, str]:
        raw = cast(dict[bytes, bytes], self.rclient.hgetall(self.hash))
        return {f.decode(): v.decode() for f, v in raw.items()}

    def zset_view(self) -> dict[str, float]:
        raw = cast(list[tuple[bytes, float]], self.rclient.zrange(self.zset, 0, -1, withscores=True))
        return {m.decode(): s for m, s in raw}

    def exported(self, cwd: Path, *args: str) -> State:
        """Each key's state as ``pspf state export`` writes it (from the backups unless ``args`` say)."""
        run = subprocess.run(
            pspf_command("state", "export", self.app, "--broker", self.spawn.redis_url, *args),
            capture_output=True,
            timeout=60,
            cwd=cwd,
            env=subprocess_env(),
        )
        assert run.returncode == 0, run.stderr.decode(errors="replace")
        found: State = {}
        for line in run.stdout.splitlines():
            row = json.loads(line)
            if row["kind"] == "value" and row["namespace"] == keys.STATE_NAMESPACE:
                assert row["key"] not in found, f"key {row['key']} exported twice"
                found[row["key"]] = row["state"]
        return found


def want_hash(state: State) -> dict[str, str]:
    """The hash view of ``state``: each total as JSON text, absent while a picked key's count is a
    multiple of ``DELETE_EVERY``."""
    return {
        key: json.dumps(value["total"])
        for key, value in state.items()
        if not (deletes(key) and value["count"] % DELETE_EVERY == 0)
    }


def want_zset(state: State) -> dict[str, float]:
    return {key: float(value["total"]) for key, value in state.items()}


def differing(got: dict[str, Any], want: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Field -> (got, want) where the view differs from what the state says (None: absent)."""
    return {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys() if got.get(k) != want.get(k)}


def assert_views_equal_state(views: Views, state: State) -> None:
    for name, got, want in (
        (views.hash, views.hash_view(), want_hash(state)),
        (views.zset, views.zset_view(), want_zset(state)),
    ):
        wrong = differing(got, want)
        assert not wrong, (
            f"view {name} differs from the state for {len(wrong)} of {len(want)} fields "
            f"(got, want): {dict(sorted(wrong.items())[:5])}"
        )


def assert_views_not_ahead(views: Views, partitions: int) -> None:
    """No view shows a total the state backup does not hold yet (a write before its acknowledgement).

    The views are read first: totals only grow, so the backups read after hold at least as much.
    """
    hash_got, zset_got = views.hash_view(), views.zset_view()
    backed = {
        key: value["total"]
        for p in range(partitions)
        for key, value in backup_state(views.rclient, views.topic, views.app, p).items()
    }
    ahead: dict[str, tuple[Any, Any]] = {
        k: (s, backed.get(k)) for k, s in zset_got.items() if s > backed.get(k, 0)
    }
    ahead |= {k: (v, backed.get(k)) for k, v in hash_got.items() if int(v) > backed.get(k, 0)}
    assert not ahead, f"views ahead of the state backup (view, backup): {dict(sorted(ahead.items())[:5])}"


def records_state(records: list[tuple[str | None, Any]]) -> State:
    return {key: {"count": count, "total": total} for key, (count, total) in expected_state(records).items()}


# -- kill -9 at random moments, on two state dirs ---------------------------------------------------

PARTITIONS = 4
ENTRIES = 8_000
ROUNDS = 8
#: Busy work per entry, so that the entries of a round outlast the wait before its kill.
WORK_US = 400


def test_views_under_random_kill9_on_two_state_dirs_equal_the_exported_state(
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """Two workers, each on a state dir of its own, while the entries are produced round by round;
    each round SIGKILLs one of them (restarted on its dir) or both (restarted on each other's dir,
    so their partitions' state arrives through the backups). One worker then runs until idle.

    The state is exact, and the views equal it: a write lost at a kill between a commit and the
    views' write would leave a stale total, a lost delete a field that should be absent.
    """
    started = time.monotonic()
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    views = Views(spawn, names, make_topic(PARTITIONS), rclient)
    records = order_records(ENTRIES, KEYS, seed)
    dirs = [tmp_path / "host-a", tmp_path / "host-b"]
    env = {"PSPF_TEST_WORK_US": str(WORK_US)}
    on = [0, 1]  # the dir each worker runs on
    workers = [views.run(f"w{i}-start", dirs[i], env=env) for i in range(2)]

    chunk = ENTRIES // (ROUNDS + 1)
    produced, mid_stream, swaps = 0, 0, 0

    def applied() -> int:
        return backup_applied(rclient, views.topic, views.app, PARTITIONS)

    def kill_after(goal: int, victims: list[int], within: float) -> None:
        """Kill the victims once the backups hold ``goal`` entries, up to ``within`` seconds later."""
        wait_until(lambda: applied() >= goal, 60, f"{goal} entries in the backups", interval=0.01)
        time.sleep(rng.uniform(0.0, within))
        for i in victims:
            assert workers[i].alive(), f"worker exited by itself\n{workers[i].tail()}"
            assert workers[i].kill9() == -9
            assert "Traceback" not in workers[i].log.read_text(), workers[i].tail()

    for round_ in range(ROUNDS):
        produced += produce(views.topic, records[round_ * chunk : (round_ + 1) * chunk])
        swap = round_ % 3 == 2
        victims = [0, 1] if swap else [rng.randrange(2)]
        kill_after(produced - chunk // 2, victims, 0.1)
        mid_stream += applied() < produced
        assert_views_not_ahead(views, PARTITIONS)
        if swap:
            on.reverse()
            swaps += 1
        for i in victims:
            workers[i] = views.run(f"w{i}-{round_}", dirs[on[i]], env=env)
    produced += produce(views.topic, records[ROUNDS * chunk :])
    assert produced == ENTRIES
    # The last kill lands near the end: what it leaves unwritten, few entries (if any) write again.
    kill_after(ENTRIES - 300, [0, 1], 0.03)
    left = ENTRIES - applied()
    mid_stream += left > 0
    assert mid_stream > ROUNDS // 2, f"only {mid_stream} of {ROUNDS + 1} kills landed mid-stream"
    assert_views_not_ahead(views, PARTITIONS)

    # --until-idle stops early while a dead worker's lease lives: let the leases expire first.
    wait_until(lambda: no_leases(rclient, views.topic, views.app, PARTITIONS), 10, "the leases to expire")
    final_dir = dirs[rng.randrange(2)]
    final = views.run("final", final_dir, "--until-idle", env=env)
    assert final.wait(120) == 0, final.tail()
    assert final.summary()[2] == 0, final.tail()

    # The state, as `pspf state export` reads it from the backups and from the final dir's stores.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = views.exported(elsewhere)
    assert state == records_state(records), "the exported state is not every entry applied once"
    assert views.exported(elsewhere, "--state-dir", str(final_dir)) == state
    absent = sum(1 for key, v in state.items() if deletes(key) and v["count"] % DELETE_EVERY == 0)
    assert absent > 0, "no hash field is deleted at the end: the test does not exercise deletes"
    assert_views_equal_state(views, state)
    print(
        f"{ROUNDS} rounds ({swaps} swaps, {mid_stream} kills mid-stream, {left} entries left at the "
        f"last), {ENTRIES} entries, {absent} deleted fields: {time.monotonic() - started:.1f}s"
    )


# -- killed after the acknowledgement, before the views' write --------------------------------------


def _text(value: Any) -> Any:
    """A field or value as the views hold it: text (a row keeps bytes that are UTF-8 as text too,
    and a hash's int, which Redis keeps as its digits)."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value) if type(value) is int else value


def unwritten_rows(views: Views, state_dir: Path, partitions: int) -> dict[tuple[str, str], Any]:
    """(view, field) -> the latest value the stores' committed view rows hold for it; the rows of
    each store equal its backup's (what a new owner on another dir restores)."""
    kinds: dict[str, ViewKind] = {views.hash: "hash", views.zset: "zset"}
    head = f"{keys.VIEWS_NAMESPACE}\x00".encode()
    found: dict[tuple[str, str], Any] = {}
    for p in range(partitions):
        with open_store("sqlite", state_dir, views.app, p, readonly=True) as store:
            rows = dict(store.items(keys.VIEWS_NAMESPACE))
        backup = backup_hash(views.rclient, views.topic, p, views.app)
        backed = {name[len(head) :].decode(): raw for name, raw in backup.items() if name.startswith(head)}
        assert backed == rows, f"partition {p}: the backup's view rows differ from the store's"
        for view, fields in PartitionViews.load(kinds, rows.items()).take()[1].items():
            for field, value in fields.items():
                found[(view, _text(field))] = _text(value)
    return found


@pytest.mark.parametrize("host", ["same dir", "other dir"])
def test_views_acknowledged_but_not_written_before_a_kill_are_written_by_the_next_owner(
    host: str,
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    rclient: redis.Redis,
) -> None:
    """The worker kills itself in ``on_ack`` of the acknowledgement of its last entries: every batch
    is committed and acknowledged, the last ones' view writes are not in Redis. They are in the
    committed view rows (store and backup), and the next owner, on the same dir or another one,
    writes them when it takes the partitions on, with no entry left to handle."""
    partitions, entries = 2, 3_000
    views = Views(spawn, names, make_topic(partitions), rclient)
    records = order_records(entries, KEYS, seed=97)
    produce(views.topic, records)
    marker = tmp_path / "killed.json"
    host_a = tmp_path / "host-a"
    a = views.run("a", host_a, env={"PSPF_TEST_KILL_AT": str(entries), "PSPF_TEST_MARKER": str(marker)})
    assert a.wait(60) == -9, f"the crash point was not reached\n{a.tail()}"
    last_keys = set(json.loads(marker.read_text())["keys"])
    assert last_keys, "the last acknowledgement carried no handled keys"

    # Every entry is committed and acknowledged: the store and the backup hold the whole state.
    state: State = {}
    for p in range(partitions):
        state |= read_store(host_a, views.app, p)[1]
    want = records_state(records)
    assert state == want
    assert_backup_exact(rclient, views.topic, views.app, partitions, records)

    # The views lack the last acknowledgement's writes (a sorted set's score moves with every
    # entry), and maybe those of the one before (its writes were to go out in the publish step
    # after it). Every stale field's value waits in the committed view rows, store and backup.
    stale_zset = differing(views.zset_view(), want_zset(want))
    stale_hash = differing(views.hash_view(), want_hash(want))
    assert last_keys <= set(stale_zset), f"written before the kill: {sorted(last_keys - set(stale_zset))[:5]}"
    rows = unwritten_rows(views, host_a, partitions)
    for name, stale, wanted in (
        (views.zset, stale_zset, want_zset(want)),
        (views.hash, stale_hash, want_hash(want)),
    ):
        waiting = {key for key in stale if (name, key) in rows and rows[(name, key)] == wanted.get(key)}
        assert waiting == set(stale), (
            f"view {name}: stale fields whose value no committed row holds (got, want): "
            f"{dict(sorted((k, stale[k]) for k in set(stale) - waiting)[:5])}"
        )
    print(f"killed with {len(stale_zset)} of {len(want)} keys stale ({len(last_keys)} in the last ack)")

    # The next owner writes them on taking the partitions on; it has nothing to handle.
    wait_until(lambda: no_leases(rclient, views.topic, views.app, partitions), 10, "the leases to expire")
    next_dir = host_a if host == "same dir" else tmp_path / "host-b"
    b = views.run("b", next_dir, "--until-idle")
    assert b.wait(60) == 0, b.tail()
    assert b.summary() == (0, 0, 0), b.tail()
    restored = b.log.read_text().count("state backup restored")
    assert restored == (0 if host == "same dir" else partitions), b.tail()
    assert_views_equal_state(views, want)
