"""Sinks: deliver a topic into an external store, each entry's effect once; the transactional tier.

Sinks come in two tiers named by their guarantee. A transactional sink (``TransactionalSink``,
here) writes its rows and its checkpoints in one transaction of the target; an idempotent sink
(``IdempotentSink``, in ``pspf.sink.idempotent``) writes batches under names that are
deterministic in the entries they hold, so a rewrite replaces. Both are this ``Sink``.

A sink is an ordinary PSPF consumer (its own group, leases, work sharing, the DLQ, metrics and
``pspf lag``): a ``Worker`` running an app whose one handler stages each entry as a
``SinkRecord``. What makes it exactly once is its store: ``SinkStore`` is the partition's
``StateStore``, and each of its commits (the staged records, the processor's bookkeeping and the
new checkpoints) is ONE transaction of the external store, made by the sink's
``SinkPartition``. The external store thus plays the part the state store plays for an app, and
the commit protocol is unchanged: commit, then acknowledge. The state backup is off (the
database is durable and every worker reaches it), so a takeover reads the checkpoints from the
database and needs no local state.

A ``SinkPartition`` fences earlier owners in its own transactions (``claim`` takes the partition
over; a commit of a worker that was taken over writes nothing), so a worker that lost its lease
cannot write after its successor started.

Failures: a commit that cannot reach the database raises ``SinkUnavailable``; the worker backs
off and reads the batch again (nothing was acknowledged). A commit whose rows the database
refuses (a constraint, a value it cannot take) writes nothing either: the partition finds the
rows it refuses (``RowsRefused``), the batch is read again, and those entries fail with the
database's error (``SinkRefused``, not retried) and go to the DLQ; the others are written. A store
that no longer holds what the checkpoints say was delivered (``SinkTargetChanged``: a table
dropped or truncated) stops the worker: ``pspf sink reset`` delivers the topic again.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from pspf.app import App
from pspf.context import Context
from pspf.errors import NonRetryableError, SinkUnavailable, StateError
from pspf.keys import StreamId
from pspf.settings import Settings
from pspf.state_stores.memory import MemoryStore
from pspf.worker.process import RunSummary, Worker

log = logging.getLogger("pspf.sink")

#: (namespace, key) -> value, None deleting: what the processor commits besides the records
Updates = Mapping[tuple[str, str], bytes | None]


class SinkRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One entry as a sink writes it."""

    topic: str
    partition: int
    #: the entry's stream id, ``<ms>-<seq>``
    entry_id: str
    #: None for a keyless entry
    key: str | None
    #: the decoded value (JSON-ready)
    value: Any
    headers: dict[str, str]


class SinkRefused(NonRetryableError):
    """The external store refused this entry's row: the entry goes to the DLQ with its error."""


class RowsRefused(Exception):
    """A commit's rows the external store refused, by (topic, entry id): nothing was written."""

    def __init__(self, rows: Mapping[tuple[str, str], str]) -> None:
        super().__init__(f"{len(rows)} rows refused")
        self.rows = dict(rows)


class SinkPartition(ABC):
    """One topic partition's connection to the external store."""

    @abstractmethod
    def claim(self) -> tuple[dict[tuple[str, str], bytes], dict[str, StreamId]]:
        """Take the partition over (fencing out earlier owners); its bookkeeping and checkpoints."""

    @abstractmethod
    def commit(
        self, records: Sequence[SinkRecord], updates: Updates, checkpoints: Mapping[str, StreamId]
    ) -> None:
        """Write ``records``, ``updates`` and ``checkpoints`` in ONE transaction, if still the owner.

        Raises:
            SinkUnavailable: unreachable, or taken over by another worker: nothing was written.
            RowsRefused: rows the store refuses: nothing was written.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the connection."""


