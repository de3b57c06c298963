"""`pspf state adopt` after Redis lost everything, with stores of one app on two machines.

Host A applied 100 entries, host B took the partition over and applied 50 more: B's store is
the later one (150), A's is stale (100). The server is flushed and the topic created again with
10 new entries. Whatever the order of the adopts and runs on the two machines, the state must end
as B's store plus the new entries (160), or a step refuses in one line that says what to do; a
stale store must never replace the later one.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from pspf import Settings
from pspf.errors import PSPFError
from pspf.keys import backup_keys, lease_key, stream_key
from pspf.service import Service
from pspf.service.records import AdoptResult
from pspf.state_stores import stored_partitions
from tests.conftest import Names, RedisServer, pspf_command, subprocess_env
from tests.integration.failures_support import WorkerThread, read_state, summing_app
from tests.integration.test_backup_faults import acknowledged as _acknowledged
from tests.integration.test_backup_faults import run, send
from tests.support import wait_until

pytestmark = pytest.mark.integration

STEPS = ("adopt A", "adopt B", "run A", "run B")


def _total(settings: Settings, app: str, partitions: int) -> int:
    return sum(v["total"] for v in read_state(settings.state.dir, app, partitions).values())


def _backup_total(settings: Settings, app: str) -> int:
    """The sum of every key's total as the state backups in Redis hold it (``state get``)."""
    service = Service(settings)
    try:
        return sum(int(service.state_get(app, f"k{i}")["total"]) for i in range(10))
    finally:
        service.close()


def adopt(settings: Settings, app: str, replace: bool = False) -> AdoptResult:
    service = Service(settings)
    try:
        return service.state.state_adopt(app, replace=True) if replace else service.state.state_adopt(app)
    finally:
        service.close()


@pytest.mark.parametrize(
    "order", list(itertools.permutations(STEPS)), ids=lambda o: "-".join(s.replace(" ", "") for s in o)
)
def test_every_order_of_adopts_and_runs_ends_with_the_later_store(
    order: tuple[str, ...],
    own_server: RedisServer,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    names: Names,
) -> None:
    name, topic = names.app(), "ledger"
    hosts = {
        h: make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / h), PSPF_LEASE_TTL_MS=1000)
        for h in ("A", "B")
    }
    a, b = hosts["A"], hosts["B"]
    Service(a).create_topic(topic, 1)
    send(a, topic, 100)
    run(summing_app(name, topic), a)
    send(a, topic, 50, start=100)
    run(summing_app(name, topic), b)
    assert (_total(a, name, 1), _total(b, name, 1)) == (100, 150)

    own_server.client().flushall()
    Service(a).create_topic(topic, 1)
    send(a, topic, 10, start=150)

    refusals: list[str] = []
    for step in order:
        verb, host = step.split()
        try:
            if verb == "adopt":
                adopt(hosts[host], name)
            else:
                run(summing_app(name, topic), hosts[host])
        except PSPFError as exc:
            message = str(exc)
            assert "\n" not in message, f"{step}: not one line: {message}"
            assert "pspf state adopt" in message, f"{step}: says not what to do: {message}"
            refusals.append(f"{step}: {message}")
            if verb == "adopt" and "--replace" in message:  # the operator does what it says
                adopt(hosts[host], name, replace=True)
    for host in ("A", "B"):  # both machines run again: nothing may be refused now
        run(summing_app(name, topic), hosts[host])

    assert _backup_total(a, name) == 160, refusals
    assert (_total(a, name, 1), _total(b, name, 1)) == (160, 160), refusals


