"""Extension points of the batch cycle and what a cycle counts: below the processor and the relay.

``ProcessorHooks`` (with the relay's ``RelayHooks``) is what apps, metrics and audit implement;
``call_hook`` calls one so that a failing hook is logged, never the worker's failure;
``HookChain`` calls several. ``Counts`` and ``CycleResult`` are what a cycle (or a run) did.
The processor, the relay, time keeping, the app and the metrics import this module; it imports
none of them, so no import circle goes through it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pspf.failures import DeadLetter, Failure
    from pspf.outbox.rows import OutboxRow, RowState

log = logging.getLogger(__name__)


class Counts(msgspec.Struct, kw_only=True):
    """Entries by what became of them: of one cycle, or of a whole run."""

    read: int = 0
    skipped: int = 0
    handled: int = 0
    failed: int = 0
    retried: int = 0
    parked: int = 0
    dead_lettered: int = 0
    lost_entries: int = 0
    #: outbox rows published, and publish attempts that failed
    published: int = 0
    publish_failed: int = 0
    #: entries whose windows had all closed (not applied; an entry counts once per such window),
    #: and windows closed
    late: int = 0
    windows_closed: int = 0
    #: scheduled callbacks and timer periods that ran, and those that raised (dropped)
    callbacks_run: int = 0
    callbacks_failed: int = 0
    timers_run: int = 0
    timers_failed: int = 0
    #: ``late`` by window name
    late_windows: dict[str, int] = msgspec.field(default_factory=dict)

    def add(self, other: Counts) -> None:
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for window, entries in other.late_windows.items():
            self.late_windows[window] = self.late_windows.get(window, 0) + entries


_SUMMED = tuple(name for name in Counts.__struct_fields__ if name != "late_windows")


class CycleResult(Counts, kw_only=True):
    """What one cycle did."""

    lost_partitions: list[int] = msgspec.field(default_factory=list)
    idle: bool = False


class RelayHooks:
    """The relay's extension points (``ProcessorHooks`` has them too); the defaults do nothing."""

    def on_outbox_claimed(self, partition: int, rows: int) -> None:
        """A partition's relay claimed ``rows`` rows (durably) and is about to publish them."""

    def on_outbox_sent(self, partition: int, stream: str, rows: int, appended: int) -> None:
        """One publishing call to ``stream`` returned: ``appended`` of its ``rows`` were new there."""

    def on_outbox_settled(
        self, partition: int, published: list[tuple[int, int]], failed: list[OutboxRow]
    ) -> None:
        """The claimed rows are marked: published, or back to pending / dead after a failure.

        ``published`` has (created_ms, published_ms) of each row published.
        """

    def on_outbox_rows(self, partition: int, counts: dict[RowState, int]) -> None:
        """A partition's outbox rows by state, after a relay step."""


def call_hook(hook: Any, *args: Any) -> None:
    """Call a hook; a failing hook is logged, never the worker's failure."""
    try:
        hook(*args)
    except Exception:
        log.exception("a hook failed: %s", getattr(hook, "__qualname__", hook))


class ProcessorHooks(RelayHooks):
    """Extension points (metrics, audit); the defaults do nothing. A failing hook is logged.

    Hooks run on the worker's thread. The success path calls them per cycle, partition or stream,
    never per entry, so they stay cheap; only failures are reported entry by entry.
    """

    def on_read(self, entries: int) -> None:
        """A cycle read ``entries`` entries (> 0) over all owned streams."""

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        """A stream's batch is committed and about to be acknowledged.

        ``handled``: entries its handler completed; ``skipped``: entries that needed no handler
        (at or below the checkpoint, or redriven for another app). Also called when the batch
        needed no store write, if it handled or skipped anything.
        """

    def on_commit(self, partition: int, seconds: float) -> None:
        """One store transaction of a partition's batch took ``seconds``."""

    def on_acknowledging(self, entries: dict[str, int]) -> None:
        """Every batch of the cycle is committed; acknowledging is about to be sent.

        ``entries``: per stream, the entries to acknowledge or move to the DLQ (only streams
        with some).
        """

    def on_ack(self, seconds: float) -> None:
        """The cycle's acknowledging round trip (acks and DLQ moves) took ``seconds``."""

    def on_failure(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        """An attempt failed: a handler error, an undecodable entry or a poison entry.

        ``on_retry`` follows if it will be tried again; otherwise the entry goes to the DLQ and
        ``on_dead_letter`` is called once the move is acknowledged.
        """

    def on_retry(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        """An entry failed and will be tried again (ordered retry or parked)."""

    def on_dead_letter(self, record: DeadLetter) -> None:
        """An entry was moved to the DLQ."""

    def on_late(self, window: str, topic: str, partition: int, entries: int) -> None:
        """``entries`` of ``topic`` came after all their windows of ``window`` (its name) closed.

        They were not applied to that window (the topic's other windows and handler may have
        taken them).
        """


class HookChain(ProcessorHooks):
    """Several hooks as one: each is called, also when an earlier one fails."""

    def __init__(self, *hooks: ProcessorHooks) -> None:
        self.hooks = hooks

    def _each(self, name: str, *args: Any) -> None:
        for hooks in self.hooks:
            call_hook(getattr(hooks, name), *args)

    def on_read(self, entries: int) -> None:
        self._each("on_read", entries)

    def on_batch_committed(self, topic: str, partition: int, handled: int, skipped: int) -> None:
        self._each("on_batch_committed", topic, partition, handled, skipped)

    def on_commit(self, partition: int, seconds: float) -> None:
        self._each("on_commit", partition, seconds)

    def on_acknowledging(self, entries: dict[str, int]) -> None:
        self._each("on_acknowledging", entries)

    def on_ack(self, seconds: float) -> None:
        self._each("on_ack", seconds)

    def on_failure(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        self._each("on_failure", topic, partition, entry_id, failure)

    def on_retry(self, topic: str, partition: int, entry_id: str, failure: Failure) -> None:
        self._each("on_retry", topic, partition, entry_id, failure)

    def on_dead_letter(self, record: DeadLetter) -> None:
        self._each("on_dead_letter", record)

    def on_late(self, window: str, topic: str, partition: int, entries: int) -> None:
        self._each("on_late", window, topic, partition, entries)

    def on_outbox_claimed(self, partition: int, rows: int) -> None:
        self._each("on_outbox_claimed", partition, rows)

    def on_outbox_sent(self, partition: int, stream: str, rows: int, appended: int) -> None:
        self._each("on_outbox_sent", partition, stream, rows, appended)

    def on_outbox_settled(
        self, partition: int, published: list[tuple[int, int]], failed: list[OutboxRow]
    ) -> None:
        self._each("on_outbox_settled", partition, published, failed)

    def on_outbox_rows(self, partition: int, counts: dict[RowState, int]) -> None:
        self._each("on_outbox_rows", partition, counts)