class Sink(ABC):
    """An external store a topic is delivered into: the consumer machinery both tiers share.

    Subclass ``TransactionalSink`` or ``IdempotentSink`` (the tier says the guarantee); a direct
    subclass of ``Sink`` is held to the transactional contract.
    """

    #: the sink's consumer group: its own position in the topic, its own DLQ decisions
    name: str
    #: the guarantee the sink's target gives (``transactional`` or ``idempotent``)
    tier: ClassVar[str] = "transactional"

    @abstractmethod
    def prepare(self) -> None:
        """Create (or check) what the store needs, once, before a partition is opened."""

    @abstractmethod
    def partition(self, partition: int) -> SinkPartition:
        """Connect one topic partition."""

    def describe(self) -> str:
        """What the sink delivers into, for operators (``pspf topic repartition`` names it)."""
        return type(self).__name__

    def record(self, value: Any, ctx: Context) -> SinkRecord:
        """The record of one entry; raise ``SinkRefused`` for an entry the store cannot take."""
        return SinkRecord(
            topic=ctx.topic,
            partition=ctx.partition,
            entry_id=ctx.entry_id.decode(),
            key=ctx.key or None,  # a keyless entry's key is empty
            value=value,
            headers=ctx.headers,
        )

    def worker(self, topic: str, settings: Settings) -> Worker:
        """A worker delivering ``topic``: the state backup and standby off, the stores the sink's.

        A missing topic is refused before the store is touched. A store that cannot be reached
        yet is waited for: the worker prepares it before its first partition, backing off as it
        does for Redis.
        """
        stores: dict[int, SinkStore] = {}
        prepared, marked = threading.Event(), threading.Event()

        def open_store(group: str, partition: int) -> SinkStore:
            if not prepared.is_set():
                self.prepare()
                prepared.set()
            if not marked.is_set():  # the app is recorded by now: say it is a sink
                worker.broker.apps.mark_sink(self.name, self.describe())
                marked.set()
            stores[partition] = SinkStore(self.partition(partition))
            return stores[partition]

        app = App(self.name)

        @app.handler(topic)
        def deliver(value: Any, ctx: Context) -> None:
            stores[ctx.partition].stage(self.record(value, ctx))

        state = msgspec.structs.replace(settings.state, backup="off", standby=False)
        worker = Worker(app, msgspec.structs.replace(settings, state=state), store_factory=open_store)
        try:
            worker.broker.topics.topic_partitions(topic)
            self.prepare()
            prepared.set()
        except SinkUnavailable as exc:
            log.warning("sink %s: %s; waiting for it (retrying with backoff)", self.name, exc)
        except BaseException:
            worker.broker.close()
            raise
        return worker

    def run(self, topic: str, settings: Settings, until_idle: bool = False) -> RunSummary:
        """Deliver ``topic`` until stopped (or, with ``until_idle``, until nothing is left)."""
        return self.worker(topic, settings).run(until_idle=until_idle)


class TransactionalSink(Sink):
    """The transactional tier: rows and checkpoints in ONE transaction of the target.

    ``partition(n)`` returns a ``SinkPartition`` whose ``claim`` reads the checkpoints back at
    takeover and whose ``commit`` writes the rows with them (``PostgresSink`` is one).
    """

    tier: ClassVar[str] = "transactional"


class SinkStore(MemoryStore):
    """A partition's state store whose commits are transactions of the external store.

    The bookkeeping and checkpoints are kept in memory too (read at takeover from the store);
    the records staged by the handler go out with the next commit.
    """

    def __init__(self, partition: SinkPartition) -> None:
        super().__init__()
        self.sink_partition = partition
        values, checkpoints = partition.claim()
        super().write(values, checkpoints)
        self._staged: dict[tuple[str, str], SinkRecord] = {}
        #: (topic, entry id) -> the store's error, for entries the last commit found refused
        self._refused: dict[tuple[str, str], str] = {}

    def stage(self, record: SinkRecord) -> None:
        """Add one handled entry's record to the next commit; a refused one fails its entry."""
        name = (record.topic, record.entry_id)
        refused = self._refused.pop(name, None)
        if refused is not None:
            raise SinkRefused(refused)
        self._staged[name] = record  # an entry read again replaces its record

    def write(self, updates: Updates, checkpoints: Mapping[str, StreamId]) -> None:
        records = list(self._staged.values())
        self._staged.clear()  # a failed commit is read again, and staged again
        try:
            self.sink_partition.commit(records, updates, checkpoints)
        except RowsRefused as exc:
            self._refused.update(exc.rows)
            raise SinkUnavailable(
                f"the sink's database refused {len(exc.rows)} of {len(records)} rows; reading the "
                "batch again, their entries go to the DLQ"
            ) from None
        super().write(updates, checkpoints)

    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        raise StateError("a sink's checkpoints live in its database: replay and reset do not move them")

    def close(self) -> None:
        self.sink_partition.close()