@pytest.mark.parametrize("first", ["A", "B"])
def test_two_machines_sharing_partitions_keep_each_partitions_later_store(
    first: str,
    own_server: RedisServer,
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    names: Names,
) -> None:
    """Host A applied 200 entries on 4 partitions, then A and B shared them for 200 more: each
    holds the later store of the partitions it owned last and a stale one (A) or none (B) of the
    others. After the loss, adopting on both (in either order) and running both must keep every
    partition's later store: 400 + 40 new, none lost."""
    name, topic = names.app(), "ledger"
    hosts = {
        h: make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / h), PSPF_LEASE_TTL_MS=1000)
        for h in ("A", "B")
    }
    Service(hosts["A"]).create_topic(topic, 4)
    send(hosts["A"], topic, 200)
    run(summing_app(name, topic), hosts["A"])
    client = own_server.client()
    leases = [lease_key(topic, p, name) for p in range(4)]
    with (
        WorkerThread(summing_app(name, topic), hosts["A"]) as one,
        WorkerThread(summing_app(name, topic), hosts["B"]) as two,
    ):
        wait_until(
            lambda: len({v.rpartition(b"|")[0] for v in client.mget(leases) if v}) == 2,
            30,
            "both hosts to hold partitions",
        )
        send(hosts["A"], topic, 200, start=200)
        wait_until(
            lambda: sum(_acknowledged(client, topic, name, p) for p in range(4)) == 400, 30, "all applied"
        )
        one.check()
        two.check()
    owned_by_b = stored_partitions("sqlite", hosts["B"].state.dir, name)
    assert owned_by_b, "B never owned a partition"

    client.flushall()
    Service(hosts["A"]).create_topic(topic, 4)
    send(hosts["A"], topic, 40, start=400)
    second = "B" if first == "A" else "A"
    for host in (first, second):
        adopt(hosts[host], name)
    for host in (first, second, first):
        run(summing_app(name, topic), hosts[host])

    assert _backup_total(hosts["A"], name) == 440
    assert _total(hosts["A"], name, 4) == 440


def test_the_cli_refuses_a_later_store_over_worked_on_state_in_one_line_until_told_to_replace(
    own_server: RedisServer, make_settings: Callable[..., Settings], tmp_path: Path, names: Names
) -> None:
    """A adopted its stale store and ran on it (10 new entries applied on top); adopting B's later
    store then refuses (exit 5, one line naming --replace) and changes nothing; with --replace
    it is the state, and the 10 entries are applied again on top of it: 160 on both machines."""
    name, topic = names.app(), "ledger"
    a, b = (
        make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / h), PSPF_LEASE_TTL_MS=1000)
        for h in ("A", "B")
    )
    Service(a).create_topic(topic, 1)
    send(a, topic, 100)
    run(summing_app(name, topic), a)
    send(a, topic, 50, start=100)
    run(summing_app(name, topic), b)
    own_server.client().flushall()
    Service(a).create_topic(topic, 1)
    send(a, topic, 10, start=150)
    adopt(a, name)
    run(summing_app(name, topic), a)
    assert _backup_total(a, name) == 110

    command = pspf_command(
        "state", "adopt", name, "--broker", own_server.url, "--state-dir", str(b.state.dir)
    )
    refused = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 5, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"pspf state adopt {name} --replace" in refused.stderr
    assert _backup_total(a, name) == 110, "the refused adopt changed the state"

    done = subprocess.run(
        [*command, "--replace"], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("partition 0: adopted"), done.stdout
    run(summing_app(name, topic), b)
    run(summing_app(name, topic), a)
    assert _backup_total(a, name) == 160
    assert (_total(a, name, 1), _total(b, name, 1)) == (160, 160)


def test_an_adopt_cut_short_after_its_upload_is_finished_by_the_next_one(
    own_server: RedisServer, make_settings: Callable[..., Settings], tmp_path: Path, names: Names
) -> None:
    """Adopt on A stopped after uploading A's store, before its record and the groups (played by
    deleting them): adopting on A again finishes it, so B's later store is still recognised as
    later and taken by its adopt: 160."""
    name, topic = names.app(), "ledger"
    a, b = (
        make_settings(PSPF_BROKER=own_server.url, PSPF_STATE_DIR=str(tmp_path / h), PSPF_LEASE_TTL_MS=1000)
        for h in ("A", "B")
    )
    Service(a).create_topic(topic, 1)
    send(a, topic, 100)
    run(summing_app(name, topic), a)
    send(a, topic, 50, start=100)
    run(summing_app(name, topic), b)
    client = own_server.client()
    client.flushall()
    Service(a).create_topic(topic, 1)
    send(a, topic, 10, start=150)
    adopt(a, name)
    client.hdel(backup_keys(topic, 0, name).meta, "adopted")
    client.xgroup_destroy(stream_key(topic, 0), name)

    again = adopt(a, name)
    assert list(again.adopted) == [0], again
    assert client.hget(backup_keys(topic, 0, name).meta, "adopted") is not None
    assert list(adopt(b, name).adopted) == [0], "B's later store was not taken"
    run(summing_app(name, topic), a)
    run(summing_app(name, topic), b)
    assert _backup_total(a, name) == 160
    assert (_total(a, name, 1), _total(b, name, 1)) == (160, 160)
