"""The restore's read of a state backup: the broker's HSCAN pages and ``backup.restore`` in a real server.

``Acknowledging.backup_values`` asks for the next page before it hands one over, so a scan holds a
connection with a reply on its way: a scan closed early (a restore told to stop) or failed must
never give that connection to the next command, or that command would read the scan's reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis

from pspf import Settings, keys
from pspf.broker import Broker, acknowledging
from pspf.errors import BrokerError
from pspf.keys import BACKUP_IDENTITY, BACKUP_MARK, BACKUP_NAMESPACE, STATE_NAMESPACE, StreamId
from pspf.partition.backup import field, restore
from pspf.state_stores import MemoryStore, open_store
from tests.conftest import Names, standalone_only

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    b = Broker(Settings.load({"PSPF_BROKER": redis_url}, environ={}).redis)
    yield b
    b.close()


def _backup(rclient: redis.Redis, names: Names, values: int) -> keys.BackupKeys:
    """A backup as the acknowledging calls leave it: values, the mark, an identity, a checkpoint."""
    topic = names.topic()
    backup = keys.backup_keys(topic, 0, names.app())
    mapping: dict[bytes, bytes] = {field(STATE_NAMESPACE, f"k{i:05}"): b"%d" % i for i in range(values)}
    mapping[BACKUP_MARK] = b"4-2"
    rclient.hset(backup.values, mapping=mapping)  # type: ignore[arg-type]
    rclient.hset(backup.meta, mapping={BACKUP_IDENTITY: "4-2", f"cp:{topic}": "9-0"})
    return backup


def test_backup_values_gives_every_value_in_pages_and_skips_the_mark(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    backup = _backup(rclient, names, 2_500)
    pages = list(broker.acks.backup_values(backup, 500))
    assert len(pages) > 2
    seen = [pair for page in pages for pair in page]
    assert dict(seen) == {field(STATE_NAMESPACE, f"k{i:05}"): b"%d" % i for i in range(2_500)}
    assert len(seen) == 2_500
    matched = [
        pair for page in broker.acks.backup_values(backup, 100, match=b"state\x00k0001*") for pair in page
    ]
    assert sorted(matched) == [(field(STATE_NAMESPACE, f"k{i:05}"), b"%d" % i) for i in range(10, 20)]


@standalone_only
def test_a_scan_closed_early_leaves_no_reply_for_the_next_command(
    broker: Broker, rclient: redis.Redis, names: Names, monkeypatch: pytest.MonkeyPatch
) -> None:
    backup = _backup(rclient, names, 3_000)

    class Pausing:
        """hiredis, but the server pauses before the scan asks for its second page: the reply
        is not back yet when the scan is closed (else redis-py would notice it and reconnect)."""

        @staticmethod
        def pack_command(command: tuple[Any, ...]) -> bytes:
            if command[0] == b"HSCAN" and command[2] != b"0":
                rclient.client_pause(300)
            return bytes(hiredis.pack_command(command))

    monkeypatch.setattr(acknowledging, "hiredis", Pausing)
    scan = broker.acks.backup_values(backup, 500)
    assert len(next(scan)) > 0  # the next page is asked for already
    scan.close()
    # The pool hands out its last connection first: the scan's, were it given back as it was.
    assert broker.acks.backup_value(backup, field(STATE_NAMESPACE, "k00007")) == b"7"
    assert broker.acks.backup_meta(backup.meta)[BACKUP_IDENTITY] == "4-2"
    monkeypatch.undo()
    assert sum(len(page) for page in broker.acks.backup_values(backup, 500)) == 3_000


def test_a_scan_of_a_key_of_the_wrong_type_fails_clearly_and_the_broker_goes_on(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    backup = _backup(rclient, names, 10)
    wrong = keys.backup_keys(names.topic(), 0, names.app())
    rclient.set(wrong.values, b"a string")
    with pytest.raises(BrokerError, match="WRONGTYPE"):
        list(broker.acks.backup_values(wrong))
    assert broker.acks.backup_value(backup, field(STATE_NAMESPACE, "k00003")) == b"3"


def test_a_restore_told_to_stop_leaves_no_identity_and_the_next_one_restores_whole(
    broker: Broker, rclient: redis.Redis, names: Names
) -> None:
    """A standby's restore stops when its partition is no longer wanted: the store must not look
    restored; ``go_on`` runs between pages while the scan's next page is on its way."""
    backup = _backup(rclient, names, 12_000)
    topic = next(name[3:] for name in broker.acks.backup_meta(backup.meta) if name.startswith("cp:"))
    store = MemoryStore()
    calls = 0

    def go_on() -> bool:
        nonlocal calls
        calls += 1
        # Other commands meanwhile (a lease renewal does one): each gets its own reply.
        assert broker.acks.backup_meta(backup.meta)[BACKUP_IDENTITY] == "4-2"
        return calls < 2

    assert restore(broker.acks, backup, store, [topic], go_on) is None
    assert calls == 2
    assert store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY) is None
    assert 0 < len(list(store.items(STATE_NAMESPACE))) < 12_000
    assert broker.acks.backup_value(backup, field(STATE_NAMESPACE, "k00001")) == b"1"

    restored = restore(broker.acks, backup, store, [topic])
    assert restored is not None and restored[0] == 12_000
    assert store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY) == b"4-2"
    assert dict(store.items(STATE_NAMESPACE)) == {f"k{i:05}": b"%d" % i for i in range(12_000)}
    assert store.checkpoints() == {topic: StreamId(9, 0)}


@pytest.mark.parametrize("engine", ["sqlite", "rocksdb"])
def test_a_restore_into_an_empty_state_dir_copies_the_whole_backup(
    engine: str, broker: Broker, rclient: redis.Redis, names: Names, tmp_path: Path
) -> None:
    backup = _backup(rclient, names, 7_001)
    rclient.hset(backup.values, field(keys.OUTBOX_NAMESPACE, f"{3:020}"), b"R" * 20_000)
    topic = next(name[3:] for name in broker.acks.backup_meta(backup.meta) if name.startswith("cp:"))
    with open_store(engine, tmp_path, "g", 0) as store:
        restored = restore(broker.acks, backup, store, [topic])
        assert restored is not None and restored[0] == 7_002
        assert store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY) == b"4-2"
        assert len(list(store.items(STATE_NAMESPACE))) == 7_001
        assert store.get(STATE_NAMESPACE, "k07000") == b"7000"
        assert list(store.items(keys.OUTBOX_NAMESPACE)) == [(f"{3:020}", b"R" * 20_000)]
