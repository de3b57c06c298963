"""Helpers of the failure-handling tests: reading DLQs, streams and stores, workers in threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from pspf import App, Context, Settings, Worker
from pspf.failures import DeadLetter
from pspf.keys import FAILURES_NAMESPACE, StreamId, dlq_key, stream_key
from pspf.partition.batch import iter_state
from pspf.service import Service
from pspf.state_stores import open_store
from pspf.worker import RunSummary

Fields = dict[bytes, bytes]
#: Entries of a topic by (partition, id): ids repeat across partitions.
Entries = dict[tuple[int, str], Fields]


def stream_entries(client: Any, topic: str, partitions: int) -> Entries:
    return {
        (p, entry_id.decode()): fields
        for p in range(partitions)
        for entry_id, fields in client.xrange(stream_key(topic, p))
    }


def dead_letters(client: Any, topic: str, partitions: int) -> list[DeadLetter]:
    """Every DLQ entry of the topic, decoded with ``DeadLetter.from_fields``."""
    return [
        DeadLetter.from_fields(fields)
        for p in range(partitions)
        for _, fields in client.xrange(dlq_key(topic, p))
    ]


def dead_by_entry(client: Any, topic: str, partitions: int) -> dict[tuple[int, str], DeadLetter]:
    """DLQ records by their source (partition, id); fails when an entry is there twice."""
    found: dict[tuple[int, str], DeadLetter] = {}
    for record in dead_letters(client, topic, partitions):
        where = (record.source_partition, record.source_id)
        assert where not in found, f"entry {where} is in the DLQ twice"
        found[where] = record
    return found


def read_state(state_dir: Path | str, app: str, partitions: int) -> dict[str, dict[str, Any]]:
    """Every key's state over all partition stores (read-only); a key in two stores fails."""
    found: dict[str, dict[str, Any]] = {}
    for p in range(partitions):
        with open_store("sqlite", state_dir, app, p, readonly=True) as store:
            for key, value in iter_state(store):
                assert key not in found, f"key {key} has state in two partitions"
                found[key] = value
    return found


def parked_names(state_dir: Path | str, app: str, partitions: int) -> set[str]:
    """The retry bookkeeping entries ("topic/id") the stores hold."""
    names: set[str] = set()
    for p in range(partitions):
        with open_store("sqlite", state_dir, app, p, readonly=True) as store:
            names |= {name for name, _ in store.items(FAILURES_NAMESPACE)}
    return names


def assert_drained(client: Any, state_dir: Path | str, topic: str, app: str, partitions: int) -> None:
    """Nothing pending for the app, and each partition's checkpoint is its stream's last id."""
    for p in range(partitions):
        stream = stream_key(topic, p)
        pending = client.xpending(stream, app)["pending"]
        assert pending == 0, f"partition {p}: {pending} entries still pending"
        with open_store("sqlite", state_dir, app, p, readonly=True) as store:
            checkpoint = store.checkpoints().get(topic)
        last = StreamId.parse(client.xinfo_stream(stream)["last-generated-id"])
        assert checkpoint == last, f"partition {p}: checkpoint {checkpoint} != last id {last}"


def summing_app(name: str, topic: str) -> App:
    """An app that adds each entry's ``n`` to its key's ``total``."""
    app = App(name)

    @app.handler(topic)
    def add(value: dict[str, int], ctx: Context) -> None:
        ctx.state["total"] = ctx.state.get("total", 0) + value["n"]

    return app


class WorkerThread:
    """``Worker.run`` in a thread; ``stop`` asks it to finish and returns its summary.

    Use it as a context manager so a failing test never leaves a worker running.
    """

    def __init__(self, app: App, settings: Settings, until_idle: bool = False) -> None:
        self.worker = Worker(app, settings)
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(until_idle,), name="pspf-test-worker", daemon=True
        )
        self.thread.start()

    def __enter__(self) -> WorkerThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Always stop the worker; a test that failed already keeps its own error."""
        self.worker.stop()
        self.thread.join(20)

    def _run(self, until_idle: bool) -> None:
        try:
            self.summary = self.worker.run(until_idle=until_idle)
        except BaseException as exc:
            self.error = exc

    def alive(self) -> bool:
        return self.thread.is_alive()

    def check(self) -> None:
        """Fail at once when the worker thread died of an exception."""
        if self.error is not None:
            raise AssertionError(f"the worker failed: {self.error!r}") from self.error

    def stop(self, timeout: float = 20) -> RunSummary:
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker did not stop"
        self.check()
        assert self.summary is not None
        return self.summary


#: The keys the summing app's tests spread entries over: ``k{n % KEYS}``.
KEYS = 37


def totals(n_to: int) -> dict[str, int]:
    """What the summing app holds per key after the entries n = 0 .. n_to-1 over ``KEYS`` keys."""
    found: dict[str, int] = {}
    for n in range(n_to):
        found[f"k{n % KEYS}"] = found.get(f"k{n % KEYS}", 0) + n
    return found


def state_of(service: Service, app: str) -> dict[str, int]:
    """Each key's ``total`` as the service reads it."""
    return {f"k{k}": service.state_get(app, f"k{k}")["total"] for k in range(KEYS)}
