"""How a topic's streams run: its root's graph compiled to the one function its entries run.

``compile_root`` walks a root's steps (``pspf.dataflow.stream``) into nested closures, so an
entry costs one Python call per step, no lookups by kind. It runs inside the entry's attempt
(``pspf.app``): what the steps write to state, emit, re-key and fold into windows joins the batch
only if every step of every branch returns; a step that raises fails the entry (retries, then the
DLQ), as a handler's error does.

Branches that do nothing (no ``to``, ``group_by``, window, ``apply`` or ``update`` after them) are
left out. The steps after a final window result run at its close, outside any entry: they may
not take ``ctx`` or keep state (``apply``, another window, a join).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pspf.dataflow.agg import AggregationError
from pspf.dataflow.joining import IntervalJoin
from pspf.dataflow.stream import Node, Source
from pspf.dataflow.windowing import ChainWindow, Step, nothing
from pspf.errors import ConfigError

#: Steps with an effect of their own: a branch without one below it is left out.
_EFFECTS = frozenset({"to", "to_view", "group_by", "window", "apply", "update"})
#: Steps that keep state: not after a final window result (no entry runs them)
_STATEFUL = frozenset({"apply", "window", "join", "asof"})


class Runner:
    """A topic's root as the function its entries run; compiled again when steps were added."""

    __slots__ = ("_compiled", "_version", "source")

    def __init__(self, source: Source) -> None:
        self.source = source
        self._compiled: Step | None = None
        self._version = -1

    def compile(self) -> Step:
        if self._compiled is None or self._version != self.source.version:
            self._compiled = compile_root(self.source)
            self._version = self.source.version
        return self._compiled

    def __call__(self, value: Any, ctx: Any) -> None:
        compiled = self._compiled
        if compiled is None or self._version != self.source.version:
            compiled = self.compile()
        compiled(value, ctx)


def compile_root(source: Source) -> Step:
    """The function of a topic's root: every useful branch under it, in declaration order."""
    return _children(source, closing=False, path=source.topic)


def _children(node: Node, closing: bool, path: str) -> Step:
    steps = [_compile(child, closing, path) for child in node.children if _useful(child)]
    if not steps:
        return nothing
    if len(steps) == 1:
        return steps[0]

    def fan_out(value: Any, ctx: Any) -> None:
        for step in steps:
            step(value, ctx)

    return fan_out


def _useful(node: Node) -> bool:
    if node.kind in _EFFECTS:
        return True
    return any(_useful(child) for child in node.children)


def _compile(node: Node, closing: bool, path: str) -> Step:
    """One step and everything after it; ``closing``: it runs at a final window's close."""
    where = f"{path} -> {node.label()}"
    if closing and (node.takes_ctx or node.kind in _STATEFUL):
        raise ConfigError(
            f"stream {where}: after a final window result, steps run when the window closes, with no "
            "entry: they take (value) only, and keep no state (no apply, window or join; group_by the "
            "results into a topic to window them again)"
        )
    kind = node.kind
    if kind == "window":
        window: ChainWindow = node.params["aggregation"]
        window.after = _children(node, closing=window.emit == "final", path=where)
        return window.step
    if kind == "join":
        join: IntervalJoin = node.params["join"]
        join.after = _children(node, closing, where)
        return join.step(0 if node.params["side"] == "left" else 1)
    nxt = _children(node, closing, where)
    fn = node.func
    if kind in ("concat", "joined"):
        return nxt
    if kind == "asof":
        return _asof(node.params["table"], node.params["reader"], fn, nxt)
    if kind == "to_view":
        return _viewing(node.params["view"], node.params["field"], node.params["value"])
    if kind in ("to", "group_by"):
        return _emitting(node.params["topic"], node.params["key"], kind == "group_by")
    assert fn is not None
    make = _WITH_CTX if node.takes_ctx else _PLAIN
    return make[kind](fn, nxt)


def _emitting(topic: str, key_fn: Callable[[Any, Any], Any] | None, rekey: bool) -> Step:
    if key_fn is None:

        def emit_keyed_as_entry(value: Any, ctx: Any) -> None:
            ctx.emit(topic, value, key=ctx.key or None)

        return emit_keyed_as_entry

    def emit_keyed(value: Any, ctx: Any) -> None:
        ctx.emit(topic, value, key=_text(key_fn(value, ctx), topic, rekey))

    return emit_keyed


def _viewing(
    name: str, field_fn: Callable[[Any, Any], Any] | None, value_fn: Callable[[Any, Any], Any] | None
) -> Step:
    def to_view(value: Any, ctx: Any) -> None:
        view = ctx.view(name)
        field = ctx.key if field_fn is None else field_fn(value, ctx)
        result = value if value_fn is None else value_fn(value, ctx)
        if view.kind == "hash":
            if result is None:
                del view[field]
            else:
                view[field] = result
        elif result is None:
            view.remove(field)
        else:
            view.add(field, result)

    return to_view


def _text(key: Any, topic: str, rekey: bool) -> str:
    if type(key) is str:
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    what = "group_by" if rekey else "to"
    raise AggregationError(f"{what}({topic!r}): the key must be a str or an int, got {key!r}")


# -- the stateless and stateful steps, as closures ---------------------------------------------------


def _asof(
    table: str, timestamp: Callable[[Any, Any], int], merge: Callable[[Any, Any], Any] | None, nxt: Step
) -> Step:
    def run(value: Any, ctx: Any) -> None:
        row = ctx.table(table, at=timestamp(value, ctx))
        nxt({"left": value, "right": row} if merge is None else merge(value, row), ctx)

    return run


def _filter(fn: Callable[[Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        if fn(value):
            nxt(value, ctx)

    return run


def _filter_ctx(fn: Callable[[Any, Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        if fn(value, ctx):
            nxt(value, ctx)

    return run


def _map(fn: Callable[[Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        nxt(fn(value), ctx)

    return run


def _map_ctx(fn: Callable[[Any, Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        nxt(fn(value, ctx), ctx)

    return run


def _update(fn: Callable[[Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        fn(value)
        nxt(value, ctx)

    return run


def _update_ctx(fn: Callable[[Any, Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        fn(value, ctx)
        nxt(value, ctx)

    return run


def _flat_map(fn: Callable[[Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        for item in fn(value):
            nxt(item, ctx)

    return run


def _flat_map_ctx(fn: Callable[[Any, Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        for item in fn(value, ctx):
            nxt(item, ctx)

    return run


def _apply(fn: Callable[[Any, Any], Any], nxt: Step) -> Step:
    def run(value: Any, ctx: Any) -> None:
        nxt(fn(value, ctx.state), ctx)

    return run


_PLAIN: dict[str, Callable[[Any, Step], Step]] = {
    "filter": _filter,
    "map": _map,
    "update": _update,
    "flat_map": _flat_map,
    "apply": _apply,
}
_WITH_CTX: dict[str, Callable[[Any, Step], Step]] = {
    "filter": _filter_ctx,
    "map": _map_ctx,
    "update": _update_ctx,
    "flat_map": _flat_map_ctx,
}
