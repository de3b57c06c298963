"""SIGKILL a process while it commits to a store, 100 times per engine, on the same store each time.

The child (``tests/crash/commit_child.py``) reopens the store, continues after its checkpoint and
commits batch after batch; about 3/4 of its time is spent inside ``commit()``. The parent kills it
5 to 50 ms after it is ready. After each kill the store must be sound (the engine's integrity
check) and hold exactly the effects of the batches up to its checkpoint, neither a batch more nor
a write less; the checkpoint must be the batch being committed or the one before when the kill
landed inside ``commit()``, and the last committed batch otherwise (a returned commit survives a
killed process with either durability).
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pspf.state_stores import open_store
from tests.conftest import ROOT, subprocess_env
from tests.crash.commit_child import GROUP, NAMESPACE, PROBE, TOPIC, Model, read_probe
from tests.crash.support import ENGINES

pytestmark = pytest.mark.crash

ROUNDS = 100
#: Every FSYNC_EVERY-th child commits with durability="fsync" (10 of the 100 rounds).
FSYNC_EVERY = 10
READY_TIMEOUT_S = 30


def _read_ready(child: subprocess.Popen[bytes], log: Path) -> str:
    """The child's first stdout line, or a failure with its log when it does not come in time."""
    assert child.stdout is not None
    readable, _, _ = select.select([child.stdout], [], [], READY_TIMEOUT_S)
    line = child.stdout.readline().decode().strip() if readable else ""
    assert line.startswith("ready "), f"the child did not get ready: {line!r}\n{log.read_text()}"
    return line


def _differences(got: dict[str, bytes], want: dict[str, bytes]) -> str:
    missing = sorted(want.keys() - got.keys())
    extra = sorted(got.keys() - want.keys())
    wrong = sorted(k for k in want.keys() & got.keys() if got[k] != want[k])
    first = {k: (got[k][:12], want[k][:12]) for k in wrong[:3]}
    return (
        f"{len(missing)} keys missing {missing[:5]}, {len(extra)} extra {extra[:5]}, "
        f"{len(wrong)} wrong (got, want) {first}"
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_sigkill_inside_commit_keeps_exactly_the_committed_batches(engine: str, tmp_path: Path) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    directory = tmp_path / "state"
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(PROBE.size))
    model = Model()
    committed = 0
    inside = progressed = 0
    started = time.monotonic()

    for round_ in range(ROUNDS):
        durability = "fsync" if round_ % FSYNC_EVERY == FSYNC_EVERY - 1 else "normal"
        log = tmp_path / f"child{round_}.log"
        command = [sys.executable, "-m", "tests.crash.commit_child", engine, str(directory), durability]
        with (
            log.open("wb") as errors,
            subprocess.Popen(
                [*command, str(probe)], stdout=subprocess.PIPE, stderr=errors, env=subprocess_env(), cwd=ROOT
            ) as child,
        ):
            try:
                assert _read_ready(child, log) == f"ready {committed}", "the child resumed elsewhere"
                time.sleep(rng.uniform(0.005, 0.05))
            finally:
                child.kill()
            assert child.wait(timeout=10) == -9, f"the child exited by itself\n{log.read_text()}"

        in_flight, in_commit = read_probe(probe)
        # Alternate who recovers the crashed store: this process (a writable open) or the next child.
        with open_store(engine, directory, GROUP, 0, readonly=round_ % 2 == 0) as store:
            assert store.integrity_check() == "ok", f"round {round_}"
            checkpoint = store.checkpoints().get(TOPIC)
            got = dict(store.items(NAMESPACE))
        now = 0 if checkpoint is None else checkpoint.ms
        assert checkpoint is None or checkpoint.seq == 0
        where = f"round {round_} ({durability}): checkpoint {now}, batch {in_flight}"
        if in_commit:
            assert now in (in_flight - 1, in_flight), f"{where}, killed inside its commit"
        else:
            assert now == in_flight, f"{where}, committed before the kill"
        assert now >= committed, f"{where}: went back from {committed}"
        want = model.advance(now)
        assert got == want, f"{where}: {_differences(got, want)}"
        inside += in_commit
        progressed += now > committed
        committed = now

    # A last writable open recovers whatever the last kill left and still reads the same.
    with open_store(engine, directory, GROUP, 0) as store:
        assert store.integrity_check() == "ok"
        assert store.checkpoints()[TOPIC].ms == committed
        assert dict(store.items(NAMESPACE)) == model.values
    elapsed = time.monotonic() - started
    print(
        f"{engine}: {ROUNDS} kills in {elapsed:.1f} s, {inside} inside commit(), "
        f"{progressed} after progress, {committed} batches committed"
    )
    # About 3/4 of the child's loop is commit(); fewer than a third means the kills missed it.
    assert inside >= ROUNDS // 3, f"only {inside} of {ROUNDS} kills landed inside commit()"
    assert progressed >= ROUNDS // 2, f"only {progressed} of {ROUNDS} children committed anything"
