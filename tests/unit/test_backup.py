"""``PartitionBackup`` on the memory store and a fake broker: its bookkeeping and its reconcile.

What the backup owns (``pspf.partition.backup``): every committed transaction goes to the backup with the
next call, under the identity the store stamped it with; a call that may not have run sends its
writes again, and the backup may then hold either identity; at takeover the store is compared
with the backup: the same identity is "in sync", one the log leads from "caught up", any other
"restored" from the whole backup; no backup is "missing", a values hash gone while the meta
stays "damaged" (refused unless this store is current); an upload makes the whole store the
backup under a new identity.

The broker is ``FakeBroker`` below: one server's leases and backup keys in dictionaries, with
only the methods ``PartitionBackup`` calls, and ``ack`` doing what ``lua/ack.lua`` does to the
lease and the backup (acknowledged ids are only counted).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import msgspec
import pytest

from pspf import keys
from pspf.broker import Acknowledging, AckRequest, BackupUpdate, Fields, log_data
from pspf.errors import BackupDamaged, BackupWentBack, LeaseLost, StateError
from pspf.keys import BACKUP_IDENTITY, BACKUP_MARK, BACKUP_NAMESPACE, STATE_NAMESPACE, StreamId
from pspf.partition import backup as backup_module
from pspf.partition.backup import PartitionBackup, _current
from pspf.state_stores import MemoryStore

GROUP, TOPIC = "app", "orders"
LEASE_KEY = keys.lease_key(TOPIC, 0, GROUP)


# -- the fake broker ----------------------------------------------------------------------------


class FakeBroker:
    """Leases and state backups in dictionaries: the ``Acknowledging`` calls ``PartitionBackup`` makes."""

    def __init__(self) -> None:
        self.leases: dict[str, str] = {}
        self.hashes: dict[str, dict[bytes, bytes]] = {}
        self.metas: dict[str, dict[str, str]] = {}
        self.logs: dict[str, list[tuple[bytes, Fields]]] = {}
        self.log_ids = itertools.count(1)
        #: every request ``ack`` was given, in order
        self.requests: list[AckRequest] = []

    def backup_meta(self, meta_key: str) -> dict[str, str]:
        return dict(self.metas.get(meta_key, {}))

    def set_backup_field(self, meta_key: str, name: str, value: str) -> None:
        self.metas.setdefault(meta_key, {})[name] = value

    def backup_head(self, backup: keys.BackupKeys) -> tuple[dict[str, str], bytes | None]:
        log = self.logs.get(backup.log, [])
        return self.backup_meta(backup.meta), (log[-1][0] if log else None)

    def backup_log(self, log_key: str, after: bytes, count: int) -> list[tuple[bytes, Fields]]:
        start = StreamId.parse(after)
        return [e for e in self.logs.get(log_key, []) if StreamId.parse(e[0]) > start][:count]

    def backup_log_before(self, log_key: str, before: bytes | None, count: int) -> list[tuple[bytes, Fields]]:
        newest_first = list(reversed(self.logs.get(log_key, [])))
        if before is not None:
            top = StreamId.parse(before)
            newest_first = [e for e in newest_first if StreamId.parse(e[0]) < top]
        return newest_first[:count]

    def backup_layout(self, backup: keys.BackupKeys) -> tuple[list[str], str]:
        return [backup.values], ""  # one bucket: the layouts are the broker's (integration tests)

    def lost_buckets(self, backup: keys.BackupKeys) -> list[str]:
        return []

    def backup_values(
        self, backup: keys.BackupKeys, count: int = 10_000, match: bytes | None = None
    ) -> Iterator[list[tuple[bytes, bytes]]]:
        rows = [(f, v) for f, v in self.hashes.get(backup.values, {}).items() if f != BACKUP_MARK]
        for start in range(0, len(rows), count):
            yield rows[start : start + count]

    def backup_value(self, backup: keys.BackupKeys, field: bytes) -> bytes | None:
        return self.hashes.get(backup.values, {}).get(field)

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        self.requests += requests
        return [self._ack(r) for r in requests]

    def _ack(self, r: AckRequest) -> tuple[int, int] | LeaseLost:
        if self.leases.get(r.lease_key) != r.lease_value:
            return LeaseLost(f"LEASE_LOST lease on {r.stream} is not held by this worker")
        b = r.backup
        if b is not None:
            meta = self.metas.setdefault(b.keys.meta, {})
            held = meta.get(BACKUP_IDENTITY, "")
            if b.mode == "update":
                if b.follows and held not in b.follows:
                    return BackupWentBack(f"BACKUP_WENT_BACK the state backup is at {held!r}")
                if meta.get(keys.BACKUP_MARKED) and self.backup_value(b.keys, BACKUP_MARK) != (held.encode()):
                    return BackupDamaged("BACKUP_DAMAGED the state backup has lost its values")
            self._apply(b, held)
        return (len(r.ids), len(r.dead))

    def _apply(self, b: BackupUpdate, held: str) -> None:
        if b.mode == "replace":
            for key in b.keys:
                self.hashes.pop(key, None)
                self.metas.pop(key, None)
                self.logs.pop(key, None)
        meta = self.metas.setdefault(b.keys.meta, {})
        values = self.hashes.setdefault(b.keys.values, {})
        meta.update({f"cp:{topic}": checkpoint for topic, checkpoint in b.checkpoints.items()})
        values.update(zip(b.sets[::2], b.sets[1::2], strict=True))
        for name in b.deletes:
            values.pop(name, None)
        if b.identity:
            meta.update({BACKUP_IDENTITY: b.identity, keys.BACKUP_MARKED: "1"})
            values[BACKUP_MARK] = b.identity.encode()
        if b.mode == "update":
            entry = {b"prev": held.encode(), b"id": (b.identity or held).encode(), b"data": log_data(b)}
            self.logs.setdefault(b.keys.log, []).append((f"{next(self.log_ids)}-0".encode(), entry))


# -- owners and their stores --------------------------------------------------------------------


def owner(broker: FakeBroker, token: int, partitions: int | None = 1) -> PartitionBackup:
    """The backup of partition 0 as the owner holding the lease with fencing token ``token``."""
    lease_value = f"worker-{token}|{token}"
    broker.leases[LEASE_KEY] = lease_value
    # The fake answers every method PartitionBackup calls; it is no Acknowledging otherwise.
    return PartitionBackup(cast(Acknowledging, broker), GROUP, TOPIC, 0, LEASE_KEY, lease_value, partitions)


def take_over(broker: FakeBroker, store: MemoryStore, token: int) -> tuple[PartitionBackup, str]:
    """What ``ownership`` does at takeover: reconcile, upload where missing, journal from then on."""
    backup = owner(broker, token)
    done = backup.reconcile(store, [TOPIC])
    if done.action in ("missing", "damaged"):
        backup.upload(store)
    store.journal = backup.journal
    return backup, done.action


def commit(store: MemoryStore, values: dict[str, int | None], checkpoint: str | None = None) -> None:
    """One batch's transaction: state values (None deletes) and the checkpoint of TOPIC."""
    with store.transaction() as tx:
        for key, value in values.items():
            if value is None:
                tx.delete(STATE_NAMESPACE, key)
            else:
                tx.set(STATE_NAMESPACE, key, msgspec.msgpack.encode(value))
        if checkpoint is not None:
            tx.set_checkpoint(TOPIC, StreamId.parse(checkpoint))


