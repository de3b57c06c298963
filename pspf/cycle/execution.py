"""Running handlers over a stream's entries: sync in id order, async concurrently per key.

An attempt's state writes are kept apart until it returns; the processor decides what a failure
means (retry, park, dead-letter). Deadlines: an async handler past its ``timeout_ms`` is cancelled;
a sync handler with a timeout runs in a helper thread, and when it overruns its attempt fails
with ``HandlerTimeout`` and its state writes are dropped, but the function itself runs on in the
background until it returns (Python cannot stop a thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import codec, keys
from pspf.app import Handler
from pspf.codec import StateDecoder
from pspf.context import Context, StateSource
from pspf.errors import DecodeError, StateError, StateValueError, WrongPartition
from pspf.failures import HandlerTimeout, PoisonEntry
from pspf.observability.tracing import TracedContext, Tracing, sync_run
from pspf.outbox.emit import Emitted, Emitter
from pspf.outbox.views import ViewWrite, bind
from pspf.windows.aggregation import PartitionWindows
from pspf.windows.timers import PartitionTimers, ScheduledCall

if TYPE_CHECKING:
    from pspf.partition.batch import PartitionBatch

#: Marks an attempt that left its key's state untouched.
UNCHANGED = b"\x00unchanged"

Entry = tuple[bytes, dict[bytes, bytes]]


#: Keys a worker remembers as checked, shared by its partitions: past its share a partition's
#: memory starts again, so that a large key space costs a check per entry rather than memory.
KNOWN_KEYS_LIMIT = 50_000
#: The least share of a partition, however many the worker runs.
KNOWN_KEYS_MIN_SHARE = 1_000


class EntryMeta(NamedTuple):
    """What the runner needs besides the entries: where they come from, how often delivered."""

    topic: str
    partition: int
    counts: dict[bytes, int]
    #: entries delivered too often with no outcome: they go to the DLQ without running
    poison: frozenset[bytes]
    max_deliveries: int
    #: the handler's deadline from its whole policy (code, flags, variables); None: no deadline
    timeout_ms: int | None = None
    #: the topic's partition count, to check that a keyed entry is in its key's partition;
    #: 0: not checked
    partitions: int = 0
    #: the keys already checked (text, in this partition): raw -> text; None: check every entry
    known: dict[bytes, str] | None = None
    #: spans of the attempts (``pspf.observability.tracing``); None: no tracer provider, no tracing work
    tracing: Tracing | None = None
    #: the most keys ``known`` holds: this partition's share of ``KNOWN_KEYS_LIMIT``
    known_limit: int = KNOWN_KEYS_LIMIT


#: What an async handler's attempt that returned did: (key, new state or UNCHANGED, emits, schedules).
AsyncResult = tuple[
    str, bytes | None, list[Emitted] | None, list[ScheduledCall] | None, list[ViewWrite] | None
]

#: Called with an entry's index and error; True stops the run (the rest of the stream waits).
StopRule = Callable[[int, BaseException], bool]


def entry_key(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(codec.KEY)
    if raw is None:
        return ""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise DecodeError("the entry key is not valid UTF-8") from None


def _checked_key(meta: EntryMeta, raw: bytes) -> str:
    """A key seen for the first time: text, and in this partition; then remembered in ``known``."""
    try:
        key = raw.decode()
    except UnicodeDecodeError:  # whoever wrote it: the entry cannot be handled
        raise DecodeError("the entry key is not valid UTF-8") from None
    if meta.partitions:
        home = keys.partition_for(raw, meta.partitions)
        if home != meta.partition:
            raise WrongPartition(
                f"key {key!r} belongs to partition {home} of topic {meta.topic!r} (CRC32 of the key "
                f"mod {meta.partitions} partitions) but the entry is in partition {meta.partition}: "
                "its producer partitions keys another way"
            )
    known = meta.known
    if known is not None:
        if len(known) >= meta.known_limit:
            known.clear()
        known[raw] = key
    return key


def state_result(ctx: Context) -> bytes | None:
    """The key's new encoded state after a handler returned, UNCHANGED if untouched.

    A new state is read back the way the app reads it (its decoder, its state type): one it could
    not read, such as a ``ctx.state`` key that is not a string, would fail every later entry of
    the key, so this entry fails instead, without retries (``StateValueError``).
    """
    state = ctx.loaded
    if state is None:
        return UNCHANGED
    if not state:
        return UNCHANGED if ctx.base is None else None
    try:
        new = _encode_state(state)
    except (TypeError, OverflowError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise StateValueError(f"state of key {ctx.key!r} cannot be encoded: {exc}") from exc
    if new == ctx.base:
        return UNCHANGED
    decoder = ctx.source.state_decoder
    try:
        decoder.check(ctx.key, state, new)
    except StateError:
        raise StateValueError(codec.unreadable_state(ctx.key, state, decoder.decode)) from None
    return new


_encode_state = codec.state_encoder.encode


def _context(meta: EntryMeta, id_b: bytes, fields: dict[bytes, bytes], source: StateSource) -> Context:
    counts = meta.counts
    count = counts.get(id_b, 1) if counts else 1
    if meta.poison and id_b in meta.poison:
        raise PoisonEntry(
            f"delivered {count} times without an outcome (max_deliveries {meta.max_deliveries}): "
            "it may crash the worker"
        )
    if type(fields) is not dict and isinstance(fields, codec.RepeatedFields):
        raise DecodeError(fields.problem)
    raw = fields.get(codec.KEY)
    known = meta.known
    if raw is None:
        key = ""
    elif known is None or (key := known.get(raw)) is None:  # type: ignore[assignment]
        key = _checked_key(meta, raw)
    raw_headers = fields.get(codec.HEADERS)  # read only when present: most entries have none
    headers = None if raw_headers is None else codec.decode_headers(raw_headers)
    make = Context if meta.tracing is None else TracedContext
    return make(meta.topic, meta.partition, id_b, key, count, headers, source)


def run_sync(
    handler: Handler,
    meta: EntryMeta,
    todo: list[Entry],
    overlay: dict[str, bytes | None],
    emitted: list[Emitted],
    viewed: list[ViewWrite],
    source: StateSource,
    stop: StopRule,
    passed: Callable[[bytes], None] | None = None,
) -> tuple[int, dict[int, BaseException]]:
    """Run entries in id order; what the successful ones do goes into ``overlay``, ``emitted``, ``viewed``.

    ``passed(id)`` is called after each entry that does not stop the run (scheduled callbacks
    run there, between entries, as stream time passes them). Returns how many entries ran (up
    to and including one whose failure stops the run) and the errors by entry index.
    """
    errors: dict[int, BaseException] = {}
    decode = handler.decoder.decode
    timeout_ms, topic, partition = meta.timeout_ms, meta.topic, meta.partition
    func, passed, make = sync_run(meta.tracing, handler.func, passed)  # per run, not per entry
    # The common entry (delivered once, not poison, a key checked before, no headers) gets its context
    # here; ``_context`` checks the rest, and gives a deadline a source of its own (late writes stay out).
    known = meta.known if not (meta.counts or meta.poison or timeout_ms is not None) else None
    views = bool(source.views)
    for index, (id_b, fields) in enumerate(todo):
        start = len(viewed) if views else 0  # the attempt's view writes start here: cut if it fails
        try:
            if (
                known is not None
                and type(fields) is dict
                and codec.HEADERS not in fields
                and (key := known.get(fields.get(codec.KEY))) is not None  # type: ignore[arg-type]
            ):
                ctx = make(topic, partition, id_b, key, 1, None, source)
            else:
                ctx = _context(meta, id_b, fields, source if timeout_ms is None else _ChainSource(source))
            value = decode(fields)
            if timeout_ms is None:
                func(value, ctx)
            else:
                _call_in_thread(func, value, ctx, timeout_ms)
            new = UNCHANGED if ctx.loaded is None else state_result(ctx)
        except Exception as exc:
            del viewed[start:]  # a deadline's own source (``_ChainSource``) is dropped whole
            errors[index] = exc
            if stop(index, exc):
                return index + 1, errors
            if passed is not None:
                passed(id_b)
            continue
        if new is not UNCHANGED:
            overlay[ctx.key] = new
        if ctx.emitted:
            emitted += ctx.emitted
        if ctx.windowed is not None or ctx.schedules or ctx.source is not source:
            _join_more(ctx, source, viewed)
        if passed is not None:
            passed(id_b)
    return len(todo), errors


def _join_more(ctx: Context, source: StateSource, viewed: list[ViewWrite]) -> None:
    """What a returned attempt did besides state and emits: windows, schedules, views of its own source."""
    if ctx.source is not source:
        viewed += ctx.source.viewed
    if ctx.windowed is not None:
        source.windows.apply(ctx.windowed)
    if ctx.schedules and (timers := source.timers) is not None:
        timers.schedule(ctx.schedules)


def _call_in_thread(func: Callable[..., Any], value: Any, ctx: Context, timeout_ms: int) -> None:
    ctx.state  # noqa: B018 - load the state here: the store belongs to this thread
    outcome: list[BaseException] = []

    def target() -> None:
        try:
            func(value, ctx)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, name="pspf-handler", daemon=True)
    thread.start()
    thread.join(timeout_ms / 1000)
    if thread.is_alive():
        ctx.drop()
        raise HandlerTimeout(f"the handler ran past its timeout of {timeout_ms} ms")
    if outcome:
        raise outcome[0]


class _ChainSource:
    """The state one key's chain of async handlers sees: the batch's, then its own results.

    Its view writes are its own, joined by the runner: also a sync handler's with a deadline.
    """

    __slots__ = ("results", "source", "viewed", "views")

    def __init__(self, source: StateSource) -> None:
        self.source = source
        self.results: dict[str, bytes | None] = {}
        self.viewed: list[ViewWrite] = []
        self.views = bind({name: view.kind for name, view in source.views.items()}, self.viewed)

    def taken(self) -> list[ViewWrite] | None:
        """The view writes of the attempt that just returned (None: none), gone from here."""
        if not self.viewed:
            return None
        found = self.viewed[:]
        self.viewed.clear()
        return found

    def base(self, key: str) -> bytes | None:
        if key in self.results:
            return self.results[key]
        return self.source.base(key)

    @property
    def state_decoder(self) -> StateDecoder:
        return self.source.state_decoder

    @property
    def emitter(self) -> Emitter:
        return self.source.emitter

    @property
    def windows(self) -> PartitionWindows:
        windows: PartitionWindows = self.source.windows
        return windows

    @property
    def timers(self) -> PartitionTimers | None:
        return self.source.timers

    @property
    def table_writes(self) -> Any:
        """The batch's table updates: a table's topic runs sync, here when it has a deadline."""
        return self.source.table_writes  # type: ignore[attr-defined]

    def table_row(
        self, name: str, key: str, before: bytes | None, what: str, check: bool, at: int | None = None
    ) -> Any:
        return self.source.table_row(name, key, before, what, check, at)


def run_async(
    loop: asyncio.AbstractEventLoop,
    handler: Handler,
    meta: EntryMeta,
    todo: list[Entry],
    source: StateSource,
    stop: StopRule,
) -> tuple[int, dict[int, BaseException], dict[int, AsyncResult]]:
    """Run one chain per key concurrently, in id order within a key.

    Returns how many entries count (those before the first whose failure stops the stream, and
    that one), the errors by index, and the (key, new state, emits) of each successful entry.
    """
    chains: dict[str, list[int]] = {}
    for index, (_, fields) in enumerate(todo):
        try:
            key = entry_key(fields)
        except DecodeError:
            key = ""
        chains.setdefault(key, []).append(index)
    errors: dict[int, BaseException] = {}
    states: dict[int, AsyncResult] = {}
    cutoff = len(todo)
    timeout_ms = meta.timeout_ms
    timeout_s = None if timeout_ms is None else timeout_ms / 1000
    func = handler.func if meta.tracing is None else meta.tracing.wrap_async(handler.func)

    async def chain(indexes: list[int]) -> None:
        nonlocal cutoff
        chain_source = _ChainSource(source)
        for index in indexes:
            if index > cutoff:
                return
            id_b, fields = todo[index]
            key = ""
            try:
                ctx = _context(meta, id_b, fields, chain_source)
                key = ctx.key
                value = handler.decoder.decode(fields)
                try:
                    await asyncio.wait_for(func(value, ctx), timeout_s)
                except TimeoutError:
                    raise HandlerTimeout(f"the handler ran past its timeout of {timeout_ms} ms") from None
                new = state_result(ctx)
            except Exception as exc:
                chain_source.viewed.clear()
                errors[index] = exc
                if stop(index, exc):
                    cutoff = min(cutoff, index)
                    return
                continue
            if new is not UNCHANGED:
                chain_source.results[key] = new
            states[index] = (key, new, ctx.emitted, ctx.schedules, chain_source.taken())

    async def run_all() -> None:
        await asyncio.gather(*(chain(indexes) for indexes in chains.values()))

    loop.run_until_complete(run_all())
    return min(cutoff + 1, len(todo)), errors, states


def run_async_into(
    loop: asyncio.AbstractEventLoop,
    handler: Handler,
    meta: EntryMeta,
    todo: list[Entry],
    batch: PartitionBatch,
    stop: StopRule,
) -> tuple[int, dict[int, BaseException]]:
    """``run_async``, with what the entries that count did joined to the batch in id order."""
    ran, errors, states = run_async(loop, handler, meta, todo, batch, stop)
    if meta.tracing is not None:
        meta.tracing.joined([(index, todo[index][0]) for index in states], ran)
    for index in sorted(states):
        key, new, emits, schedules, viewed = states[index]
        if index < ran:
            if new is not UNCHANGED:
                batch.overlay[key] = new
            if emits:
                batch.emitted += emits
            if schedules and batch.timers is not None:
                batch.timers.schedule(schedules)
            if viewed:
                batch.viewed += viewed
    return ran, errors
