"""Test an app without a server: ``TestApp`` runs it in-process, synchronously, on a clock you move.

What Kafka Streams' TopologyTestDriver is to a topology. ``TestApp`` drives the worker's own parts
over the entries a test sends: the entry codec, the worker's attempt loop (``attempts``: sync and
async handlers, timeouts, the retry policy and its dead-letter decisions), ``ctx.emit``'s checks
and encoding, windows, scheduled callbacks, timers and state expiry, and the worker's commit and
acknowledgement (``durability.Durability``) on an in-memory store per partition. What it replaces is
Redis: no consumer groups, leases or relay; the acknowledgement is a stand-in that keeps the dead
letters; a failed attempt is retried at once instead of after its backoff.

Example:
    with TestApp(app, topics={"vip-customers": 1}) as t:
        t.send("orders", {"amount": 120}, key="u1")
        assert t.state("u1") == {"total": 120, "count": 1}
        assert t.emitted("vip-customers") == [{"user": "u1"}]

An entry gets the id Redis would give it at the test clock's time (``now_ms``); ``advance`` moves
the clock, runs the timer periods and expiry it makes due and closes the windows of partitions idle
for ``PSPF_WINDOW_IDLE_CLOSE_MS``. Entries the app emits to a topic it reads are handled in turn,
as a worker would read them. For tests against a real server, the pytest plugin
(``pspf.pytest_plugin``) gives the ``pspf_server`` and ``pspf_settings`` fixtures.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from pspf import codec, keys
from pspf.app import App
from pspf.broker import AckRequest
from pspf.cycle.attempts import Attempts
from pspf.cycle.execution import Entry
from pspf.cycle.timekeeping import Clock, TimeKeeping
from pspf.errors import ConfigError, LeaseLost, NotFound
from pspf.failures import DeadLetter, Outcome, policy_from
from pspf.hooks import Counts, CycleResult, ProcessorHooks
from pspf.keys import StreamId
from pspf.observability.tracing import configured
from pspf.outbox.emit import Emitter
from pspf.outbox.partition_outbox import PartitionOutbox
from pspf.outbox.views import PartitionViews
from pspf.partition.batch import PartitionBatch, StreamOutcome
from pspf.partition.durability import Durability
from pspf.partition.owned import OwnedPartition, Read, StreamCursor
from pspf.settings import Settings
from pspf.state_stores.memory import MemoryStore
from pspf.tables.global_tables import GlobalTables
from pspf.tables.lookups import Lookups
from pspf.windows.timers import ms_of

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["EmittedEntry", "TestApp"]

#: the consumer name the DLQ records of a TestApp carry
CONSUMER = "test"
#: rounds of ``advance`` at most (each runs up to 100 periods of every timer)
_MAX_ROUNDS = 10_000


class EmittedEntry(msgspec.Struct, frozen=True):
    """An entry the app emitted (a handler's ``ctx.emit``, a timer's, or a window's result)."""

    topic: str
    partition: int
    key: str | None
    #: decoded from JSON; bytes emitted as bytes stay bytes when they are not JSON
    value: Any
    headers: dict[str, str]


class _Clock(Clock):
    """The test's clock: wall-clock and monotonic time move together, only when told to."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def wall_ms(self) -> int:
        return self.now_ms

    def monotonic(self) -> float:
        return self.now_ms / 1000


class _Topics:
    """The partition counts ``ctx.emit`` looks up (a worker asks Redis)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def topic_layout(self, topic: str) -> tuple[int, str, bool]:
        if topic not in self.counts:
            raise NotFound(
                f"topic {topic!r} does not exist; declare it: TestApp(app, topics={{{topic!r}: 1}})"
            )
        return self.counts[topic], "0", False


class TestApp:
    """Runs ``app`` over the entries a test sends, in-process; read state, emits and dead letters.

    ``partitions``: the partition count of the app's topics; ``topics``: more topics (those its
    handlers emit to) or other counts. ``start``: the clock's time (epoch ms or an aware datetime;
    default 2024-01-01T00:00:00Z). ``settings``: the retry policy and idle-close time of a run
    (``Settings.load()`` defaults, without reading the environment, when not given).
    ``tracer_provider``: an OpenTelemetry provider to trace the run with, as a worker traces with
    the global one (which is used when none is given and one is set up).
    """

    __test__ = False  # a harness, not a test class for pytest to collect

    def __init__(
        self,
        app: App,
        *,
        partitions: int = 1,
        topics: Mapping[str, int] | None = None,
        start: int | datetime = 1_704_067_200_000,
        settings: Settings | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if not app.handlers:
            raise ConfigError(f"app {app.name!r} has no handlers")
        app.compile()
        settings = settings or Settings.load({}, environ={})
        self.app = app
        counts = dict.fromkeys([*app.topics, *app.global_tables], partitions)
        counts.update(dict.fromkeys((w.emit_to for w in app.windows.values() if not w.chained), partitions))
        counts.update(dict.fromkeys(app.dataflow.outputs, partitions))
        counts.update(topics or {})
        if len({counts[topic] for topic in app.topics}) > 1:
            raise ConfigError(f"the topics of app {app.name!r} must have the same partition count")
        for topic, count in counts.items():
            keys.check_name("topic", topic)
            if count < 1:
                raise ConfigError(f"topic {topic!r}: partitions must be at least 1, got {count}")
        self.partitions = counts[app.topics[0]]
        self._topics = _Topics(counts)
        self._clock = _Clock(_epoch_ms("start", start))
        run_policy = policy_from(settings.retry)
        self._policies = {topic: h.retry.over(run_policy) for topic, h in app.handlers.items()}
        self._hooks = app.hooks or ProcessorHooks()
        self._emitter = Emitter(self._topics, app.name)
        self._time = TimeKeeping(
            app, self._emitter, self._hooks, settings.time.idle_close_ms / 1000, self._clock
        )
        tracing = configured(app.name, tracer_provider)
        self._attempts = Attempts(app, CONSUMER, self._emitter, self._policies, tracing)
        self._lookups = _lookups(app, self.partitions, counts)
        self._time.lookups = self._lookups
        self._acks = _Acknowledgements()
        self._durability = Durability(self._acks, app.name, self._hooks, tracing)
        self._owned = {p: self._partition(p) for p in range(self.partitions)}
        self._round_robin = itertools.cycle(range(self.partitions))  # keyless entries, as Producer
        self._last_ids: dict[str, StreamId] = {}
        self._queue: deque[tuple[str, int, bytes, dict[bytes, bytes]]] = deque()
        self._emitted: dict[str, list[EmittedEntry]] = {}
        #: each view's fields (or members) as Redis would hold them
        self._views: dict[str, dict[str, Any]] = {name: {} for name in app.views}
        #: what the run did: entries handled, failed attempts, dead letters, late entries, ...
        self.counts = Counts()

    def _partition(self, partition: int) -> OwnedPartition:
        store = MemoryStore()
        streams = {
            topic: StreamCursor(
                topic,
                partition,
                keys.stream_key(topic, partition),
                keys.dlq_key(topic, partition),
                keys.lease_key(topic, partition, self.app.name),
                CONSUMER,
                None,
            )
            for topic in self.app.topics
        }
        outbox = PartitionOutbox(store, self.app.name, partition, CONSUMER)
        owned = OwnedPartition(partition, store, streams, outbox)
        self._time.load(owned)
        if self.app.views:
            owned.views = PartitionViews(self.app.views)
        return owned

    # -- the test's side ----------------------------------------------------------------------

    @property
    def now_ms(self) -> int:
        """The clock: the time of the next entry's id, and what timers and expiry go by."""
        return self._clock.now_ms

    def send(
        self,
        topic: str,
        value: Any,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> str:
        """Send one entry as ``Producer.send`` would, and handle it (and what it leads to) now.

        Returns its id. Without a key, entries go to the partitions in turn.
        """
        return self.send_fields(topic, codec.entry_fields(codec.encode_value(value), key, headers))

    def send_fields(self, topic: str, fields: Mapping[bytes, bytes]) -> str:
        """Send an entry's raw stream fields (what a producer in another language writes)."""
        if topic not in self.app.handlers and topic not in self.app.global_tables:
            raise ConfigError(f"app {self.app.name!r} has no handler for topic {topic!r} (nor a table of it)")
        fields = dict(fields)
        raw_key = fields.get(codec.KEY)
        count = self._topics.topic_layout(topic)[0]
        partition = next(self._round_robin) % count if raw_key is None else keys.partition_for(raw_key, count)
        entry_id = self._append(topic, partition, fields)
        self._drain()
        return entry_id.decode()

    def advance(self, by: timedelta | None = None, *, to: int | datetime | None = None) -> None:
        """Move the clock ``by`` a duration or ``to`` a time, and run what it makes due.

        Timer periods (each once, in order), state that expired, and the windows of partitions
        with no entry for ``PSPF_WINDOW_IDLE_CLOSE_MS``; then whatever their emits lead to.
        """
        if (by is None) == (to is None):
            raise ConfigError("advance takes either by= or to=")
        if by is not None:
            target = self._clock.now_ms + ms_of("by", by)
        else:
            assert to is not None
            target = _epoch_ms("to", to)
        if target < self._clock.now_ms:
            raise ConfigError(f"the clock only moves forward: {target} is before {self._clock.now_ms}")
        self._clock.now_ms = target
        for _ in range(_MAX_ROUNDS):
            result = CycleResult()
            for batch in self._time.passes(list(self._owned.values()), set(), result):
                self._settle(batch, [], result)
            self.counts.add(result)
            self._drain()
            if not (result.timers_run or result.timers_failed):
                return

    def state(self, key: str) -> dict[str, Any]:
        """The committed state of ``key`` (``{}`` when it has none), decoded with the app's state type."""
        raw = self._store_of(key).get(keys.STATE_NAMESPACE, key)
        return {} if raw is None else self.app.state_decoder.decode(key, raw)

    def table(self, name: str, key: str) -> Any:
        """The committed row of ``key`` in table (or global table) ``name``; None when it has none."""
        lookups = self._lookups
        if lookups is None:
            raise ConfigError(f"app {self.app.name!r} declares no tables")
        table = lookups.table(name, "TestApp.table")
        if table.is_global:
            assert lookups.global_tables is not None
            return table.row(lookups.global_tables.row(name, key))
        return table.row(self._store_of(key).get(keys.TABLES_NAMESPACE, keys.table_key(name, key)))

    def keys(self) -> list[str]:
        """Every key that has state, in order."""
        return sorted(
            key for owned in self._owned.values() for key, _ in owned.store.items(keys.STATE_NAMESPACE)
        )

    def view(self, name: str) -> dict[str, Any]:
        """View ``name`` as Redis holds it: field -> value text (a hash), member -> score (a zset)."""
        if name not in self._views:
            raise ConfigError(f"app {self.app.name!r} has no view {name!r}")
        return dict(self._views[name])

    def emitted(self, topic: str) -> list[Any]:
        """The values emitted to ``topic`` so far, in the order they were committed."""
        return [entry.value for entry in self.emitted_entries(topic)]

    def emitted_entries(self, topic: str) -> list[EmittedEntry]:
        """The entries emitted to ``topic`` so far, with their keys, partitions and headers."""
        self._topics.topic_layout(topic)
        return list(self._emitted.get(topic, []))

    def dead_letters(self, topic: str | None = None) -> list[DeadLetter]:
        """The DLQ records of the entries (of ``topic``, or all) that failed for good, in order."""
        return [d for d in self._acks.dead if topic is None or d.source_topic == topic]

    def close(self) -> None:
        self._attempts.close()

    def __enter__(self) -> TestApp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the worker's side --------------------------------------------------------------------

    def _store_of(self, key: str) -> MemoryStore:
        store = self._owned[keys.partition_for(key.encode(), self.partitions)].store
        assert isinstance(store, MemoryStore)
        return store

    def _append(self, topic: str, partition: int, fields: dict[bytes, bytes]) -> bytes:
        """Add an entry to a stream at the clock's time, with the id Redis would give it."""
        stream = keys.stream_key(topic, partition)
        last = self._last_ids.get(stream)
        now = self._clock.now_ms
        entry_id = StreamId(now, 0) if last is None or now > last.ms else StreamId(last.ms, last.seq + 1)
        self._last_ids[stream] = entry_id
        id_b = str(entry_id).encode()
        self._queue.append((topic, partition, id_b, fields))
        return id_b

    def _drain(self) -> None:
        while self._queue:
            topic, partition, id_b, fields = self._queue.popleft()
            if topic in self.app.global_tables:  # a worker follows it between batches
                assert self._lookups is not None and self._lookups.global_tables is not None
                self._lookups.global_tables.apply([(keys.stream_key(topic, partition), [(id_b, fields)])])
            else:
                self._handle(topic, partition, id_b, fields)

    def _handle(self, topic: str, partition: int, id_b: bytes, fields: dict[bytes, bytes]) -> None:
        """One entry as a batch of its own, through the worker's attempt loop and commit.

        A failed attempt is committed as a worker commits it, then tried again at once (a parked
        entry as due) until it is handled or dead.
        """
        owned = self._owned[partition]
        cursor = owned.streams[topic]
        due = False
        for attempt in itertools.count(1):
            result = CycleResult(read=1 if attempt == 1 else 0)
            entries: list[Entry] = [(id_b, fields)]
            read = Read(cursor, list(entries), {id_b: attempt}, due=due)
            batch = PartitionBatch(owned, self.app.state_decoder, self._emitter, self._lookups)
            attempted = self._attempts.run(batch, read, entries, self._time.clock(batch, topic, result))
            attempted.report(result, self._hooks, topic, partition)
            self._time.entries_done(batch, topic, entries, attempted.last_done)
            if owned.keeps_time:
                self._time.advance(batch, result)
            self._settle(batch, [attempted.outcome(read, [], [], 0)], result)
            self.counts.add(result)
            if not attempted.failed or attempted.failed[-1][1] is Outcome.DEAD:
                return
            due = attempted.failed[-1][1] is Outcome.PARKED

    def _settle(self, batch: PartitionBatch, outcomes: list[StreamOutcome], result: CycleResult) -> None:
        """Commit and acknowledge as a worker does; what the batch emitted is then published here."""
        emitted, batch.emitted = batch.emitted, []
        if outcomes:
            self._durability.commit(batch, outcomes)
            result.dead_lettered += self._durability.acknowledge([(batch, outcomes)]).dead_lettered
        else:
            self._durability.commit_alone(batch)
        for topic, partition, key, value, _, _, headers in emitted:
            self._publish(topic, partition, key, value, headers)
        views = batch.owned.views
        if views is not None and views.ready:
            upto, writes = views.take()
            for view, fields in writes.items():
                held = self._views[view]
                for field, written in fields.items():
                    name = field.decode(errors="replace") if isinstance(field, bytes) else field
                    if written is None:
                        held.pop(name, None)
                    elif isinstance(written, bytes):
                        held[name] = written.decode()
                    else:  # a hash's int is its digits in Redis; a score stays a float
                        held[name] = str(written) if type(written) is int else written
            views.written(upto)

    def _publish(
        self, topic: str, partition: int, key: bytes | None, value: bytes, headers: bytes | None
    ) -> None:
        try:
            decoded: Any = msgspec.json.decode(value)
        except msgspec.DecodeError:
            decoded = value
        entry = EmittedEntry(
            topic,
            partition,
            None if key is None else key.decode(),
            decoded,
            codec.decode_headers(headers),
        )
        self._emitted.setdefault(topic, []).append(entry)
        if topic in self.app.handlers or topic in self.app.global_tables:
            fields = {codec.VALUE: value}
            if key is not None:
                fields[codec.KEY] = key
            if headers is not None:
                fields[codec.HEADERS] = headers
            self._append(topic, partition, fields)


class _Acknowledgements:
    """What stands in for Redis's acknowledgement: no lease to lose, dead letters kept in order."""

    def __init__(self) -> None:
        self.dead: list[DeadLetter] = []

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        for request in requests:
            self.dead += [DeadLetter.from_fields(fields) for _, fields in request.dead]
        return [(len(request.ids), len(request.dead)) for request in requests]


def _lookups(app: App, partitions: int, counts: dict[str, int]) -> Lookups | None:
    """The app's tables for the test's batches; its global tables in memory."""
    if not (app.tables or app.global_tables):
        return None
    global_tables = None
    if app.global_tables:
        global_tables = GlobalTables(app.global_tables.values(), MemoryStore(), None, counts)
    return Lookups({**app.tables, **app.global_tables}, partitions, global_tables)


def _epoch_ms(name: str, value: int | datetime) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigError(f"{name}: the datetime {value.isoformat()!r} has no time zone")
        return int(value.timestamp() * 1000)
    if isinstance(value, int) and value >= 0:
        return value
    raise ConfigError(f"{name} must be epoch milliseconds or an aware datetime, not {value!r}")
