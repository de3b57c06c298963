"""``Stream``: a chain of steps over an app's topic, declared by the user, run by ``pspf.dataflow.run``.

A ``Stream`` is immutable: each step returns a new one, so one stream can feed several chains
(branching) and ``concat`` merges two. The steps form a graph per app (``Dataflow``): one root
per topic the app reads as a stream, a node per step. Nothing runs here; ``pspf.dataflow.run``
turns each root's graph into the one function its topic's entries run.

Re-keying (``group_by``) ends a chain's part on its topic: the values go, under their new key,
through the managed topic it names (published through the outbox), and the steps after it are
the root of that topic, which the same app reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from pspf import keys
from pspf.dataflow.agg import Aggregate, Reduce
from pspf.dataflow.joining import IntervalJoin, JoinSide
from pspf.dataflow.windowing import ChainWindow
from pspf.errors import ConfigError
from pspf.tables.table import Table
from pspf.windows.functions import timestamp_reader
from pspf.windows.kinds import LatePolicy, WindowSpec, ms

if TYPE_CHECKING:
    from pspf.windows.aggregation import Aggregation

Emit = Literal["final", "update"]
#: Node params ``pspf describe`` leaves out (the objects behind a step; its name is shown)
_HIDDEN = frozenset({"aggregation", "join", "reader"})
#: Record fields every window result has: its aggregations' names must be others.
RESULT_FIELDS = frozenset({"key", "start", "end"})


class Node:
    """One step of an app's dataflow graph, and the steps that follow it.

    ``kind``: "source" (a topic's root), "filter", "map", "update", "flat_map", "apply", "to", "to_view",
    "group_by", "window" or "concat"; ``func`` the user's function (``takes_ctx``: it takes
    ``(value, ctx)``); ``params`` what the kind needs besides.
    """

    __slots__ = ("children", "func", "kind", "params", "takes_ctx")

    def __init__(
        self, kind: str, func: Callable[..., Any] | None = None, takes_ctx: bool = False, **params: Any
    ) -> None:
        self.kind = kind
        self.func = func
        self.takes_ctx = takes_ctx
        self.params = params
        self.children: list[Node] = []

    def label(self) -> str:
        """The step as ``pspf describe`` shows it."""
        name = getattr(self.func, "__qualname__", None)
        params = ", ".join(
            f"{k}={_shown(v)}" for k, v in self.params.items() if k not in _HIDDEN and v is not None
        )
        shown = [part for part in (name, params) if part]
        return f"{self.kind}({', '.join(shown)})"


class Source(Node):
    """A topic's root: the app reads the topic, and every chain over it starts here."""

    __slots__ = ("managed", "topic", "value_type", "version")

    def __init__(self, topic: str, value_type: Any, managed: bool) -> None:
        super().__init__("source")
        self.topic = topic
        self.value_type = value_type
        #: a topic a ``group_by`` of the app writes (created by the app when missing)
        self.managed = managed
        #: counts the steps added under it: a compiled graph older than this is compiled again
        self.version = 0


