"""A state backup spread over several hashes (``state.backup_buckets``): compact, exact, and loud
when one of its hashes is lost.

Hosts are state dirs of their own; workers run in this process with ``until_idle``. A key's
``total`` counts the entries of that key applied.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pspf import App, Context, Producer, Settings, Worker
from pspf.errors import BrokerError, StateError
from pspf.keys import BACKUP_BUCKETS, BACKUP_LAYOUT_MARK, BACKUP_MARK, backup_keys, bucket_keys
from pspf.service import Service
from tests.conftest import Names
from tests.integration.failures_support import read_state

pytestmark = pytest.mark.integration

KEYS = 200


def host(make_settings: Callable[..., Settings], tmp_path: Path, name: str, buckets: int) -> Settings:
    return make_settings(
        PSPF_STATE_DIR=str(tmp_path / name), PSPF_LEASE_TTL_MS=1000, PSPF_STATE_BACKUP_BUCKETS=str(buckets)
    )


def send(settings: Settings, topic: str, n: int, start: int = 0) -> None:
    with Producer(settings=settings) as producer:
        for i in range(start, start + n):
            producer.send(topic, {"n": 1, "bad": i % 97 == 0}, key=f"k{i % KEYS}")


def counting_app(name: str, topic: str) -> App:
    """Adds each entry to its key's total; an entry marked bad fails, so it is dead-lettered (its
    batch is acknowledged by the script, not the transaction)."""
    app = App(name)

    @app.handler(topic)
    def add(value: dict[str, Any], ctx: Context) -> None:
        if value["bad"]:
            raise ValueError("a bad entry")
        ctx.state["total"] = ctx.state.get("total", 0) + value["n"]

    return app


def run(name: str, topic: str, settings: Settings) -> None:
    Worker(counting_app(name, topic), settings).run(until_idle=True)


def expected(n: int) -> dict[str, int]:
    totals: dict[str, int] = {}
    for i in range(n):
        if i % 97:
            totals[f"k{i % KEYS}"] = totals.get(f"k{i % KEYS}", 0) + 1
    return totals


def totals(settings: Settings, name: str) -> dict[str, int]:
    return {key: value["total"] for key, value in read_state(settings.state.dir, name, 1).items()}


def backup_fields(client: redis.Redis, topic: str, name: str, buckets: int) -> dict[str, set[bytes]]:
    """Each bucket's fields, by key, as Redis holds them."""
    values = backup_keys(topic, 0, name).values
    return {key: set(client.hkeys(key)) for key in bucket_keys(values, buckets)}


def test_a_backup_in_buckets_holds_every_value_compactly_and_follows_the_partition(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """Four buckets: every key's state is in the bucket its name hashes to and the bookkeeping
    in the first, the others are kept as compact listpacks, the export and a key's lookup read
    them, a new host restores every total, and deleting the app deletes every bucket."""
    topic, name = make_topic(1), names.app()
    a, b = host(make_settings, tmp_path, "a", 4), host(make_settings, tmp_path, "b", 4)
    send(a, topic, 600)
    run(name, topic, a)
    assert totals(a, name) == expected(600)
    backup = backup_keys(topic, 0, name)
    assert rclient.hget(backup.meta, BACKUP_BUCKETS) == b"4"
    found = backup_fields(rclient, topic, name, 4)
    assert all(len(fields) > 20 for fields in found.values()), {k: len(v) for k, v in found.items()}
    for at, (key, fields) in enumerate(found.items()):
        own = {BACKUP_MARK} if at == 0 else {BACKUP_LAYOUT_MARK}
        assert own <= fields
        for f in fields - own:  # a key's state where its name hashes; bookkeeping in the first
            assert (zlib.crc32(f) % 4 if f.startswith(b"state\x00") else 0) == at, f
        if at > 0:  # the first holds the failures' records: larger than a compact hash keeps
            assert rclient.object("encoding", key) in (b"listpack", b"ziplist")

    lines = [json.loads(line) for line in Service(a).state.state_export(name)]
    exported = {line["key"]: line["state"]["total"] for line in lines if line.get("namespace") == "state"}
    assert exported == expected(600)

    assert Service(a).state_get(name, "k7") == {"total": expected(600)["k7"]}

    send(a, topic, 300, start=600)
    run(name, topic, b)  # a new host: restores the whole backup, then applies 300 more
    assert totals(b, name) == expected(900)

    Service(a).retire.delete_app(name, force=True)  # pspf app delete: every bucket goes
    assert rclient.exists(*bucket_keys(backup.values, 4), backup.meta) == 0


def test_changing_the_bucket_count_lays_the_backup_out_anew_and_leaves_no_stale_bucket(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """One hash, then eight buckets, then three: each change re-uploads the store once at the
    owner's takeover; the buckets of the layout before are gone, and another host restores it."""
    topic, name = make_topic(1), names.app()
    values = backup_keys(topic, 0, name).values
    send(host(make_settings, tmp_path, "a", 1), topic, 400)
    run(name, topic, host(make_settings, tmp_path, "a", 1))
    assert rclient.exists(f"{values}:1") == 0

    run(name, topic, host(make_settings, tmp_path, "a", 8))
    assert rclient.hget(backup_keys(topic, 0, name).meta, BACKUP_BUCKETS) == b"8"
    assert rclient.exists(*bucket_keys(values, 8)) == 8
    moved = backup_fields(rclient, topic, name, 8)
    assert sum(f.startswith(b"state\x00") for fields in moved.values() for f in fields) == KEYS

    send(host(make_settings, tmp_path, "a", 3), topic, 100, start=400)
    run(name, topic, host(make_settings, tmp_path, "a", 3))
    assert rclient.hget(backup_keys(topic, 0, name).meta, BACKUP_BUCKETS) == b"3"
    assert rclient.exists(*bucket_keys(values, 8)[3:]) == 0, "a bucket of the old layout stayed"

    fresh = host(make_settings, tmp_path, "b", 3)
    run(name, topic, fresh)
    assert totals(fresh, name) == expected(500)


def test_a_bucket_lost_alone_is_refused_by_a_new_host_and_uploaded_again_by_the_owner(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    names: Names,
) -> None:
    """One of four buckets deleted (evicted) while nobody runs, then written anew by a batch: a
    host without a current store refuses loudly rather than restore three quarters of the state;
    the owner, whose store is current, uploads it again; then the new host restores it all. An
    export meanwhile refuses too."""
    topic, name = make_topic(1), names.app()
    a, b = host(make_settings, tmp_path, "a", 4), host(make_settings, tmp_path, "b", 4)
    send(a, topic, 400)
    run(name, topic, a)
    lost = bucket_keys(backup_keys(topic, 0, name).values, 4)[2]
    rclient.delete(lost)
    rclient.hset(lost, b"state\x00k-new", b"\x80")  # a write after the loss: the bucket exists again

    with pytest.raises(BrokerError, match="lacks its layout's mark"):
        list(Service(a).state.state_export(name))
    with pytest.raises(StateError, match="damaged"):
        run(name, topic, b)
    send(a, topic, 100, start=400)
    run(name, topic, a)
    assert totals(a, name) == expected(500)
    assert rclient.hget(lost, BACKUP_LAYOUT_MARK) is not None
    assert rclient.hget(lost, b"state\x00k-new") is None

    run(name, topic, b)
    assert totals(b, name) == expected(500)