def batch(
    store: MemoryStore, backup: PartitionBackup, values: dict[str, int | None], checkpoint: str
) -> None:
    """A batch as the processor runs it: commit, then one acknowledging call with the update."""
    commit(store, values, checkpoint)
    (reply,) = backup.acks.ack([backup.request([checkpoint.encode()])])
    assert reply == (1, 0)
    backup.sent()


def state_field(key: str) -> bytes:
    """The backup field of a state key: ``namespace NUL key``."""
    return f"{STATE_NAMESPACE}\x00{key}".encode()


def identity(store: MemoryStore) -> str:
    found = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
    return "" if found is None else found.decode()


def state(store: MemoryStore) -> dict[str, int]:
    return {k: msgspec.msgpack.decode(v) for k, v in store.items(STATE_NAMESPACE)}


def backup_state(broker: FakeBroker) -> dict[str, int]:
    prefix = STATE_NAMESPACE.encode() + b"\x00"
    values = broker.hashes.get(keys.backup_keys(TOPIC, 0, GROUP).values, {})
    return {
        f[len(prefix) :].decode(): msgspec.msgpack.decode(v)
        for f, v in values.items()
        if f.startswith(prefix)
    }


def backup_identity(broker: FakeBroker) -> str:
    return broker.metas.get(keys.backup_keys(TOPIC, 0, GROUP).meta, {}).get(BACKUP_IDENTITY, "")


