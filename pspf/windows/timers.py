"""Work a partition does because time passes: scheduled callbacks, timers and state expiry.

- ``ctx.schedule(at, name, payload)`` in a handler asks for ``@app.on_schedule(name)`` to run for
  the entry's key once the partition's stream time reaches ``at`` (see ``pspf.windows`` for stream
  time). One schedule per (key, name): scheduling again replaces it. It is written with the
  entry's batch, and it runs, its state writes and emits committed and the schedule deleted in
  one batch: exactly once, across crashes and partition moves (it is in the store and backup).
- ``@app.timer(every=...)`` runs on wall-clock time in the worker that owns each partition, once
  per period (a period missed while no worker owned the partition is skipped, not caught up).
  The last period run is committed with the timer's writes, so no period runs twice. A period
  whose start passed while the worker was busy or waiting runs late (a blocked read ends on the
  server's clock tick, 100 ms apart by default, and a batch can take longer than a period): the
  periods since the last one run, or since the worker took the partition, run in order, each
  once, up to ``CATCH_UP`` of them (the latest) per cycle.
- ``state_ttl`` expires a key's state that was not written for that long (wall-clock time): up
  to ``EXPIRE_STEP`` keys per batch, in the batch's transaction, so expiry never pauses a worker.

Store layout: ``__schedules`` ("name/key" -> at, payload, and the entry that scheduled it),
``__time`` ("timer/NAME" -> the last period run), ``__expiry`` (key -> when its state expires).
"""

from __future__ import annotations

import heapq
import inspect
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pspf import keys
from pspf.errors import ConfigError

if TYPE_CHECKING:
    from pspf.state_stores import StateStore

#: Keys whose state expires per batch (and per idle round) at most.
EXPIRE_STEP = 1_000
#: Scheduled callbacks run per batch at most; the rest wait for the next one.
CALLBACK_STEP = 10_000
#: Periods of one timer a cycle runs at most: a worker further behind (a long stall) skips the
#: older ones, as if it had not owned the partition then.
CATCH_UP = 100


def ms_of(name: str, value: timedelta) -> int:
    """A positive duration in milliseconds; ConfigError for anything else."""
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ConfigError(f"{name} must be a positive datetime.timedelta, got {value!r}")
    return max(1, int(value / timedelta(milliseconds=1)))


class Timer(NamedTuple):
    """An ``@app.timer``: ``func(ctx)`` every ``every_ms`` of wall-clock time, per partition."""

    name: str
    every_ms: int
    func: Callable[[Any], None]


class ScheduledCall(NamedTuple):
    """A callback a handler asked for: ``name`` for ``key`` at stream time ``at_ms``."""

    at_ms: int
    name: str
    key: str
    payload: bytes
    #: the entry that scheduled it: the source of what the callback emits
    source: tuple[str, bytes]


def at_ms(at: datetime | int | timedelta, entry_ms: int) -> int:
    """When a schedule is due: epoch milliseconds, an aware datetime, or a delay after the entry."""
    if isinstance(at, int) and not isinstance(at, bool):
        return at
    if isinstance(at, timedelta):
        return entry_ms + int(at / timedelta(milliseconds=1))
    if isinstance(at, datetime):
        if at.tzinfo is None:
            raise ConfigError(f"ctx.schedule: the datetime {at.isoformat()!r} has no time zone")
        return int(at.timestamp() * 1000)
    raise ConfigError(f"ctx.schedule: at must be epoch milliseconds, a datetime or a timedelta, not {at!r}")


def check_callback(name: str, func: Callable[..., Any]) -> None:
    if inspect.iscoroutinefunction(func):
        raise ConfigError(f"{name} {func.__qualname__} must be a plain def, not async")


_call_decoder = msgspec.msgpack.Decoder(tuple[int, bytes, str, bytes])