class Dataflow:
    """An app's streams: a root per topic, the managed topics, the windows its chains declare."""

    def __init__(
        self,
        app_name: str,
        register_window: Callable[[Aggregation], None],
        on_source: Callable[[Source], None],
    ) -> None:
        self.app_name = app_name
        self.sources: dict[str, Source] = {}
        self._register_window = register_window
        #: told of a new root, or of a root whose value type was given
        self._on_source = on_source
        #: every node's root(s), to tell a root a step was added under it
        self._roots: dict[int, set[str]] = {}
        #: the joins of its chains (their sides are among the app's windows)
        self.joins: list[IntervalJoin] = []
        #: the tables its chains join as of a time (the app must declare them, versioned)
        self.asof_tables: set[str] = set()

    def source(self, topic: str, value_type: Any, managed: bool) -> Source:
        found = self.sources.get(topic)
        if found is None:
            found = self.sources[topic] = Source(topic, value_type, managed)
            self._roots[id(found)] = {topic}
            self._on_source(found)
            return found
        if value_type is not None and found.value_type is not None and value_type != found.value_type:
            raise ConfigError(
                f"app {self.app_name!r}: topic {topic!r} is a stream of {found.value_type!r} already, "
                f"not of {value_type!r} (one stream per topic)"
            )
        found.managed = found.managed or managed
        if value_type is not None and found.value_type is None:
            found.value_type = value_type
            self._on_source(found)
        return found

    def add(self, parents: Iterable[Node], node: Node) -> Node:
        """Attach ``node`` under each parent; the roots over it compile again."""
        roots: set[str] = set()
        for parent in parents:
            parent.children.append(node)
            roots |= self._roots[id(parent)]
        self._roots[id(node)] = roots
        for topic in roots:
            self.sources[topic].version += 1
        return node

    def roots_of(self, node: Node) -> set[str]:
        return self._roots[id(node)]

    def window(self, aggregation: Aggregation) -> None:
        self._register_window(aggregation)

    def windows_on(self, topic: str) -> int:
        """How many windows the chains on ``topic``'s root declared (names the next one)."""
        return sum(1 for node in _walk(self.sources[topic]) if node.kind == "window")

    def joins_on(self, topic: str) -> int:
        """How many joins have a left side on ``topic``'s root (names the next one)."""
        return sum(1 for join in self.joins if join.sides[0].topic == topic)

    @property
    def ordered(self) -> bool:
        """Whether the app's entries must be applied in id order across its topics (joins)."""
        return bool(self.joins)

    def describe(self) -> list[dict[str, Any]]:
        """Each root and the steps under it, nested ``{"step": ..., "then": [...]}`` (``pspf describe``)."""
        return [
            {
                "source": topic,
                "value_type": _type_name(source.value_type),
                "managed": source.managed,
                "then": [_tree(child) for child in source.children],
            }
            for topic, source in self.sources.items()
        ]

    @property
    def managed_topics(self) -> list[str]:
        return sorted(topic for topic, source in self.sources.items() if source.managed)

    @property
    def views(self) -> set[str]:
        """The views chains write with ``to_view``."""
        return {
            node.params["view"]
            for root in self.sources.values()
            for node in _walk(root)
            if node.kind == "to_view"
        }

    @property
    def outputs(self) -> list[str]:
        """The topics chains publish to with ``to``."""
        return sorted(
            {
                node.params["topic"]
                for root in self.sources.values()
                for node in _walk(root)
                if node.kind == "to"
            }
        )