def backup_checkpoint(broker: FakeBroker) -> str | None:
    return broker.metas.get(keys.backup_keys(TOPIC, 0, GROUP).meta, {}).get(f"cp:{TOPIC}")


def history(broker: FakeBroker, batches: int, token: int = 1) -> MemoryStore:
    """A first owner's store after ``batches`` batches, each setting k{n} = n; the backup follows."""
    store = MemoryStore()
    backup, action = take_over(broker, store, token)
    assert action == "missing"
    for n in range(1, batches + 1):
        batch(store, backup, {f"k{n}": n}, f"{n}-0")
    return store


def copy_of(store: MemoryStore) -> MemoryStore:
    """Another machine's store holding what ``store`` holds now."""
    checkpoints, rows = store.dump()
    found = MemoryStore()
    found.rewind(set(), dict(checkpoints), {(ns, key): value for ns, key, value in rows})
    return found


# -- per batch: request, sent, not_sent, flush ----------------------------------------------------


def test_a_request_carries_the_journaled_writes_under_the_identity_the_store_stamped() -> None:
    broker = FakeBroker()
    store = history(broker, 0)
    backup = owner(broker, 1)  # the same lease as the takeover's
    store.journal = backup.journal
    commit(store, {"a": 1, "b": 2}, "7-0")
    commit(store, {"b": None}, "8-0")

    request = backup.request([b"7-0", b"8-0"], "dlq", [(b"6-0", {b"error": b"x"})])

    assert (request.stream, request.group) == (keys.stream_key(TOPIC, 0), GROUP)
    assert (request.lease_key, request.lease_value) == (LEASE_KEY, "worker-1|1")
    assert request.ids == [b"7-0", b"8-0"] and request.dlq == "dlq"
    assert request.dead == [(b"6-0", {b"error": b"x"})]
    update = request.backup
    assert update is not None and update.mode == "update"
    assert update.identity == identity(store) == "1-2"  # the last transaction's
    assert update.checkpoints == {TOPIC: "8-0"}
    assert dict(zip(update.sets[::2], update.sets[1::2], strict=True)) == {
        state_field("a"): msgspec.msgpack.encode(1)
    }
    assert list(update.deletes) == [state_field("b")]
    # The identity goes as the update's identity, never as a value of its own.
    assert not any(
        name.startswith(BACKUP_NAMESPACE.encode()) for name in [*update.sets[::2], *update.deletes]
    )
    assert not backup.journal  # taken


def test_a_request_with_nothing_journaled_carries_no_update() -> None:
    broker = FakeBroker()
    store = history(broker, 0)
    backup = owner(broker, 1)
    store.journal = backup.journal

    assert backup.update() is None
    assert backup.request([b"1-0"]).backup is None


def test_each_update_follows_the_identity_the_last_call_that_ran_set() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    first = backup_identity(broker)
    assert backup.held == {first}

    commit(store, {"a": 1}, "1-0")
    update = backup.update()
    assert update is not None and set(update.follows) == {first}
    backup.sent()
    assert backup.held == {"1-2"}

    commit(store, {"a": 2}, "2-0")
    update = backup.update()
    assert update is not None and set(update.follows) == {"1-2"}


