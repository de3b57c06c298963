"""The processor hooks report what happened, for metrics and audit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pspf import App, Context, NonRetryableError, ProcessorHooks, Settings, Worker
from pspf.failures import DeadLetter, Failure
from tests.conftest import Names

pytestmark = pytest.mark.integration


class Recorder(ProcessorHooks):
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.dead: list[DeadLetter] = []

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        self.counts["handled"] += handled

    def on_retry(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        self.counts["retried"] += 1

    def on_dead_letter(self, record: DeadLetter) -> None:
        self.dead.append(record)
        raise RuntimeError("a broken hook must not break processing")


def test_hooks_count_processed_retried_and_dead_lettered(
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    topic = make_topic(2)
    produce(topic, [(f"k{i % 5}", {"i": i}) for i in range(200)])
    app = App(names.app())
    tries: Counter[int] = Counter()

    @app.handler(topic)
    def handle(value: dict[str, int], ctx: Context) -> None:
        tries[value["i"]] += 1
        if value["i"] % 50 == 7:
            raise NonRetryableError("never")
        if value["i"] % 50 == 9 and tries[value["i"]] < 2:
            raise RuntimeError("once")

    hooks = Recorder()
    summary = Worker(app, make_settings(), hooks=hooks).run(until_idle=True)

    assert summary.dead_lettered == 4 and len(hooks.dead) == 4
    assert sorted(int(r.original[b"value"].split(b":")[1].rstrip(b"}")) for r in hooks.dead) == [
        7,
        57,
        107,
        157,
    ]
    assert hooks.counts["retried"] == 4 == summary.retried
    assert hooks.counts["handled"] == 196 == summary.handled
