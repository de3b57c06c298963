"""The per-entry checks hold on the runner's fast path: a key is checked once, every rule still applies.

``run_sync`` remembers the keys it found to be text and in the entry's partition (``known``) and
builds the common entry's context without checking again. These tests run entries through it
with a shared memory of keys and check that nothing else is remembered: a wrong partition, a
key that is not UTF-8, a repeated field, bad headers and poison entries fail every time.
"""

from __future__ import annotations

import zlib
from typing import Any

from pspf import App, Context, codec
from pspf.cycle.execution import KNOWN_KEYS_LIMIT, Entry, EntryMeta, run_sync
from pspf.errors import DecodeError, WrongPartition
from pspf.failures import PoisonEntry

from .test_attempt import Source

PARTITIONS = 4


def keys_of(partition: int, count: int) -> list[str]:
    """``count`` keys that CRC32 mod PARTITIONS puts in ``partition``."""
    found = []
    n = 0
    while len(found) < count:
        key = f"k{n}"
        if zlib.crc32(key.encode()) % PARTITIONS == partition:
            found.append(key)
        n += 1
    return found


class Batch(Source):
    """An empty store under the batch's own writes, as ``PartitionBatch.base`` sees them."""

    def __init__(self) -> None:
        super().__init__({})
        self.overlay: dict[str, bytes | None] = {}

    def base(self, key: str) -> bytes | None:
        return self.overlay[key] if key in self.overlay else super().base(key)


def counting_app() -> App:
    app = App("checks")

    @app.handler("orders")
    def count(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + order["n"]
        ctx.state["headers"] = len(ctx.headers)

    return app


def run(
    entries: list[Entry],
    known: dict[bytes, str],
    counts: dict[bytes, int] | None = None,
    poison: frozenset[bytes] = frozenset(),
    known_limit: int = KNOWN_KEYS_LIMIT,
) -> tuple[dict[str, Any], dict[int, BaseException]]:
    handler = counting_app().handlers["orders"]
    meta = EntryMeta("orders", 0, counts or {}, poison, 3, None, PARTITIONS, known, None, known_limit)
    source = Batch()
    overlay = source.overlay
    ran, errors = run_sync(handler, meta, entries, overlay, [], [], source, lambda i, e: False)
    assert ran == len(entries)
    states = {k: codec.state_decoder.decode(v) for k, v in overlay.items() if v is not None}
    return states, errors


def entry(n: int, key: bytes | None, **extra: bytes) -> Entry:
    fields = {b"value": b'{"n": 1}', **{name.encode(): value for name, value in extra.items()}}
    if key is not None:
        fields[b"key"] = key
    return (f"{n}-0".encode(), fields)


def test_a_key_of_the_partition_is_remembered_and_its_entries_run() -> None:
    mine = keys_of(0, 2)
    known: dict[bytes, str] = {}
    states, errors = run(
        [entry(1, mine[0].encode()), entry(2, mine[0].encode()), entry(3, mine[1].encode())], known
    )
    assert not errors
    assert states[mine[0]]["n"] == 2 and states[mine[1]]["n"] == 1
    assert known == {mine[0].encode(): mine[0], mine[1].encode(): mine[1]}


def test_a_key_of_another_partition_fails_every_time_and_is_never_remembered() -> None:
    theirs = keys_of(1, 1)[0].encode()
    known: dict[bytes, str] = {}
    for _ in range(2):
        _, errors = run([entry(1, theirs), entry(2, theirs)], known)
        assert sorted(errors) == [0, 1]
        assert all(isinstance(e, WrongPartition) for e in errors.values())
        assert "belongs to partition 1" in str(errors[0])
    assert known == {}


def test_a_key_that_is_not_utf8_fails_every_time() -> None:
    known: dict[bytes, str] = {}
    _, errors = run([entry(1, b"\xff\xfe"), entry(2, b"\xff\xfe")], known)
    assert sorted(errors) == [0, 1] and all(isinstance(e, DecodeError) for e in errors.values())
    assert known == {}


def test_a_known_key_does_not_excuse_repeated_fields_or_bad_headers() -> None:
    mine = keys_of(0, 1)[0]
    known = {mine.encode(): mine}
    repeated = codec.RepeatedFields({b"key": mine.encode(), b"value": b'{"n": 1}'}, b"value", 2)
    entries = [
        (b"1-0", repeated),
        entry(2, mine.encode(), headers=b"not json"),
        entry(3, mine.encode(), headers=b'{"a": "b"}'),
        entry(4, mine.encode()),
    ]
    states, errors = run(entries, known)
    assert isinstance(errors[0], DecodeError) and "twice" in str(errors[0])
    assert isinstance(errors[1], DecodeError)
    assert sorted(errors) == [0, 1]
    assert states[mine] == {"n": 2, "headers": 0}, "the last entry has no headers; the third had one"


def test_a_known_key_does_not_excuse_a_poison_entry() -> None:
    mine = keys_of(0, 1)[0]
    known = {mine.encode(): mine}
    states, errors = run(
        [entry(1, mine.encode()), entry(2, mine.encode())],
        known,
        counts={b"2-0": 9},
        poison=frozenset({b"2-0"}),
    )
    assert sorted(errors) == [1] and isinstance(errors[1], PoisonEntry) and "9 times" in str(errors[1])
    assert states[mine]["n"] == 1


def test_a_keyless_entry_runs_under_the_empty_key() -> None:
    states, errors = run([entry(1, None), entry(2, None)], {})
    assert not errors and states[""]["n"] == 2


def test_the_memory_of_keys_starts_again_past_its_limit() -> None:
    known = {f"x{i}".encode(): f"x{i}" for i in range(KNOWN_KEYS_LIMIT)}
    mine = keys_of(0, 1)[0]
    _, errors = run([entry(1, mine.encode())], known)
    assert not errors
    assert known == {mine.encode(): mine}


def test_a_partition_remembers_keys_up_to_its_share_of_the_worker() -> None:
    """The worker's budget is shared by its partitions: one of many starts again sooner."""
    mine = keys_of(0, 3)
    known: dict[bytes, str] = {}
    _, errors = run([entry(i, key.encode()) for i, key in enumerate(mine[:2])], known, known_limit=2)
    assert not errors and len(known) == 2
    _, errors = run([entry(3, mine[2].encode())], known, known_limit=2)
    assert not errors and known == {mine[2].encode(): mine[2]}