def test_writes_of_a_call_that_may_not_have_run_go_again_under_newer_ones() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    before = set(backup.held)

    commit(store, {"a": 1, "b": 1}, "1-0")
    lost = backup.update()  # sent, but the reply never came
    assert lost is not None
    backup.not_sent()

    # The backup may hold either identity now: the next update follows both.
    assert backup.held == before | {lost.identity}
    commit(store, {"b": 2}, "2-0")
    update = backup.update()
    assert update is not None and set(update.follows) == before | {lost.identity}
    sets = dict(zip(update.sets[::2], update.sets[1::2], strict=True))
    assert sets == {state_field("a"): msgspec.msgpack.encode(1), state_field("b"): msgspec.msgpack.encode(2)}
    assert update.checkpoints == {TOPIC: "2-0"} and update.identity == "1-3"


def test_flush_sends_the_journal_at_once_and_only_when_there_is_something() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    calls = len(broker.requests)

    backup.flush()
    assert len(broker.requests) == calls  # nothing journaled: no round trip

    commit(store, {"a": 1})
    backup.flush()

    assert len(broker.requests) == calls + 1 and broker.requests[-1].ids == []
    assert backup_state(broker) == {"a": 1} and backup_identity(broker) == identity(store)
    assert backup.held == {identity(store)} and not backup.journal


def test_a_flush_refused_for_a_lost_lease_raises_and_keeps_the_writes_for_the_next_owner_call() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    before = backup_identity(broker)
    commit(store, {"a": 1})
    broker.leases[LEASE_KEY] = "worker-2|2"

    with pytest.raises(LeaseLost):
        backup.flush()

    assert backup_identity(broker) == before and backup_state(broker) == {}
    assert backup.journal.updates[(STATE_NAMESPACE, "a")] == msgspec.msgpack.encode(1)


def test_an_update_the_backup_does_not_follow_on_from_is_refused_as_gone_back() -> None:
    """A fail-over lost the last update: the owner must not write on top of an older backup."""
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    batch(store, backup, {"a": 1}, "1-0")
    meta = broker.metas[keys.backup_keys(TOPIC, 0, GROUP).meta]
    meta[BACKUP_IDENTITY] = "1-1"  # the server came back without the batch
    broker.hashes[keys.backup_keys(TOPIC, 0, GROUP).values][BACKUP_MARK] = b"1-1"
    assert backup.went_back(_entries_up_to("1-0"))

    commit(store, {"a": 2}, "2-0")
    with pytest.raises(BackupWentBack):
        backup.flush()


def test_went_back_is_false_while_the_backup_holds_what_was_sent() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    batch(store, backup, {"a": 1}, "1-0")

    assert not backup.went_back(_entries_up_to("1-0"))
    assert not owner(broker, 2).went_back(_entries_up_to("1-0"))  # no reconcile: nothing sent yet


def _entries_up_to(*ids: str) -> Callable[[str, StreamId], bytes | None]:
    """``Topics.last_id_up_to`` over a stream holding ``ids``."""

    def last_id_up_to(stream: str, at: StreamId) -> bytes | None:
        assert stream == keys.stream_key(TOPIC, 0)
        found = [StreamId.parse(i) for i in ids if StreamId.parse(i) <= at]
        return str(max(found)).encode() if found else None

    return last_id_up_to


def _a_call_never_read(store: MemoryStore, backup: PartitionBackup) -> None:
    """A committed batch whose acknowledging call was sent and its reply never read (2-0)."""
    batch(store, backup, {"a": 1}, "1-0")
    commit(store, {"a": 2}, "2-0")
    backup.request([b"2-0"])
    backup.not_sent()  # the connection was lost before its reply: it may have run, or not


def test_a_call_never_read_that_did_not_run_with_its_entries_still_there_did_not_go_back() -> None:
    """The backup is at the identity before the call: its writes simply go again."""
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    _a_call_never_read(store, backup)
    assert len(backup.held) == 2

    assert not backup.went_back(_entries_up_to("1-0", "2-0"))
    assert not backup.went_back(_entries_up_to())  # nothing left up to it: trimmed, not lost


def test_a_call_never_read_whose_entries_the_server_lost_went_back() -> None:
    """A fail-over to a replica that had neither the call nor the batch's last entry: the store
    holds effects of entries the server no longer has, which the call would send again."""
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    _a_call_never_read(store, backup)

    assert backup.went_back(_entries_up_to("1-0"))


