"""The child process of ``test_commit_crash``: commits batches to one store until it is killed.

Run as ``python -m tests.crash.commit_child ENGINE DIRECTORY DURABILITY PROBE``. It opens the store
of group ``g`` partition 0, continues after the batch its checkpoint names, prints ``ready N``
(N = the checkpoint's batch) and then commits batch N+1, N+2, ... for ever. Batch ``n`` is
``apply_batch(n, ...)``: it increments a counter under each of ``PER_BATCH`` keys derived from n,
sets ``last`` to n, sets ``tmp<n % 4>`` and deletes ``tmp<(n + 1) % 4>``, and moves the checkpoint
of topic ``t`` to ``StreamId(n, 0)``; all in one transaction.

``PROBE`` is an 8-byte file the child maps into memory: batch number * 2 + phase. Phase 1 is
written right before ``commit()`` of that batch and phase 0 right after it returned, so after a
SIGKILL the parent knows whether the kill landed inside a commit and which checkpoints are allowed.
Both go in one word, copied in by one slice assignment: ``struct.pack_into`` zeroes its fields
before it writes them one by one, so a kill in between left (batch n, phase 0) for a commit of n
that had not started.
"""

from __future__ import annotations

import mmap
import struct
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from pspf.keys import StreamId
from pspf.state_stores import open_store

GROUP = "g"
TOPIC = "t"
NAMESPACE = "c"
KEYS = 3_000
PER_BATCH = 400
#: Pads each counter value to about 400 bytes: a commit writes ~170 kB, so kills tend to land in it.
PAD = b"." * 400
PROBE = struct.Struct("<q")


def batch_keys(n: int) -> list[str]:
    """The counter keys batch ``n`` increments: PER_BATCH consecutive keys from a spot n picks."""
    start = (n * 7919) % KEYS
    return [f"k{(start + i) % KEYS:05d}" for i in range(PER_BATCH)]


def counter_value(count: int, n: int) -> bytes:
    """A counter's value: its count and the batch that last touched it."""
    return f"{count}:{n}:".encode() + PAD


def apply_batch(
    n: int,
    counters: dict[str, int],
    set_value: Callable[[str, bytes], None],
    delete: Callable[[str], None],
) -> None:
    """The writes of batch ``n`` (without the checkpoint), given the counts before it."""
    for key in batch_keys(n):
        counters[key] = counters.get(key, 0) + 1
        set_value(key, counter_value(counters[key], n))
    set_value("last", str(n).encode())
    set_value(f"tmp{n % 4}", str(n).encode())
    delete(f"tmp{(n + 1) % 4}")


class Model:
    """What the namespace holds after batches 1..``batches``, computed without a store."""

    def __init__(self) -> None:
        self.batches = 0
        self.values: dict[str, bytes] = {}
        self._counters: dict[str, int] = {}

    def advance(self, batches: int) -> dict[str, bytes]:
        """Apply the batches up to ``batches`` (never fewer than already applied); the values."""
        assert batches >= self.batches, f"the model cannot go back from {self.batches} to {batches}"
        while self.batches < batches:
            self.batches += 1
            apply_batch(self.batches, self._counters, self.values.__setitem__, self._delete)
        return self.values

    def _delete(self, key: str) -> None:
        self.values.pop(key, None)


def main(engine: str, directory: str, durability: str, probe_path: str) -> None:
    with open(probe_path, "r+b") as probe_file:
        probe = mmap.mmap(probe_file.fileno(), PROBE.size)
    store = open_store(engine, directory, GROUP, 0, durability=durability)  # type: ignore[arg-type]
    checkpoint = store.checkpoints().get(TOPIC)
    n = 0 if checkpoint is None else checkpoint.ms
    counters = {key: int(value.split(b":", 1)[0]) for key, value in store.items(NAMESPACE, "k")}
    _mark(probe, n, inside=False)
    print(f"ready {n}", flush=True)
    while True:
        n += 1
        tx = store.transaction()
        apply_batch(n, counters, partial(tx.set, NAMESPACE), partial(tx.delete, NAMESPACE))
        tx.set_checkpoint(TOPIC, StreamId(n, 0))
        _mark(probe, n, inside=True)
        tx.commit()
        _mark(probe, n, inside=False)


def _mark(probe: mmap.mmap, n: int, inside: bool) -> None:
    """Batch ``n`` and whether its commit runs, in one word written at once."""
    probe[: PROBE.size] = PROBE.pack(n * 2 + inside)


def read_probe(path: Path) -> tuple[int, bool]:
    """(batch number, inside its commit) as the child left them."""
    (word,) = PROBE.unpack(path.read_bytes()[: PROBE.size])
    return word // 2, word % 2 == 1


if __name__ == "__main__":
    main(*sys.argv[1:5])
