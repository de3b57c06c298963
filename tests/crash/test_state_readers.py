"""Reading state from outside while a worker (re)starts: a reader must never see a half-made store."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from pspf.errors import NotFound, StateError
from pspf.state_stores import open_store

pytestmark = [pytest.mark.integration, pytest.mark.crash]


def test_readonly_open_while_a_worker_creates_the_store(tmp_path: Path) -> None:
    """``pspf state get`` (and the tests' pollers) open stores read-only while workers run.

    A worker taking a partition for the first time creates its store: the file appears before its
    tables. A read-only open in that window must say "no state" (NotFound) or read an empty
    store, not fail with a StateError.
    """
    errors: Counter[str] = Counter()
    for attempt in range(100):
        directory = tmp_path / str(attempt)
        stop = threading.Event()

        def poll(directory: Path = directory, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    with open_store("sqlite", directory, "app", 0, readonly=True) as store:
                        store.checkpoints()
                except NotFound:
                    pass
                except StateError as exc:
                    errors[str(exc).partition(".sqlite: ")[2]] += 1

        reader = threading.Thread(target=poll)
        reader.start()
        try:
            time.sleep(0.002)
            writer = open_store("sqlite", directory, "app", 0)  # what a worker's first take does
            time.sleep(0.002)
        finally:
            stop.set()
            reader.join()
        writer.close()
    assert not errors, f"read-only opens failed while the store was being created: {dict(errors)}"