# -- at takeover: reconcile -----------------------------------------------------------------------


def test_reconcile_without_a_backup_says_missing_and_changes_nothing() -> None:
    store = MemoryStore()
    commit(store, {"a": 1}, "3-0")

    done = owner(FakeBroker(), 1).reconcile(store, [TOPIC])

    assert (done.action, done.amount) == ("missing", 0)
    assert state(store) == {"a": 1} and identity(store) == ""


def test_reconcile_a_store_at_the_backup_identity_is_in_sync() -> None:
    broker = FakeBroker()
    store = history(broker, 3)

    backup = owner(broker, 2)
    done = backup.reconcile(store, [TOPIC])

    assert (done.action, done.amount) == ("in sync", 0)
    assert backup.held == {identity(store)} == {"1-4"}
    assert backup.journal.seq == 4  # the next identity is new even if the token were the same


def test_reconcile_a_store_some_updates_behind_catches_up_from_the_log() -> None:
    broker = FakeBroker()
    store = history(broker, 2)
    behind = copy_of(store)  # another machine, two batches behind when the partition moved
    backup = owner(broker, 1)
    store.journal = backup.journal
    backup.reconcile(store, [TOPIC])
    batch(store, backup, {"k3": 3}, "3-0")
    batch(store, backup, {"k1": None, "k2": 20}, "4-0")

    done = owner(broker, 2).reconcile(behind, [TOPIC])

    assert (done.action, done.amount) == ("caught up", 2)
    assert state(behind) == state(store) == {"k2": 20, "k3": 3}
    assert behind.checkpoints() == {TOPIC: StreamId(4, 0)}
    assert identity(behind) == backup_identity(broker)


def test_reconcile_a_store_at_the_uploaded_identity_catches_up_from_the_first_logged_update() -> None:
    """An upload is not logged: the log leads from it only as the first update's ``prev``."""
    broker = FakeBroker()
    store = history(broker, 0)
    uploaded = copy_of(store)
    backup = owner(broker, 1)
    store.journal = backup.journal
    backup.reconcile(store, [TOPIC])
    batch(store, backup, {"k1": 1}, "1-0")

    done = owner(broker, 2).reconcile(uploaded, [TOPIC])

    assert (done.action, done.amount) == ("caught up", 1)
    assert state(uploaded) == {"k1": 1} and identity(uploaded) == backup_identity(broker)


def behind_and_ahead(broker: FakeBroker, batches: int) -> MemoryStore:
    """A store after one batch, while the owner's store and the backup went ``batches`` further."""
    store = history(broker, 1)
    behind = copy_of(store)
    backup = owner(broker, 1)
    store.journal = backup.journal
    backup.reconcile(store, [TOPIC])
    for n in range(2, batches + 2):
        batch(store, backup, {f"k{n}": n}, f"{n}-0")
    return behind


def test_reconcile_restores_when_the_log_skips_an_update() -> None:
    """Each update read must follow the last: catching up past a missing one would lose its writes."""
    broker = FakeBroker()
    behind = behind_and_ahead(broker, 3)
    log = broker.logs[keys.backup_keys(TOPIC, 0, GROUP).log]
    del log[-2]  # the update setting k3

    done = owner(broker, 2).reconcile(behind, [TOPIC])

    assert done.action == "restored"
    assert state(behind) == {"k1": 1, "k2": 2, "k3": 3, "k4": 4}


def test_reconcile_restores_when_the_log_ends_before_the_backup_identity() -> None:
    broker = FakeBroker()
    behind = behind_and_ahead(broker, 2)
    del broker.logs[keys.backup_keys(TOPIC, 0, GROUP).log][-1]  # its last update was not logged

    done = owner(broker, 2).reconcile(behind, [TOPIC])

    assert done.action == "restored"
    assert state(behind) == {"k1": 1, "k2": 2, "k3": 3}
    assert identity(behind) == backup_identity(broker)


