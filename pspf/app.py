"""``App`` declares what a stream app consumes and how; it does no I/O and runs no loop.

``pspf run module:attr`` loads an App (or a zero-argument function returning one) and hands it
to a worker.

A topic has at most one handler and any number of windows. Whatever it has runs as ONE attempt
per entry: the handler, then each window in the order declared; what they do (state writes,
emits, window changes) joins the batch only if all of them return, and the first that raises
fails the entry for all (retries, then the DLQ).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from pspf.codec import StateDecoder, ValueDecoder, value_type_of
from pspf.context import Context, TimerContext
from pspf.dataflow import Dataflow, Runner, Source, Stream
from pspf.errors import ConfigError
from pspf.failures import RetryPolicy
from pspf.keys import check_name
from pspf.outbox.views import ViewKind, check_view
from pspf.tables.table import Table
from pspf.windows.aggregation import Aggregation
from pspf.windows.functions import TimestampFunc, timestamp_reader
from pspf.windows.kinds import LatePolicy, WindowSpec, kind_of
from pspf.windows.timers import Timer, check_callback, ms_of

if TYPE_CHECKING:
    from pspf.hooks import ProcessorHooks

HandlerFunc = Callable[[Any, Context], None] | Callable[[Any, Context], Awaitable[None]]
TimerFunc = Callable[[TimerContext], None]
ScheduleFunc = Callable[[Any, Context], None]
MigrateFunc = Callable[[dict[str, Any]], dict[str, Any]]


class Decoder(Protocol):
    """Turns an entry's fields into what a handler's function takes."""

    @property
    def value_type(self) -> Any: ...

    def decode(self, fields: dict[bytes, bytes]) -> Any: ...


class Handler(msgspec.Struct, frozen=True):
    """What a topic's entries run: its function, value decoder and failure policy.

    The topic's ``@app.handler``, or its windows, or both run as one (``_Consumers``).
    """

    topic: str
    func: Callable[..., Any]
    is_async: bool
    decoder: Decoder
    retry: RetryPolicy
    non_retryable: tuple[type[BaseException], ...]
    #: the state this handler writes expires after this long without a write; None: never
    state_ttl_ms: int | None = None


class _Consumers:
    """A topic's handler and windows as the one function its entries run.

    Each gets the value decoded into its own declared type (``value[index]``; the value itself
    when they all declare one type).
    """

    __slots__ = ("calls",)

    def __init__(self, calls: list[tuple[Callable[[Any, Context], None], int | None]]) -> None:
        self.calls = calls

    def __call__(self, value: Any, ctx: Context) -> None:
        for func, index in self.calls:
            func(value if index is None else value[index], ctx)


class _Values:
    """Decodes an entry once into each value type the consumers of its topic declare."""

    __slots__ = ("decoders", "value_type")

    def __init__(self, types: list[Any]) -> None:
        self.value_type = tuple(types)
        self.decoders = [ValueDecoder(value_type) for value_type in types]

    def decode(self, fields: dict[bytes, bytes]) -> tuple[Any, ...]:
        return tuple([decoder.decode(fields) for decoder in self.decoders])


class Callback(msgspec.Struct, frozen=True):
    """An ``@app.on_schedule`` function and the decoder of its payload."""

    func: Callable[[Any, Context], None]
    payload: msgspec.msgpack.Decoder[Any]


class App:
    """A stream application; its name is its consumer group and names its state.

    Example:
        app = App("order-totals")

        @app.handler("orders")
        def add(order: dict, ctx: Context) -> None:
            ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
    """

    def __init__(
        self,
        name: str,
        retry: RetryPolicy | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        state_type: Any = Any,
        hooks: ProcessorHooks | None = None,
        state_ttl: timedelta | None = None,
        schemas: Literal["declare", "check", "off"] = "check",
    ) -> None:
        """Declare an app.

        Args:
            name: the app's name: its consumer group, and the folder of its state.
            retry: the app's retry policy; unset fields come from the run's settings.
            non_retryable: exception types that send an entry to the DLQ without retries.
            state_type: the type of the values in ``ctx.state`` (a msgspec Struct, or any type
                msgspec handles); stored values are decoded into it.
            hooks: called at the steps of each batch (metrics, audit, tracing) by every worker
                that runs the app, ``pspf run`` included.
            state_ttl: a key's state not written for this long (wall-clock time) is deleted, in
                the store and its backup; a handler may set its own.
            schemas: at start, typed handlers read their topics' schemas ("check"), or set them ("declare").
        """
        self.name = check_name("app", name)
        try:
            self.state_decoder = StateDecoder(state_type)
        except TypeError as exc:
            raise ConfigError(
                f"app {name!r}: msgspec cannot decode state into {state_type!r}: {exc}"
            ) from None
        self.retry = (retry or RetryPolicy()).validated()
        self.non_retryable = non_retryable
        self.schemas = schemas
        #: what each topic's entries run: its handler, its windows, or all of them as one
        self.handlers: dict[str, Handler] = {}
        #: the window aggregations, by name
        self.windows: dict[str, Aggregation] = {}
        #: tables (co-partitioned) and global tables, by topic; a table's topic has its handler
        self.tables: dict[str, Table] = {}
        self.global_tables: dict[str, Table] = {}
        #: each topic's ``@app.handler``
        self._own: dict[str, Handler] = {}
        #: the policy a topic's first window set with ``retry=``
        self._window_retry: dict[str, RetryPolicy] = {}
        self.timers: list[Timer] = []
        #: the views handlers write (``view``), by name (their Redis key)
        self.views: dict[str, ViewKind] = {}
        #: the topics handlers emit to, with their value types (``emits``)
        self.outputs: dict[str, Any] = {}
        self.callbacks: dict[str, Callback] = {}
        self.state_ttl_ms = None if state_ttl is None else ms_of("state_ttl", state_ttl)
        self.hooks = hooks
        #: the chains of ``stream``; each topic's root runs as one of the topic's consumers
        self.dataflow = Dataflow(self.name, self._chain_window, self._stream_added)
        self._streams: dict[str, Runner] = {}

    def handler(
        self,
        topic: str,
        retry: RetryPolicy | None = None,
        non_retryable: tuple[type[BaseException], ...] = (),
        state_ttl: timedelta | None = None,
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Register ``func(value, ctx)`` for the entries of ``topic``.

        The annotation of the first parameter, when present, is the value type: entries are
        decoded into it (a msgspec Struct, dict, list, ...). ``async def`` handlers are awaited.
        ``retry`` overrides the app's policy for this handler (``mode="deferred"``,
        ``timeout_ms``, ...) and for the topic's windows; ``non_retryable`` adds to the app's
        list; ``state_ttl`` to the app's for the keys this handler writes. One handler per topic;
        windows may share it (``window``), when the handler is a plain ``def``.
        """
        check_name("topic", topic)
        policy = (retry or RetryPolicy()).validated().over(self.retry)
        ttl_ms = self.state_ttl_ms if state_ttl is None else ms_of("state_ttl", state_ttl)

        def register(func: HandlerFunc) -> HandlerFunc:
            handler = Handler(
                topic=topic,
                func=func,
                is_async=inspect.iscoroutinefunction(func),
                decoder=ValueDecoder(value_type_of(func)),
                retry=policy,
                non_retryable=(*self.non_retryable, *non_retryable),
                state_ttl_ms=ttl_ms,
            )
            self._check_handler(topic, handler)
            self._own[topic] = handler
            self._combine(topic)
            return func

        return register

    def table(
        self,
        topic: str,
        value_type: Any = None,
        versioned: timedelta | None = None,
        timestamp: str | TimestampFunc | None = None,
    ) -> Table:
        """Declare a table built from ``topic``, looked up with ``ctx.table(topic)``.

        An entry of the topic sets its key's row to its value (decoded into ``value_type``, a
        msgspec type; None: any JSON); a JSON ``null`` value deletes the row. The topic must have
        the app's partition count: its rows live in the partition's store, are read in the same
        batches as the app's other topics and follow the partition like ``ctx.state``. An entry
        whose value does not decode goes to the DLQ at once.

        ``versioned``: keep each key's rows for this long of event time, for lookups as of a
        time (``ctx.table(name, at=ms)``, ``Stream.join_asof``); ``timestamp``: the row's event
        time (a field, or a function of (value, ctx); default: its entry's id time).
        """
        check_name("topic", topic)
        self._check_free(topic)
        if versioned is None and timestamp is not None:
            raise ConfigError(f"table {topic!r}: timestamp= is for a versioned table (versioned=...)")
        retention = None if versioned is None else ms_of("versioned", versioned)
        reader = None if retention is None else timestamp_reader(f"table {topic!r}", timestamp)
        table = Table(topic, value_type, is_global=False, versioned_ms=retention, timestamp=reader)
        self.tables[topic] = table
        self.handlers[topic] = Handler(
            topic=topic,
            func=table.apply,
            is_async=False,
            decoder=table.value_decoder,
            retry=RetryPolicy().validated().over(self.retry),
            non_retryable=(Exception,),
        )
        return table

    def emits(self, topic: str, value_type: Any = None) -> None:
        """Declare that handlers ``ctx.emit`` to ``topic`` values of ``value_type`` (for ``pspf docs``)."""
        self.outputs[check_name("topic", topic)] = value_type

    def migrate_state(self, from_type: Any) -> Callable[[MigrateFunc], MigrateFunc]:
        """Declare how a key's state stored under ``from_type`` becomes one of ``state_type``.

        The function takes the key's old state (a dict of ``from_type`` values) and returns its new
        one; it runs when a key is read, once: its result is stored with the key's batch. Without
        one, a worker refuses an app whose ``state_type`` cannot read the stored state.
        """

        def register(func: MigrateFunc) -> MigrateFunc:
            self.state_decoder = StateDecoder(self.state_decoder.value_type, (from_type, func))
            return func

        return register

    def view(self, name: str, kind: str = "hash") -> None:
        """Declare a view: the Redis key ``name``, a hash or a sorted set ("zset"); ``pspf.outbox.views``."""
        self.views[name] = check_view(name, kind)

    def stream(self, topic: str, value_type: Any = None) -> Stream:
        """The stream of ``topic``'s entries, for chains of steps (``pspf.dataflow``).

        The app reads the topic (one stream per topic: a second call returns the same); its
        entries are decoded into ``value_type`` (a msgspec type; None: any JSON). A topic may
        have a stream beside its handler and windows: all run as the entry's one attempt.
        """
        check_name("topic", topic)
        self._check_not_table(topic, "a stream")
        if value_type is not None:
            try:
                ValueDecoder(value_type)
            except TypeError as exc:
                raise ConfigError(
                    f"app {self.name!r}, stream {topic!r}: msgspec cannot decode into {value_type!r}: {exc}"
                ) from None
        own = self._own.get(topic)
        if own is not None and own.is_async:
            raise ConfigError(
                f"app {self.name!r}, topic {topic!r}: a stream cannot share the topic with the async "
                f"handler {own.func.__qualname__}: they run as one attempt, so the handler must be a "
                "plain def"
            )
        return Stream(self.dataflow, self.dataflow.source(topic, value_type, managed=False))

    def _stream_added(self, source: Source) -> None:
        self._check_not_table(source.topic, "a stream")
        if source.topic not in self._streams:
            self._streams[source.topic] = Runner(source)
        self._combine(source.topic)

    def _chain_window(self, aggregation: Aggregation) -> None:
        """Add a chain's window (``Stream.window(...).agg``) to the app's windows."""
        self._window_name(aggregation.topic, aggregation.func, aggregation.name)
        self.windows[aggregation.name] = aggregation

    @property
    def managed_topics(self) -> list[str]:
        """The topics the app's ``group_by`` steps write (it creates them when missing)."""
        return self.dataflow.managed_topics

    def compile(self) -> None:
        """Compile the app's streams: raise ``ConfigError`` for a chain that cannot run."""
        for what, names, declared in (
            ("joins table", self.dataflow.asof_tables, set(self.tables)),
            ("writes view", self.dataflow.views, set(self.views)),
        ):
            if missing := sorted(names - declared):
                raise ConfigError(
                    f"app {self.name!r}: a stream {what} {missing[0]!r}, which it does not declare"
                )
        for runner in self._streams.values():
            runner.compile()

    def global_table(self, topic: str, value_type: Any = None) -> Table:
        """Declare a global table built from ``topic`` (any partition count), looked up by any key.

        Every worker holds all of it in a store of its own under the state dir, reads it to the
        end of its streams before it handles any entry, then follows it between batches. Rows as
        for ``table``; an entry without a key or with a value that does not decode is skipped
        (logged).
        """
        check_name("topic", topic)
        self._check_free(topic)
        table = Table(topic, value_type, is_global=True)
        self.global_tables[topic] = table
        return table

    def _check_free(self, topic: str) -> None:
        """A table's topic is read as the table only: refuse one that something else reads."""
        self._check_not_table(topic, "a table")
        if topic in self.handlers:
            raise ConfigError(f"app {self.name!r}: topic {topic!r} is already read by a handler")

    def timer(self, every: timedelta) -> Callable[[TimerFunc], TimerFunc]:
        """Register ``func(ctx: TimerContext)`` to run every ``every`` of wall-clock time.

        It runs in the worker that owns each partition, once per partition and period, its state
        writes and emits committed like a batch; no period runs twice. A period that passed while
        the worker was busy runs late; one missed while no worker owned the partition is skipped.
        """
        every_ms = ms_of("every", every)

        def register(func: TimerFunc) -> TimerFunc:
            check_callback("timer", func)
            name = func.__name__
            if any(t.name == name for t in self.timers):
                raise ConfigError(f"app {self.name!r} already has a timer named {name!r}")
            check_name("timer", name.replace("_", "-"))
            self.timers.append(Timer(name, every_ms, func))
            return func

        return register

    def on_schedule(self, name: str) -> Callable[[ScheduleFunc], ScheduleFunc]:
        """Register ``func(payload, ctx)`` for what handlers schedule with ``ctx.schedule(at, name)``.

        ``ctx`` is a ``Context`` for the key that scheduled it (``ctx.state``, ``ctx.emit``,
        ``ctx.schedule`` again). The payload is decoded into the first parameter's annotation.
        """
        check_name("schedule", name)

        def register(func: ScheduleFunc) -> ScheduleFunc:
            check_callback("schedule callback", func)
            if name in self.callbacks:
                raise ConfigError(f"app {self.name!r} already has a callback for {name!r}")
            try:
                decoder = msgspec.msgpack.Decoder(value_type_of(func))
            except TypeError as exc:
                raise ConfigError(f"schedule callback {func.__qualname__}: {exc}") from None
            self.callbacks[name] = Callback(func, decoder)
            return func

        return register

    def window(
        self,
        topic: str,
        spec: WindowSpec,
        timestamp: str | TimestampFunc | None = None,
        emit_to: str | None = None,
        late: LatePolicy = "drop",
        merge: Callable[[Any, Any], Any] | None = None,
        retry: RetryPolicy | None = None,
        name: str | None = None,
    ) -> Callable[[Callable[[Any, Any], Any]], Callable[[Any, Any], Any]]:
        """Register ``func(accumulator, value) -> accumulator`` over time windows of ``topic``.

        ``spec`` comes from ``pspf.windows`` (tumbling, hopping, sliding, session).
        ``timestamp``: the value's field holding the event time (epoch milliseconds or an RFC 3339
        string), or a function of (value, ctx); without it, the time Redis appended the entry.
        When a window closes, ``{"key", "start", "end", "value"}`` is emitted to ``emit_to``
        under the entry key, exactly once. ``late``: what happens to an entry whose windows have
        closed: "drop" (counted in the run's summary, a log line and a metric) or "dlq".
        ``merge(a, b)`` combines two sessions' accumulators (session windows need it). The
        accumulator type is the annotation of the first parameter, the value type that of the
        second.

        ``name`` (default: the function's name) is the window's identity in the store and its
        backup, ``pspf state get --window``, the metrics and the logs: unique in the app, and a
        valid name (letters, digits, ``.``, ``_``, ``-``). A topic may have several windows and a
        handler; each entry is one attempt for all of them, retried with ONE policy: the
        handler's, or without a handler the first window's. So ``retry`` may be given only by
        the topic's first window, and only when the topic has no handler.
        """
        check_name("topic", topic)
        if emit_to is None:
            raise ConfigError(f"window of topic {topic!r}: emit_to (the topic of its results) is required")
        check_name("topic", emit_to)
        _refuse_count_windows(topic, spec)
        policy = None if retry is None else retry.validated().over(self.retry)

        def register(func: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            window_name = self._window_name(topic, func, name)
            self._check_not_table(topic, f"window {window_name!r}")
            if policy is not None:
                self._check_window_retry(topic, window_name)
            own = self._own.get(topic)
            if own is not None and own.is_async:
                raise ConfigError(
                    f"app {self.name!r}, topic {topic!r}: window {window_name!r} cannot share the topic "
                    f"with the async handler {own.func.__qualname__}: a topic's handler and windows run "
                    "as one attempt, in order, so the handler must be a plain def"
                )
            aggregation = Aggregation(window_name, topic, spec, func, emit_to, timestamp, late, merge)
            self.windows[window_name] = aggregation
            if policy is not None:
                self._window_retry[topic] = policy
            self._combine(topic)
            return func

        return register

    def windows_of(self, topic: str) -> list[Aggregation]:
        """The windows of ``topic``, in the order declared."""
        return [w for w in self.windows.values() if w.topic == topic and not w.chained]

    def _window_name(self, topic: str, func: Callable[..., Any], name: str | None) -> str:
        """The name of a new window of ``topic``: valid, and no other window's."""
        chosen = func.__name__ if name is None else name
        try:
            check_name("window", chosen)
        except ConfigError as exc:
            raise ConfigError(f"app {self.name!r}, window of topic {topic!r}: {exc} (name=)") from None
        other = self.windows.get(chosen)
        if other is not None:
            raise ConfigError(
                f"app {self.name!r} already has a window named {chosen!r} (of topic {other.topic!r}): "
                f"the window of topic {topic!r} needs another name (name=)"
            )
        return chosen

    def _check_handler(self, topic: str, handler: Handler) -> None:
        """A handler may join the topic: no table reads it, it has no handler, its windows allow it."""
        func = handler.func.__qualname__
        self._check_not_table(topic, f"handler {func}")
        old = self._own.get(topic)
        if old is not None:
            raise ConfigError(
                f"app {self.name!r} already has a handler for topic {topic!r} ({old.func.__qualname__}): "
                f"{func} cannot be a second one"
            )
        windows = self.windows_of(topic)
        if topic in self._streams and handler.is_async:
            raise ConfigError(
                f"app {self.name!r}, topic {topic!r}: the async handler {func} cannot share the topic "
                "with its stream: they run as one attempt, so the handler must be a plain def"
            )
        if windows and handler.is_async:
            raise ConfigError(
                f"app {self.name!r}, topic {topic!r}: the async handler {func} cannot share the topic "
                f"with window {windows[0].name!r}: a topic's handler and windows run as one attempt, "
                "in order, so the handler must be a plain def"
            )
        if topic in self._window_retry:
            raise ConfigError(
                f"app {self.name!r}, topic {topic!r}: window {windows[0].name!r} sets retry=, but with "
                f"the handler {func} the topic's entries are retried with the handler's policy: "
                "give retry= to the handler"
            )

    def _check_not_table(self, topic: str, what: str) -> None:
        """A table's topic is read as the table only: ``what`` cannot read it too."""
        for kind, taken in (("a table", self.tables), ("a global table", self.global_tables)):
            if topic in taken:
                raise ConfigError(
                    f"app {self.name!r}: topic {topic!r} is already read by {kind}: {what} cannot read it"
                )

    def _check_window_retry(self, topic: str, name: str) -> None:
        """A window may set the topic's policy only as its first consumer."""
        if topic in self._own:
            setter = f"its handler {self._own[topic].func.__qualname__}"
        elif windows := self.windows_of(topic):
            setter = f"its first window {windows[0].name!r}"
        else:
            return
        raise ConfigError(
            f"app {self.name!r}, topic {topic!r}: window {name!r} sets retry=, but the topic's "
            f"entries are one attempt for all its consumers, retried with the policy of {setter}: "
            "give retry= there"
        )

    def _combine(self, topic: str) -> None:
        """Make ``handlers[topic]`` what the topic's entries run (see the module docstring)."""
        own, windows, runner = self._own.get(topic), self.windows_of(topic), self._streams.get(topic)
        if not windows and runner is None:
            assert own is not None
            self.handlers[topic] = own
            return
        calls: list[tuple[Callable[[Any, Context], None], Any]] = [(w.handler, w.value_type) for w in windows]
        if own is not None:
            calls.insert(0, (own.func, own.decoder.value_type))
        if runner is not None:
            value_type = runner.source.value_type
            calls.append((runner, Any if value_type is None else value_type))
        types: list[Any] = []
        for _, value_type in calls:
            if value_type not in types:
                types.append(value_type)
        func: Callable[..., Any]
        decoder: Decoder
        if len(calls) == 1:
            func, decoder = calls[0][0], ValueDecoder(types[0])
        elif len(types) == 1:
            func, decoder = _Consumers([(f, None) for f, _ in calls]), ValueDecoder(types[0])
        else:
            func, decoder = _Consumers([(f, types.index(t)) for f, t in calls]), _Values(types)
        default = RetryPolicy().validated().over(self.retry)
        self.handlers[topic] = Handler(
            topic=topic,
            func=func,
            is_async=False,
            decoder=decoder,
            retry=own.retry if own is not None else self._window_retry.get(topic, default),
            non_retryable=own.non_retryable if own is not None else self.non_retryable,
            state_ttl_ms=None if own is None else own.state_ttl_ms,
        )

    @property
    def topics(self) -> list[str]:
        """The topics the app reads in groups, tables' last.

        The first holds the partitions' state backups: its acknowledgement carries the backup
        update, and the others' go after it (a table's topic, quiet most of the time, would add
        that second round trip to every batch).
        """
        return sorted(self.handlers, key=lambda topic: topic in self.tables)

    def functions(self) -> list[Callable[..., Any]]:
        """The app's own functions that get a ``ctx``: handlers, timers and scheduled callbacks."""
        return [
            *(h.func for h in self._own.values()),
            *(t.func for t in self.timers),
            *(c.func for c in self.callbacks.values()),
        ]

    def describe(self) -> dict[str, Any]:
        """The app's topology (``pspf describe``): what it reads, what runs, where results go."""
        return {
            "app": self.name,
            "topics": self.topics,
            "handlers": {topic: h.func.__qualname__ for topic, h in self._own.items()},
            "windows": {
                name: {"topic": w.topic, "kind": w.spec.kind, "emit_to": w.emit_to}
                for name, w in self.windows.items()
                if not w.chained
            },
            "tables": list(self.tables),
            "global_tables": list(self.global_tables),
            "streams": self.dataflow.describe(),
            "managed_topics": self.managed_topics,
            "views": self.views,
            "outputs": self.dataflow.outputs,
        }

    def table_topics(self) -> tuple[list[str], list[str]]:
        """The topics it reads as tables, and those it reads as global tables."""
        return list(self.tables), list(self.global_tables)

    def __repr__(self) -> str:
        return f"App({self.name!r}, topics={self.topics})"


def _refuse_count_windows(topic: str, spec: WindowSpec) -> None:
    """``@app.window`` takes time windows; count windows are a step of a stream."""
    if isinstance(spec, WindowSpec) and kind_of(spec.kind).by_count:
        raise ConfigError(
            f"window of topic {topic!r}: count windows are a step of a stream: "
            f"app.stream({topic!r}).window(windows.tumbling_count(n)).agg(...)"
        )