class PartitionTimers:
    """One owned partition's schedules, timer periods and state expiry, in memory and in its store.

    Changes are applied in memory at once and written by the next commit (``writes``), like
    ``PartitionWindows``; a commit that fails stops the worker, which drops all of this.
    """

    def __init__(self, callbacks: frozenset[str], ttl: bool) -> None:
        #: the names of the app's ``@app.on_schedule`` callbacks
        self.callbacks = callbacks
        self.calls: dict[tuple[str, str], ScheduledCall] = {}
        #: (at, name, key); stale once its call ran or was replaced
        self.due: list[tuple[int, str, str]] = []
        self.ticks: dict[str, int] = {}
        #: when this worker took the partition (wall-clock ms, ``TimeKeeping.load`` sets it): no
        #: period before it runs here
        self.since_ms = 0
        self.ttl = ttl
        self.expires: dict[str, int] = {}
        #: (expires at, key); stale once the key was written again or deleted
        self.expiry: list[tuple[int, str]] = []
        self.dirty: dict[tuple[str, str], bytes | None] = {}

    @classmethod
    def load(cls, store: StateStore, callbacks: frozenset[str], ttl: bool) -> PartitionTimers:
        timers = cls(callbacks, ttl)
        for name, raw in store.items(keys.SCHEDULES_NAMESPACE):
            at, payload, topic, entry_id = _call_decoder.decode(raw)
            callback, _, key = name.partition("/")
            timers.calls[(callback, key)] = ScheduledCall(at, callback, key, payload, (topic, entry_id))
            timers.due.append((at, callback, key))
        heapq.heapify(timers.due)
        for name, raw in store.items(keys.TIME_NAMESPACE, keys.TIMER_PREFIX):
            timers.ticks[name[len(keys.TIMER_PREFIX) :]] = int(raw)
        if ttl:
            for key, raw in store.items(keys.EXPIRY_NAMESPACE):
                timers.expires[key] = int(raw)
                timers.expiry.append((int(raw), key))
            heapq.heapify(timers.expiry)
        return timers

    def writes(self) -> dict[tuple[str, str], bytes | None]:
        """The store writes since the last commit: (namespace, key) -> value, None to delete."""
        return self.dirty

    def committed(self) -> None:
        self.dirty = {}

    # -- schedules ----------------------------------------------------------------------------

    def schedule(self, calls: list[ScheduledCall]) -> None:
        """Record what a handler scheduled (it returned); a call replaces one of the same name and key."""
        for call in calls:
            self.calls[(call.name, call.key)] = call
            heapq.heappush(self.due, (call.at_ms, call.name, call.key))
            value = msgspec.msgpack.encode((call.at_ms, call.payload, *call.source))
            self.dirty[(keys.SCHEDULES_NAMESPACE, f"{call.name}/{call.key}")] = value

    def take_due(self, stream_ms: int | None) -> ScheduledCall | None:
        """The next call due at ``stream_ms``, deleted (its deletion commits with what it did)."""
        due = self.due
        while due and stream_ms is not None and due[0][0] <= stream_ms:
            at, name, key = heapq.heappop(due)
            call = self.calls.get((name, key))
            if call is None or call.at_ms != at:
                continue  # ran, or replaced by a later schedule
            del self.calls[(name, key)]
            self.dirty[(keys.SCHEDULES_NAMESPACE, f"{name}/{key}")] = None
            return call
        return None

    # -- timers -------------------------------------------------------------------------------

    def periods_due(self, timer: Timer, now_ms: int) -> range:
        """The starts of ``timer``'s periods to run at ``now_ms``, oldest first.

        Each period after the last one run (and not before the one this worker took the
        partition in) up to the current one; at most ``CATCH_UP``, the latest.
        """
        every = timer.every_ms
        current = now_ms - now_ms % every
        first = max(self.since_ms - self.since_ms % every, current - (CATCH_UP - 1) * every)
        last = self.ticks.get(timer.name)
        if last is not None:
            first = max(first, last - last % every + every)
        return range(first, current + 1, every)

    def ran(self, timer: Timer, period: int) -> None:
        self.ticks[timer.name] = period
        self.dirty[(keys.TIME_NAMESPACE, keys.TIMER_PREFIX + timer.name)] = str(period).encode()

    # -- state expiry -------------------------------------------------------------------------

    def written(self, key: str, expires_ms: int | None) -> None:
        """``key``'s state was written (``expires_ms``: when it expires) or deleted (None)."""
        if expires_ms is None:
            if self.expires.pop(key, None) is not None:
                self.dirty[(keys.EXPIRY_NAMESPACE, key)] = None
            return
        self.expires[key] = expires_ms
        heapq.heappush(self.expiry, (expires_ms, key))
        self.dirty[(keys.EXPIRY_NAMESPACE, key)] = str(expires_ms).encode()

    def expired(self, now_ms: int, step: int = EXPIRE_STEP) -> list[str]:
        """Up to ``step`` keys whose state expired by ``now_ms``: forgotten here, to delete."""
        found: list[str] = []
        expiry = self.expiry
        while expiry and expiry[0][0] <= now_ms and len(found) < step:
            at, key = heapq.heappop(expiry)
            if self.expires.get(key) == at:
                del self.expires[key]
                self.dirty[(keys.EXPIRY_NAMESPACE, key)] = None
                found.append(key)
        return found

    def expiry_due(self, now_ms: int) -> bool:
        return bool(self.expiry) and self.expiry[0][0] <= now_ms