def test_catch_up_stops_at_the_update_that_sets_the_identity_asked_for() -> None:
    broker = FakeBroker()
    behind = behind_and_ahead(broker, 3)  # at 1-2; the log goes on to 1-5
    reader = backup_module.locate(
        cast(Acknowledging, broker), keys.backup_keys(TOPIC, 0, GROUP), identity(behind)
    )
    assert reader is not None

    assert backup_module.catch_up(behind, reader, until="1-4") == 2

    assert identity(behind) == "1-4"
    assert state(behind) == {"k1": 1, "k2": 2, "k3": 3}
    assert behind.checkpoints() == {TOPIC: StreamId(3, 0)}


def test_reconcile_a_new_machine_restores_the_whole_backup() -> None:
    broker = FakeBroker()
    first = history(broker, 3)
    fresh = MemoryStore()

    done = owner(broker, 2).reconcile(fresh, [TOPIC])

    assert (done.action, done.amount) == ("restored", 3)
    assert state(fresh) == state(first) == {"k1": 1, "k2": 2, "k3": 3}
    assert fresh.checkpoints() == {TOPIC: StreamId(3, 0)}
    assert identity(fresh) == backup_identity(broker)


def test_reconcile_a_store_ahead_by_a_call_that_never_ran_restores_it_to_the_backup() -> None:
    """A crash between the local commit and the acknowledging call: the backup is the truth."""
    broker = FakeBroker()
    store = history(broker, 2)
    commit(store, {"k1": 100, "extra": 1}, "3-0")  # committed; its call never ran

    done = owner(broker, 2).reconcile(store, [TOPIC])

    assert done.action == "restored"
    assert state(store) == {"k1": 1, "k2": 2}
    assert store.checkpoints() == {TOPIC: StreamId(2, 0)}
    assert identity(store) == backup_identity(broker) == "1-3"


def test_reconcile_a_store_from_another_history_restores_it() -> None:
    """A store of an ex-owner whose later batches were never in the backup: not to be caught up."""
    broker = FakeBroker()
    store = history(broker, 1)
    stale = copy_of(store)
    commit(stale, {"k1": 5})  # written outside the backup's history
    stale.write({(BACKUP_NAMESPACE, BACKUP_IDENTITY): b"0-9"}, {})  # an older owner's identity

    done = owner(broker, 2).reconcile(stale, [TOPIC])

    assert done.action == "restored" and state(stale) == {"k1": 1}


def test_reconcile_restores_when_the_log_cannot_be_read() -> None:
    broker = FakeBroker()
    store = history(broker, 1)
    behind = copy_of(store)
    backup = owner(broker, 1)
    store.journal = backup.journal
    backup.reconcile(store, [TOPIC])
    batch(store, backup, {"k2": 2}, "2-0")
    log = broker.logs[keys.backup_keys(TOPIC, 0, GROUP).log]
    entry_id, fields = log[-1]
    log[-1] = (entry_id, {**fields, b"data": b"written in another layout"})

    done = owner(broker, 2).reconcile(behind, [TOPIC])

    assert done.action == "restored" and state(behind) == {"k1": 1, "k2": 2}


def test_reconcile_refuses_a_damaged_backup_unless_the_store_is_current() -> None:
    broker = FakeBroker()
    store = history(broker, 2)
    behind = history(FakeBroker(), 1)  # at 1-2, while the backup is at 1-3
    del broker.hashes[keys.backup_keys(TOPIC, 0, GROUP).values]  # evicted; the meta stays

    with pytest.raises(StateError, match="damaged"):
        owner(broker, 2).reconcile(behind, [TOPIC])
    assert state(behind) == {"k1": 1}  # nothing restored from what is left

    done = owner(broker, 2).reconcile(store, [TOPIC])
    assert done.action == "damaged"  # to be uploaded: this store holds all the backup held


def test_a_store_ahead_in_the_same_owners_history_stands_in_for_a_damaged_backup() -> None:
    broker = FakeBroker()
    store = history(broker, 2)
    commit(store, {"k3": 3}, "3-0")  # its call never ran
    del broker.hashes[keys.backup_keys(TOPIC, 0, GROUP).values]

    assert owner(broker, 2).reconcile(store, [TOPIC]).action == "damaged"