class Stream:
    """The values of a topic's entries after some steps; each step returns a new ``Stream``.

    Functions take ``(value)`` or ``(value, ctx)`` (the entry's ``Context``: key, id, headers,
    state, table lookups) and must not change the value they get in place: another branch may
    hold it too.
    """

    __slots__ = ("_flow", "_node")

    def __init__(self, flow: Dataflow, node: Node) -> None:
        self._flow = flow
        self._node = node

    # -- stateless steps ---------------------------------------------------------------------------

    def filter(self, fn: Callable[..., Any]) -> Stream:
        """Only the values for which ``fn`` is true go on."""
        return self._then("filter", fn)

    def map(self, fn: Callable[..., Any]) -> Stream:
        """``fn``'s result goes on instead of the value."""
        return self._then("map", fn)

    def update(self, fn: Callable[..., Any]) -> Stream:
        """``fn`` runs for its effect (a log line, a metric); the value goes on unchanged."""
        return self._then("update", fn)

    def flat_map(self, fn: Callable[..., Iterable[Any]]) -> Stream:
        """Each item of ``fn``'s result goes on, in order (none: the value stops here)."""
        return self._then("flat_map", fn)

    def apply(self, fn: Callable[[Any, dict[str, Any]], Any]) -> Stream:
        """``fn(value, state)``'s result goes on; ``state`` is the key's ``ctx.state``.

        What ``fn`` writes to it commits with the entry, exactly once, like a handler's writes
        (handlers and steps of one app share a key's state: give them distinct fields).
        """
        _check_function("apply", fn, 2)
        return self._add(Node("apply", fn, False))

    # -- steps that leave the topic ------------------------------------------------------------------

    def to(self, topic: str, key: Callable[..., Any] | str | None = None) -> None:
        """Publish each value to ``topic`` through the outbox: exactly once, after its batch commits.

        ``key``: a function of the value (or a field name) giving the output's key; by default
        the entry's key.
        """
        keys.check_name("topic", topic)
        self._add(Node("to", None, False, topic=topic, key=_key_function("to", key, required=False)))

    def to_view(
        self,
        name: str,
        field: Callable[..., Any] | str | None = None,
        value: Callable[..., Any] | str | None = None,
    ) -> None:
        """Write each value into the app's view ``name`` (``App.view``), after its batch commits.

        A hash view: its field ``field`` (a function of the value or a field name; default: the
        entry's key) is set to ``value`` (a function or a field name; default: the value whole,
        JSON unless text). A sorted set view: member ``field`` gets the score ``value``. A value
        of None deletes the field, or removes the member. Final values, so a retried batch
        writes the same.
        """
        self._add(
            Node(
                "to_view",
                None,
                False,
                view=name,
                field=_key_function("to_view", field, required=False),
                value=_key_function("to_view", value, required=False),
            )
        )

    def group_by(self, key: Callable[..., Any] | str, topic: str) -> Stream:
        """Re-key: each value goes on under ``key(value)`` (or its field ``key``) through ``topic``.

        ``topic`` is managed by the app: created with the app's partition count at start when
        missing, listed by ``pspf topic list``, deleted by ``pspf app delete``. The values are
        published through the outbox and read back by the app, so the steps after this one see
        each value once, in the partition of its new key. They see it as JSON gives it back (a
        Struct becomes a dict).
        """
        keys.check_name("topic", topic)
        if topic in self._flow.sources and not self._flow.sources[topic].managed:
            raise ConfigError(
                f"app {self._flow.app_name!r}: group_by(topic={topic!r}): the app reads that topic as a "
                "stream already; a re-keying topic must be one the app writes itself"
            )
        key_fn = _key_function("group_by", key, required=True)
        root = self._flow.source(topic, None, managed=True)
        self._add(Node("group_by", None, False, topic=topic, key=key_fn))
        return Stream(self._flow, root)

    # -- windows -------------------------------------------------------------------------------------

    def window(
        self,
        spec: WindowSpec,
        timestamp: str | Callable[[Any, Any], Any] | None = None,
        grace: timedelta | None = None,
        late: LatePolicy = "drop",
        name: str | None = None,
    ) -> WindowedStream:
        """Group the values by key into windows of ``spec`` (``pspf.windows``); then ``.agg(...)``.

        ``timestamp``: the value's field with its event time (epoch ms or RFC 3339), or a
        function of (value, ctx); default: the entry's id time. ``grace`` replaces the spec's.
        ``late``: "drop" (counted) or "dlq". ``name`` (default ``TOPIC.window-N``, N counting the
        windows on the stream's topic in declaration order) names the window's state: give one
        to keep the state when chains are added or reordered.
        """
        if not isinstance(spec, WindowSpec):
            raise ConfigError(f"Stream.window: the spec must come from pspf.windows, got {spec!r}")
        if grace is not None:
            spec = msgspec.structs.replace(spec, grace_ms=ms("grace", grace, 0))
        return WindowedStream(self, spec, timestamp, late, name)

    def join_interval(
        self,
        other: Stream,
        within: timedelta,
        timestamp: str | Callable[[Any, Any], Any] | None = None,
        merge: Callable[[Any, Any], Any] | None = None,
        grace: timedelta = timedelta(0),
        name: str | None = None,
    ) -> Stream:
        """Every pair of this stream's and ``other``'s values with one key, at most ``within`` apart.

        Each pair is emitted once, when the second of the two comes (in id order across the
        app's topics); ``merge(left, right)`` makes its value (default ``{"left", "right"}``).
        ``timestamp``: the event time of both sides' values (a field or a function of
        (value, ctx); default the entry's id time). A value whose interval closed (its time plus
        ``within`` plus ``grace`` behind the join's stream time) is late: counted, not joined.
        ``name`` (default ``TOPIC.join-N``) names the kept values' state.
        """
        if not isinstance(other, Stream) or other._flow is not self._flow:
            raise ConfigError("Stream.join_interval: the other stream must be a stream of the same app")
        if merge is not None:
            _check_function("join_interval", merge, 2)
        within_ms, grace_ms = ms("within", within, 0), ms("grace", grace, 0)
        flow = self._flow
        topics = [self._one_root("join_interval"), other._one_root("join_interval")]
        join_name = name if name is not None else f"{topics[0]}.join-{flow.joins_on(topics[0]) + 1}"
        spec = WindowSpec("join", within_ms, 0, grace_ms)
        sides = tuple(
            JoinSide(f"{join_name}.{side}", topic, spec, timestamp, stream._value_type(), join_name)
            for side, topic, stream in (("left", topics[0], self), ("right", topics[1], other))
        )
        join = IntervalJoin(join_name, (sides[0], sides[1]), merge)
        for kept in sides:
            flow.window(kept)
        out = Node("joined", None, False, name=join_name)
        for index, stream in enumerate((self, other)):
            side = ("left", "right")[index]
            side_node = Node("join", None, False, join=join, name=join_name, side=side, within_ms=within_ms)
            flow.add([stream._node], side_node)
            flow.add([side_node], out)
        flow.joins.append(join)
        return Stream(flow, out)

    def join_asof(
        self,
        table: Table,
        timestamp: str | Callable[[Any, Any], Any] | None = None,
        merge: Callable[[Any, Any], Any] | None = None,
    ) -> Stream:
        """Each value with its key's row in the versioned ``table`` current at the value's time.

        The row is the one with the latest event time at or before the value's (None when there
        is none), among the table's updates before the value's entry in id order.
        ``merge(value, row)`` makes the value that goes on (default ``{"left", "right"}``);
        ``timestamp``: the value's event time (a field or a function of (value, ctx); default the
        entry's id time).
        """
        if not isinstance(table, Table) or table.is_global or table.versioned_ms is None:
            raise ConfigError(
                f"Stream.join_asof: {table!r} is not a versioned table: declare it with "
                "app.table(topic, versioned=timedelta(...))"
            )
        if merge is not None:
            _check_function("join_asof", merge, 2)
        reader = timestamp_reader(f"join_asof({table.name!r})", timestamp)
        self._flow.asof_tables.add(table.name)
        return self._add(Node("asof", merge, False, table=table.name, timestamp=timestamp, reader=reader))

    def _one_root(self, what: str) -> str:
        topics = sorted(self._flow.roots_of(self._node))
        if len(topics) != 1:
            raise ConfigError(
                f"Stream.{what}: the stream merges topics {topics}: its values need one stream time "
                "(of one source), so join or window each topic's stream before concat, or group_by "
                "them into one topic"
            )
        return topics[0]

    def _value_type(self) -> Any:
        """The type of the stream's values, when no step changed them since its topic's."""
        node = self._node
        return node.value_type if isinstance(node, Source) and node.value_type is not None else Any

    def concat(self, other: Stream) -> Stream:
        """The values of both streams (of one app), each in its own entry's order."""
        if not isinstance(other, Stream) or other._flow is not self._flow:
            raise ConfigError("Stream.concat: the other stream must be a stream of the same app")
        if other._node is self._node:
            raise ConfigError("Stream.concat: a stream cannot be merged with itself")
        node = Node("concat")
        self._flow.add([self._node, other._node], node)
        return Stream(self._flow, node)

    # -- helpers -------------------------------------------------------------------------------------

    def _then(self, kind: str, fn: Callable[..., Any]) -> Stream:
        return self._add(Node(kind, fn, _check_function(kind, fn, 1)))

    def _add(self, node: Node) -> Stream:
        self._flow.add([self._node], node)
        return Stream(self._flow, node)

    def __repr__(self) -> str:
        return f"Stream({', '.join(sorted(self._flow.roots_of(self._node)))}: {self._node.label()})"


