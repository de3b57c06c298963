"""The one answer to "how many partitions does topic T have now": ``partition_count``.

A topic's count is in its record (``keys.topic_key``), with its layout generation and a mark while
a repartition of it runs; the apps that read it keep the count their state was built for. Routing
a key by the record's count is right only once no repartition runs (the layout guard) and while
the readers were built for it, so every caller that routes or owns by the count asks here: the
Producer, the Spark writer, the worker at its start. Callers after something else read the broker
directly: ``topic_partitions`` for the record as it is (listings, an existence check, a running
worker's check that its count still holds, a repartition's plan), ``topic_layout`` for the
layout generation (the outbox's emitter, the repartition).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from pspf.errors import BrokerError, ConfigError, StateError


class TopicCount(NamedTuple):
    """A topic's partition count and the layout generation it belongs to."""

    partitions: int
    layout: str


class CountSource(Protocol):
    """The broker calls ``partition_count`` makes (``pspf.broker.Broker`` has them)."""

    def topic_layout(self, topic: str) -> tuple[int, str, bool]: ...

    def reader_counts(self, topic: str) -> dict[str, int]: ...


def partition_count(
    broker: CountSource,
    topic: str,
    *,
    app: str | None = None,
    wait_s: float = 0.0,
    hint: str = "",
    stale: str | None = None,
    deadline: float | None = None,
) -> TopicCount:
    """The partition count of ``topic`` now, once no repartition of it runs (and not ``stale``).

    An app reading the topic (``app``: a worker starting) is refused a running repartition at once
    (ConfigError: the operator finishes it first), and checks its own record itself, against its
    stores. A writer (``app`` None) waits ``wait_s`` at most, or until ``deadline``
    (``time.monotonic()``), then fails (BrokerError, ending with ``hint``); so does a layout the
    partitions refuse although the record gives it (``stale``). It is refused (StateError) a count
    an app reading the topic was not built for.

    Raises:
        NotFound: the topic was never created.
    """
    if deadline is None:
        deadline = time.monotonic() + wait_s
    while True:
        partitions, layout, moving = broker.topic_layout(topic)
        if not moving and layout != stale:
            if app is None:
                _check_readers(broker, topic, partitions)
            return TopicCount(partitions, layout)
        if app is not None and moving:
            raise ConfigError(
                f"topic {topic!r} is being repartitioned: start the app once "
                f"`pspf topic repartition {topic} --resume` has finished it"
            )
        if time.monotonic() >= deadline:
            if not moving:
                raise BrokerError(
                    f"topic {topic!r}: its partitions refuse layout {layout!r}, which its record "
                    f"gives, and no repartition of it runs; {hint}"
                )
            raise BrokerError(
                f"topic {topic!r} is being repartitioned and was not done within {wait_s:g}s; {hint}"
            )
        time.sleep(0.1)


def _check_readers(broker: CountSource, topic: str, partitions: int) -> None:
    """Refuse a count the apps reading ``topic`` were not built for, as their workers do.

    The topic record's count is what the layout guards trust; an app's record keeps the count
    its state was built for. They differ only when the record was changed behind PSPF's back
    (a repartition switches both), and writing then puts keys where no state holds them.
    """
    for app, built in broker.reader_counts(topic).items():
        if built != partitions:
            raise StateError(
                f"topic {topic!r} has {partitions} partitions by its record, but app {app!r} "
                f"was built for {built} partitions: the count was changed behind PSPF's "
                "back (a topic deleted and created again, or its record edited). Keys would "
                f"land in partitions whose state does not hold them, so nothing more is written. "
                f"Set the count back to {built} (or create the topic again with it)"
            )
