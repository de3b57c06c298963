"""Durability: a committed batch made durable, in this order and nowhere else.

Commit (``Durability.commit``: the partition's one store transaction), then the acknowledgement
under the leases that carries the state backup's update and the DLQ moves (``acknowledge``;
``flush`` for work that acknowledges nothing), then the outbox rows may be published
(``PartitionOutbox.confirm``). With a broker that sends acknowledgements and reads their replies
later, a reply is read before the next commit (``settle``). It returns the partitions whose lease
(or backup) refused the call; it calls nothing back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

from pspf import keys
from pspf.broker import AckInFlight, AckRequest, Fields
from pspf.errors import BackupDamaged, LeaseLost
from pspf.failures import DeadLetter
from pspf.hooks import ProcessorHooks, call_hook
from pspf.keys import entry_name
from pspf.observability.tracing import Tracing
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.owned import OwnedPartition, StreamCursor

log = logging.getLogger("pspf.batch")

_T = TypeVar("_T")


class Acknowledger(Protocol):
    """What acknowledging needs of the broker (``Acknowledging.ack``; ``TestApp`` has its own)."""

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]: ...


class SendsAcks(Acknowledger, Protocol):
    """An acknowledger that can send a call and have its reply read later (``Broker.ack_sent``)."""

    def ack_sent(self, requests: Sequence[AckRequest]) -> AckInFlight: ...


class Acknowledged(NamedTuple):
    """What one acknowledgement came to."""

    #: partition -> (stream, why) of each partition whose lease (or backup) refused the call
    lost: dict[int, tuple[str, LeaseLost]]
    dead_lettered: int

    def merged(self, other: Acknowledged) -> Acknowledged:
        return Acknowledged({**self.lost, **other.lost}, self.dead_lettered + other.dead_lettered)


class _InFlight(NamedTuple):
    """An acknowledgement whose reply is still to be read (``Durability.settle``)."""

    sent: AckInFlight
    requests: list[AckRequest]
    of: dict[str, tuple[OwnedPartition, StreamCursor]]
    partitions: list[OwnedPartition]
    #: the seconds its sending took
    sending_s: float


_NOTHING = Acknowledged({}, 0)


class Durability:
    """Makes committed batches durable: commit, fenced acknowledgement with the backup, confirm."""

    def __init__(
        self,
        acknowledger: Acknowledger,
        group: str,
        hooks: ProcessorHooks,
        tracing: Tracing | None = None,
        sends: SendsAcks | None = None,
    ) -> None:
        self.acknowledger = acknowledger
        self.group = group
        self.hooks = hooks
        #: a span per commit; None: no tracer provider configured (``tracing.configured``)
        self.tracing = tracing
        #: with it, an acknowledgement's reply is read by the next one (``settle``), not waited for
        self.sends = sends
        self._in_flight: _InFlight | None = None

    def commit(self, batch: PartitionBatch, outcomes: list[StreamOutcome]) -> float | None:
        """Step 5 for one partition; the seconds it took, None when there was nothing to write."""
        tracing = self.tracing
        started_ns = 0 if tracing is None else time.time_ns()
        took = batch.commit(outcomes)
        if took is not None:
            call_hook(self.hooks.on_commit, batch.owned.partition, took)
            if tracing is not None:
                topics = sorted({o.cursor.topic for o in outcomes})
                counts = [(o.handled, o.skipped, len(o.dead)) for o in outcomes]
                totals = (sum(c[0] for c in counts), sum(c[1] for c in counts), sum(c[2] for c in counts))
                tracing.commit(batch.owned.partition, topics, totals, started_ns)
        for o in outcomes:  # with nothing to write, the entries done are reported all the same
            if took is not None or o.handled or o.skipped:
                c = o.cursor
                call_hook(self.hooks.on_batch_committed, c.topic, c.partition, o.handled, o.skipped)
        return took

    def commit_alone(self, batch: PartitionBatch) -> tuple[str, LeaseLost] | None:
        """Commit a batch of no entries (time's work) and flush it: ``flush``'s answer.

        Only once ``settle`` read the acknowledgement in flight.
        """
        if self.commit(batch, []) is None:
            return None
        return flush(batch.owned)

    def acknowledge(self, done: list[tuple[PartitionBatch, list[StreamOutcome]]]) -> Acknowledged:
        """Step 6: acknowledge committed batches; each backup's update travels with the first call.

        Per partition, the call of the backup's stream carries the backup update (also with
        nothing to acknowledge). Where an app reads several topics, the other topics' calls go in
        a second round trip, only for the partitions whose backup call succeeded. The outbox rows
        of a partition whose first call succeeded are confirmed in between.

        With ``sends``, a call of one round trip is sent and its reply left to the next
        ``acknowledge`` (or ``settle``), so the server applies it while the next batch is read
        and handled; what is returned then is the previous call's outcome. The next call is
        built only once the previous reply is read: the backup's updates stay in order.
        """
        settled = self.settle()
        done = [(batch, outcomes) for batch, outcomes in done if batch.owned.partition not in settled.lost]
        merged: dict[str, tuple[list[bytes], list[tuple[bytes, Fields]]]] = {}
        for _, stream_outcomes in done:
            for o in stream_outcomes:
                ids, dead = merged.setdefault(o.cursor.stream, ([], []))
                ids += o.ack_ids
                dead += o.dead
        first: list[AckRequest] = []
        then: list[AckRequest] = []
        of: dict[str, tuple[OwnedPartition, StreamCursor]] = {}
        for batch, _ in done:
            owned = batch.owned
            backup = owned.backup
            for c in owned.streams.values():
                of[c.stream] = (owned, c)
                ids, dead = merged.get(c.stream, ([], []))
                if backup is not None and c.stream == backup.stream:
                    first.append(backup.request(ids, c.dlq, dead))
                elif ids or dead:
                    request = AckRequest(c.stream, self.group, c.lease_key, c.lease_value, ids, c.dlq, dead)
                    (then if backup is not None else first).append(request)
        first = [r for r in first if r.ids or r.dead or r.backup is not None]
        if not first and not then:
            return settled
        call_hook(self.hooks.on_acknowledging, {r.stream: len(r.ids) + len(r.dead) for r in [*first, *then]})
        started = time.perf_counter()
        sends = self.sends
        if sends is not None and not then:
            sent = self._sent(first, of, partial(sends.ack_sent, first))
            partitions = [batch.owned for batch, _ in done]
            self._in_flight = _InFlight(sent, first, of, partitions, time.perf_counter() - started)
            return settled
        acked = self._send(first, of, backups=True)
        for batch, _ in done:
            if batch.owned.partition not in acked.lost:  # its rows are in the backup, under the lease
                batch.owned.confirmed()
        more = self._send([r for r in then if of[r.stream][0].partition not in acked.lost], of)
        call_hook(self.hooks.on_ack, time.perf_counter() - started)
        return settled.merged(acked).merged(more)

    def settle(self) -> Acknowledged:
        """Read the acknowledgement in flight, if any: its outcome, its outbox rows confirmed.

        Called before anything else is sent for the partitions (a flush, a hand-over, the end).
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return _NOTHING
        started = time.perf_counter()
        replies = self._sent(in_flight.requests, in_flight.of, in_flight.sent.result)
        acked = self._outcome(in_flight.requests, replies, in_flight.of)
        for owned in in_flight.partitions:
            if owned.partition not in acked.lost:  # its rows are in the backup, under the lease
                owned.confirmed()
        call_hook(self.hooks.on_ack, in_flight.sending_s + time.perf_counter() - started)
        return acked

    def abandon(self) -> None:
        """Leave the acknowledgement in flight unread (a lost connection, the end): it may have run."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.sent.abandon()
            _not_sent(in_flight.requests, in_flight.of)

    def _send(
        self,
        requests: list[AckRequest],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
        backups: bool = False,
    ) -> Acknowledged:
        """One pipelined round trip of acknowledging calls."""
        if not requests:
            return _NOTHING
        call = partial(self.acknowledger.ack, requests)
        replies = self._sent(requests, of, call) if backups else call()
        return self._outcome(requests, replies, of)

    def _sent(
        self,
        requests: list[AckRequest],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
        call: Callable[[], _T],
    ) -> _T:
        """``call``'s answer; if it fails, the calls may not have run: their backup writes go again."""
        try:
            return call()
        except BaseException:
            _not_sent(requests, of)
            raise

    def _outcome(
        self,
        requests: list[AckRequest],
        replies: list[tuple[int, int] | LeaseLost],
        of: dict[str, tuple[OwnedPartition, StreamCursor]],
    ) -> Acknowledged:
        """What the calls' replies come to: the partitions refused, the DLQ moves confirmed."""
        lost: dict[int, tuple[str, LeaseLost]] = {}
        dead_lettered = 0
        for request, reply in zip(requests, replies, strict=True):
            owned, cursor = of[request.stream]
            backup = owned.backup
            if isinstance(reply, BackupDamaged) and backup is not None:
                reply = backup.repaired(request)
            if isinstance(reply, LeaseLost):
                lost[owned.partition] = (request.stream, reply)
                continue
            if request.backup is not None and backup is not None:
                backup.sent()
            if request.dead:
                dead_lettered += reply[1]
                self._forget_dead(owned, cursor.topic, request.dead)
        return Acknowledged(lost, dead_lettered)

    def _forget_dead(self, owned: OwnedPartition, topic: str, dead: Sequence[tuple[bytes, Fields]]) -> None:
        """The DLQ moves are confirmed: drop their records (a crash first only repeats a no-op)."""
        with owned.store.transaction() as tx:
            for entry_id, fields in dead:
                tx.delete(keys.DEAD_NAMESPACE, entry_name(topic, entry_id))
                owned.dead.pop(entry_name(topic, entry_id), None)
                log.error(
                    "entry moved to the DLQ topic=%s partition=%s id=%s error=%s",
                    topic,
                    owned.partition,
                    entry_id.decode(),
                    fields.get(b"error_type", b"").decode(),
                )
                call_hook(self.hooks.on_dead_letter, DeadLetter.from_fields(fields))


def _not_sent(requests: list[AckRequest], of: dict[str, tuple[OwnedPartition, StreamCursor]]) -> None:
    """The calls may not have run: their backups send their writes again with the next call."""
    for request in requests:
        backup = of[request.stream][0].backup
        if request.backup is not None and backup is not None:
            backup.not_sent()


def flush(owned: OwnedPartition) -> tuple[str, LeaseLost] | None:
    """Make what the partition's store committed durable without acknowledging anything.

    Its journaled writes go to the state backup under the lease, then its outbox rows may be
    published. Returns (stream, why) when the lease (or the backup) refused: the store is then
    ahead of the backup, and the partition's next owner reconciles them.
    """
    backup = owned.backup
    if backup is not None:
        try:
            backup.flush()
        except LeaseLost as exc:
            return backup.stream, exc
    owned.confirmed()
    return None