class WindowedStream:
    """A stream grouped into windows, waiting for its aggregations (``agg``)."""

    __slots__ = ("_late", "_name", "_spec", "_stream", "_timestamp")

    def __init__(
        self,
        stream: Stream,
        spec: WindowSpec,
        timestamp: str | Callable[[Any, Any], Any] | None,
        late: LatePolicy,
        name: str | None,
    ) -> None:
        self._stream = stream
        self._spec = spec
        self._timestamp = timestamp
        self._late = late
        self._name = name

    def agg(self, emit: Emit = "final", **aggregations: Aggregate) -> Stream:
        """A stream of window results ``{"key", "start", "end", NAME: value, ...}``.

        ``emit="final"``: one result per window, when stream time closes it (the steps after
        it run then, with no entry: their functions take ``(value)`` only); ``"update"``: the
        window's result after every value that changes it, from that value's entry.
        """
        flow, node = self._stream._flow, self._stream._node
        if emit not in ("final", "update"):
            raise ConfigError(f"Stream.window(...).agg: emit must be 'final' or 'update', got {emit!r}")
        _check_aggregations(aggregations, self._spec)
        topic = self._stream._one_root("window")
        name = self._name if self._name is not None else f"{topic}.window-{flow.windows_on(topic) + 1}"
        aggregation = ChainWindow(name, topic, self._spec, aggregations, emit, self._timestamp, self._late)
        flow.window(aggregation)
        window = Node("window", None, False, aggregation=aggregation, spec=self._spec, emit=emit, name=name)
        flow.add([node], window)
        return Stream(flow, window)