@pytest.mark.parametrize(
    ("local", "backup", "current"),
    [
        ("3-7", "3-7", True),
        ("3-9", "3-7", True),  # ahead in the same owner's history
        ("3-5", "3-7", False),  # behind
        ("4-9", "3-7", False),  # another owner's history, however far on
        ("2-9", "3-7", False),
        ("", "3-7", False),
        ("x-9", "x-7", False),  # not an identity this code wrote
        ("x-7", "x-7", True),
    ],
)
def test_current(local: str, backup: str, current: bool) -> None:
    assert _current(local, backup) is current


# -- upload -------------------------------------------------------------------------------------------


def test_upload_makes_the_whole_store_the_backup_under_a_new_identity() -> None:
    broker = FakeBroker()
    store = MemoryStore()
    commit(store, {"a": 1, "b": 2}, "5-0")
    backup = owner(broker, 3, partitions=4)
    assert backup.reconcile(store, [TOPIC]).action == "missing"

    done = backup.upload(store)

    assert (done.action, done.amount) == ("uploaded", 2)
    assert backup_state(broker) == {"a": 1, "b": 2}
    assert identity(store) == backup_identity(broker) == "3-1"
    assert backup.held == {"3-1"}
    meta = broker.metas[keys.backup_keys(TOPIC, 0, GROUP).meta]
    assert meta[f"cp:{TOPIC}"] == "5-0" and meta[keys.BACKUP_PARTITIONS] == "4"
    assert not any(r.ids for r in broker.requests)  # an upload acknowledges nothing
    # The next owner finds them equal.
    assert owner(broker, 4).reconcile(store, [TOPIC]).action == "in sync"


def test_upload_of_an_empty_store_is_fresh() -> None:
    broker = FakeBroker()
    backup = owner(broker, 1)

    done = backup.upload(MemoryStore())

    assert (done.action, done.amount) == ("fresh", 0)
    assert backup_identity(broker) == "1-1"


def test_upload_replaces_what_the_backup_held_and_sets_the_identity_with_its_last_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pages: the first empties the backup, the identity comes last (an upload cut short has none)."""
    monkeypatch.setattr(backup_module, "CHUNK", 2)
    broker = FakeBroker()
    history(broker, 1)  # an older backup, with a value the store no longer has
    store = MemoryStore()
    commit(store, {f"u{n}": n for n in range(5)}, "9-0")
    keep_alive: list[int] = []

    done = owner(broker, 2).upload(store, lambda: keep_alive.append(1))

    updates = [r.backup for r in broker.requests[-3:]]
    assert [(u.mode, bool(u.identity)) for u in updates if u is not None] == [
        ("replace", False),
        ("upload", False),
        ("upload", True),
    ]
    assert len(keep_alive) == 3  # between pages, as a long upload must renew its lease
    assert done.amount == 5 and backup_state(broker) == {f"u{n}": n for n in range(5)}
    assert backup_checkpoint(broker) == "9-0"


def test_an_update_finding_the_backup_damaged_uploads_the_owners_whole_store() -> None:
    """Only the owner, under its lease: its store holds every batch the backup held and after."""
    broker = FakeBroker()
    store = MemoryStore()
    backup, _ = take_over(broker, store, 1)
    batch(store, backup, {"a": 1}, "1-0")
    del broker.hashes[keys.backup_keys(TOPIC, 0, GROUP).values]
    commit(store, {"b": 2}, "2-0")

    backup.flush()

    assert backup_state(broker) == {"a": 1, "b": 2}
    assert backup_identity(broker) == identity(store) and backup.held == {identity(store)}
    assert backup_checkpoint(broker) == "2-0"


def test_a_backups_log_keeps_about_as_many_updates_as_hold_its_values() -> None:
    from pspf.broker.acking import BACKUP_LOG_LENGTH, BACKUP_LOG_MIN, log_length

    assert log_length(1_000, 630) == BACKUP_LOG_MIN  # a small state updated whole: a few updates
    assert log_length(500_000, 1_000) == 500
    assert log_length(10**6, 1_000) == BACKUP_LOG_LENGTH  # never more than the most
    assert log_length(10**9, 10) == BACKUP_LOG_LENGTH
    assert log_length(100, 0) == BACKUP_LOG_LENGTH  # an update of only checkpoints