def _check_aggregations(aggregations: dict[str, Aggregate], spec: WindowSpec) -> None:
    if not aggregations:
        raise ConfigError(
            "Stream.window(...).agg: name at least one aggregation, e.g. total=agg.Sum('amount')"
        )
    for name, aggregate in aggregations.items():
        if name in RESULT_FIELDS:
            raise ConfigError(
                f"Stream.window(...).agg: {name!r} is a field of every result; name the aggregation otherwise"
            )
        if not isinstance(aggregate, Aggregate):
            raise ConfigError(
                f"Stream.window(...).agg: {name}= must be an aggregation from pspf.agg, got {aggregate!r}"
            )
        if spec.kind == "session" and isinstance(aggregate, Reduce) and aggregate.merger is None:
            raise ConfigError(
                f"Stream.window(...).agg: {name}={aggregate!r} needs merge= in a session window "
                "(an entry that bridges two sessions merges their accumulators)"
            )


def _check_function(what: str, fn: Any, values: int) -> bool:
    """Whether ``fn`` takes the context after its ``values`` value arguments; refuse what it cannot take."""
    name = getattr(fn, "__qualname__", repr(fn))
    if not callable(fn):
        raise ConfigError(f"Stream.{what}: expected a function, got {fn!r}")
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"Stream.{what}: {name} must be a plain def, not async")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False  # a builtin without a signature: called with the value alone
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if values == 2:
        if len(required) != 2:
            raise ConfigError(f"Stream.{what}: {name} must take (value, state)")
        return False
    if not positional or len(required) > 2:
        raise ConfigError(f"Stream.{what}: {name} must take (value) or (value, ctx)")
    return len(required) == 2


def _key_function(what: str, key: Any, required: bool) -> Callable[..., Any] | None:
    """A key given as a field name or a function, as a function ``(value, ctx) -> key``."""
    if key is None:
        if required:
            raise ConfigError(f"Stream.{what}: key is required (a function of the value, or a field name)")
        return None
    if isinstance(key, str):
        name = key

        def field(value: Any, ctx: Any) -> Any:
            found = value.get(name) if type(value) is dict else getattr(value, name, None)
            if found is None:
                raise ConfigError(f"Stream.{what}: the value has no key field {name!r}")
            return found

        field.__qualname__ = f"field {name!r}"
        return field
    if _check_function(what, key, 1):
        return key  # type: ignore[no-any-return]
    one = key

    def of_value(value: Any, ctx: Any) -> Any:
        return one(value)

    of_value.__qualname__ = getattr(key, "__qualname__", repr(key))
    return of_value


def _walk(root: Node) -> Iterable[Node]:
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(node.children)


def _tree(node: Node) -> dict[str, Any]:
    step: dict[str, Any] = {"step": node.label()}
    window = node.params.get("aggregation")
    if window is not None:
        parts = zip(window.names, window.parts, strict=True)
        step["aggregations"] = {name: repr(part) for name, part in parts}
    if node.kind == "group_by":
        step["then"] = [f"(read back from {node.params['topic']})"]
    else:
        step["then"] = [_tree(child) for child in node.children]
    return step


def _type_name(value_type: Any) -> str:
    if value_type is None:
        return "any JSON"
    return getattr(value_type, "__qualname__", repr(value_type))


def _shown(value: Any) -> str:
    if callable(value):
        return str(getattr(value, "__qualname__", value))
    if isinstance(value, WindowSpec):
        return f"{value.kind}(size={value.size_ms}ms, step={value.step_ms}ms, grace={value.grace_ms}ms)"
    return repr(value)
