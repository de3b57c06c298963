"""Schema compatibility for data contracts: whether a reader schema accepts all a writer accepts.

A topic's contract is a JSON Schema (draft 2020-12, the subset PSPF supports). Before a new version
is stored, ``check_change`` compares it with the current one the way Confluent's registry does:

- ``backward``: the new schema reads everything the old one accepted (reader = new, writer = old);
- ``forward``: the old schema reads everything the new one accepts (reader = old, writer = new);
- ``full``: both; ``none``: no check.

``problems(reader, writer)`` lists every way a value valid under the writer may be invalid under the
reader, each naming a path (``$``, ``$.amount``, ``$.items[]``) and the rule. The check is sound and
conservative: when it cannot prove a value is accepted (a differing ``pattern``, a recursive ``$ref``)
it reports a problem rather than accept a change that could break consumers.

Rules worth knowing when evolving a contract:

- Required fields: a field the reader requires is satisfied only if the writer requires it too.
  JSON Schema has no "a default fills a missing field" semantics, so a ``default`` is an annotation
  and does not change the verdict: adding a required field is refused under ``backward`` even with
  a default; adding an optional one is not refused for being missing.
- New fields: PSPF assumes a topic's producers write only the fields its schema names (every door
  checks values against the current version, and a value is whatever the app built from its
  type). So a property only the reader defines is a new field, and adding an optional one is
  backward compatible, as in Avro, even where the old schema left other properties open
  (Confluent's JSON Schema rules refuse that case: "a property added to an open content model").
  It is forward compatible when the old schema is open, refused when it is closed
  (``additionalProperties: false``); removing a field is the mirror image.
- Numbers: an ``integer`` value is also a ``number`` value, so integer -> number is a widening.
- ``anyOf``: each writer branch must be accepted by the reader; against a reader ``anyOf`` each
  writer branch (or each writer type) must be accepted by a single reader branch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

COMPAT_MODES = ("backward", "forward", "full", "none")

_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "format", "$schema", "$id", "examples", "$comment", "$defs"}
)
_OBJECT_KEYS = frozenset({"properties", "additionalProperties"})
_REF_PREFIX = "#/$defs/"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def problems(reader: Any, writer: Any) -> list[str]:
    """Every way a value valid under ``writer`` may be invalid under ``reader``; empty means compatible."""
    found = _compare(_At(reader, _Side(reader, True)), _At(writer, _Side(writer, False)), "$")
    return list(dict.fromkeys(found))


def check_change(old: Any, new: Any, compat: str) -> list[str]:
    """The problems that refuse replacing ``old`` by ``new`` under a compatibility mode."""
    if compat == "none":
        return []
    if compat == "backward":
        return problems(new, old)
    if compat == "forward":
        return problems(old, new)
    if compat == "full":
        return [f"backward: {p}" for p in problems(new, old)] + [f"forward: {p}" for p in problems(old, new)]
    raise ValueError(f"unknown compatibility mode {compat!r}; expected one of {', '.join(COMPAT_MODES)}")


class _RefError(Exception):
    """A $ref that cannot be followed; the message is the problem to report."""


@dataclass(frozen=True)
class _Side:
    """One schema document and the $refs expanded on the way down, to spot cycles."""

    root: Any
    is_reader: bool
    stack: tuple[str, ...] = ()


@dataclass(frozen=True)
class _At:
    """A schema node together with the document its $refs resolve against."""

    node: Any
    side: _Side

    def child(self, node: Any) -> _At:
        return _At(node, self.side)

    def resolved(self) -> _At:
        """Follow $refs (merging sibling keywords); ``true`` becomes ``{}``. Raises _RefError."""
        node, side = self.node, self.side
        while isinstance(node, dict) and "$ref" in node:
            ref = node["$ref"]
            if ref in side.stack:
                raise _RefError(f"recursive $ref not supported ({ref})")
            target = _lookup(side.root, ref)
            extra = {k: v for k, v in node.items() if k != "$ref" and k not in _ANNOTATIONS}
            node = _merge_ref(target, extra, side.is_reader, ref)
            side = _Side(side.root, side.is_reader, (*side.stack, ref))
        return _At({} if node is True else node, side)


def _lookup(root: Any, ref: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith(_REF_PREFIX):
        raise _RefError(f"unsupported $ref {ref!r} (only #/$defs/Name)")
    name = ref[len(_REF_PREFIX) :].replace("~1", "/").replace("~0", "~")
    defs = root.get("$defs") if isinstance(root, dict) else None
    if not isinstance(defs, dict) or name not in defs:
        raise _RefError(f"$ref {ref!r} not found in $defs")
    return defs[name]


def _merge_ref(target: Any, extra: dict[str, Any], is_reader: bool, ref: str) -> Any:
    """A $ref with sibling keywords is their conjunction, merged when that is exact.

    On the writer side dropping a clashing keyword only widens the writer, which is safe; on the
    reader side it would widen the reader, so a clash is reported instead.
    """
    if target is False or not extra:
        return target
    base: dict[str, Any] = {} if target is True else target
    clashes = _clashes(base, extra)
    if clashes and is_reader:
        raise _RefError(f"cannot combine $ref {ref} with sibling keyword(s) {', '.join(sorted(clashes))}")
    return {**extra, **base}


def _clashes(a: dict[str, Any], b: dict[str, Any]) -> set[str]:
    """Keywords whose meaning changes when two nodes' keywords are put in one node."""
    found = (set(a) & set(b)) - _ANNOTATIONS
    if _OBJECT_KEYS & set(a) and _OBJECT_KEYS & set(b):
        found.add("additionalProperties")
    return found


# --- comparing schemas -------------------------------------------------------------------------


def _compare(r: _At, w: _At, path: str) -> list[str]:
    """Dispatch: the writer's alternatives first, then finite writers, then the reader's anyOf."""
    try:
        r, w = r.resolved(), w.resolved()
    except _RefError as exc:
        return [f"{path}: {exc}"]
    if w.node is False or _anything(r.node):
        return []
    if r.node is False:
        return [f"{path}: the reader accepts no value here, the writer does"]
    if "anyOf" in w.node:
        return _writer_any_of(r, w, path)
    values = _finite_values(w)
    if values is not None:
        return _check_values(r, values, path)
    if "anyOf" in r.node:
        return _reader_any_of(r, w, path)
    return _compare_plain(r, w, path)


def _anything(node: Any) -> bool:
    return isinstance(node, dict) and all(key in _ANNOTATIONS for key in node)


def _writer_any_of(r: _At, w: _At, path: str) -> list[str]:
    """A value of the writer matches one branch, so every branch must be accepted."""
    base = {k: v for k, v in w.node.items() if k != "anyOf"}
    out: list[str] = []
    for branch in w.node["anyOf"]:
        try:
            b = w.child(branch).resolved()
        except _RefError as exc:
            out.append(f"{path}: {exc}")
            continue
        if b.node is not False:
            out += _compare(r, b.child({**base, **b.node}), path)
    return out


def _reader_any_of(r: _At, w: _At, path: str) -> list[str]:
    """Each writer alternative must fit one reader branch (and the reader's other keywords)."""
    base = {k: v for k, v in r.node.items() if k != "anyOf"}
    out = _compare(r.child(base), w, path)
    branches = [r.child(b) for b in r.node["anyOf"]]
    for part in _split_types(w):
        out += _best_branch(branches, part, path)
    return out


def _split_types(w: _At) -> list[_At]:
    """A writer with several types is a union of single-type writers; each may fit another branch."""
    types = w.node.get("type")
    if isinstance(types, list) and len(types) > 1:
        return [w.child({**w.node, "type": t}) for t in types]
    return [w]


def _best_branch(branches: list[_At], w: _At, path: str) -> list[str]:
    best: list[str] | None = None
    for branch in branches:
        found = _compare(branch, w, path)
        if not found:
            return []
        if best is None or len(found) < len(best):
            best = found
    detail = f" (closest branch: {best[0]})" if best else ""
    what = _join(_types_of(w.node)) if _types_of(w.node) is not None else "values of any type"
    return [f"{path}: no branch of the reader's anyOf accepts the writer's {what}{detail}"]


def _finite_values(w: _At) -> list[Any] | None:
    """The values a writer allows when it lists them (enum, const, boolean/null only), else None."""
    node = w.node
    if "const" in node:
        values = [node["const"]]
    elif "enum" in node:
        values = list(node["enum"])
    else:
        types = _types_of(node)
        if types is None or not types <= {"boolean", "null"}:
            return None
        values = ([True, False] if "boolean" in types else []) + ([None] if "null" in types else [])
    if not all(v is None or isinstance(v, (str, int, float)) for v in values):
        return None
    return [v for v in values if _accepts(w, v, lenient=True)]


def _check_values(r: _At, values: list[Any], path: str) -> list[str]:
    return [
        f"{path}: the writer allows {_show(v)}, {_why_rejected(r, v)}"
        for v in values
        if not _accepts(r, v, lenient=False)
    ]


def _why_rejected(r: _At, value: Any) -> str:
    try:
        node = r.resolved().node
    except _RefError:
        node = None
    types = _types_of(node) if isinstance(node, dict) else None
    if types is not None and not types & _value_types(value):
        return f"the reader only {_join(types)} (a narrowed type)"
    if isinstance(node, dict) and "enum" in node and not any(_same(value, e) for e in node["enum"]):
        return "not in the reader's enum"
    if isinstance(node, dict) and "const" in node and not _same(value, node["const"]):
        return f"not the reader's const {_show(node['const'])}"
    return "which the reader rejects"


def _compare_plain(r: _At, w: _At, path: str) -> list[str]:
    """Neither side has alternatives: compare the type sets, then each shared type's keywords."""
    rn, wn = r.node, w.node
    if "const" in rn or "enum" in rn:
        listed = "const" if "const" in rn else "enum"
        return [
            f"{path}: the reader only accepts its {listed}, "
            f"the writer is not limited to it (a narrowed {listed})"
        ]
    out = _compare_types(rn, wn, path)
    shared = _shared_types(rn, wn)
    if "object" in shared:
        out += _compare_objects(r, w, path)
    if "array" in shared:
        out += _compare_arrays(r, w, path)
    if "string" in shared:
        out += _limits("minLength", "maxLength", rn, wn, path) + _compare_pattern(rn, wn, path)
    if shared & {"integer", "number"}:
        out += _compare_numbers(rn, wn, path, integer_only="number" not in shared)
    return out


def _types_of(node: dict[str, Any]) -> set[str] | None:
    t = node.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _reader_types(node: dict[str, Any]) -> set[str]:
    types = _types_of(node)
    types = set(_TYPES) if types is None else types
    return types | {"integer"} if "number" in types else types


def _shared_types(rn: dict[str, Any], wn: dict[str, Any]) -> set[str]:
    writer = _types_of(wn)
    return (set(_TYPES) if writer is None else writer) & _reader_types(rn)


def _compare_types(rn: dict[str, Any], wn: dict[str, Any], path: str) -> list[str]:
    writer = _types_of(wn)
    missing = (set(_TYPES) if writer is None else writer) - _reader_types(rn)
    if not missing:
        return []
    allows = "any type" if writer is None else _join(missing)
    reader = _types_of(rn) or set()
    only = f"the reader only {_join(reader)}" if reader else "the reader no type"
    return [f"{path}: the writer allows {allows}, {only} (a narrowed type)"]


def _compare_objects(r: _At, w: _At, path: str) -> list[str]:
    """Required names, additionalProperties, and each property on either side."""
    rn, wn = r.node, w.node
    rprops: dict[str, Any] = rn.get("properties", {})
    wprops: dict[str, Any] = wn.get("properties", {})
    r_open = rn.get("additionalProperties", True) is not False
    w_open = wn.get("additionalProperties", True) is not False
    out = [
        f"{_child(path, name)}: the reader requires it, the writer does not (a new required field)"
        for name in rn.get("required", [])
        if name not in wn.get("required", [])
    ]
    if w_open and not r_open:
        out.append(f"{path}: the reader forbids properties the writer allows (additionalProperties false)")
    for name, wsub in wprops.items():
        sub = _child(path, name)
        if name in rprops:
            out += _compare(r.child(rprops[name]), w.child(wsub), sub)
        elif not r_open:
            out.append(
                f"{sub}: removed in the reader while it forbids other properties (additionalProperties false)"
            )
    # A property only the reader defines: the writer's producers do not write fields their schema
    # does not name (the evolution rule PSPF keeps, as Avro does), so it is new, and fine unless
    # required (above).
    return out


def _compare_arrays(r: _At, w: _At, path: str) -> list[str]:
    rn, wn = r.node, w.node
    out = _limits("minItems", "maxItems", rn, wn, path)
    if wn.get("maxItems") != 0 and "items" in rn:
        out += _compare(r.child(rn["items"]), w.child(wn.get("items", True)), f"{path}[]")
    return out


def _limits(low: str, high: str, rn: dict[str, Any], wn: dict[str, Any], path: str) -> list[str]:
    """Length and size limits: the reader's may not be tighter (absent minimum 0, maximum none)."""
    out: list[str] = []
    if rn.get(low, 0) > wn.get(low, 0):
        out.append(
            f"{path}: {low} {rn[low]} in the reader, {wn.get(low, 'none')} in the writer (a tightened limit)"
        )
    rmax, wmax = rn.get(high), wn.get(high)
    if rmax is not None and (wmax is None or rmax < wmax):
        shown = "none" if wmax is None else wmax
        out.append(f"{path}: {high} {rmax} in the reader, {shown} in the writer (a tightened limit)")
    return out


def _compare_pattern(rn: dict[str, Any], wn: dict[str, Any], path: str) -> list[str]:
    pattern = rn.get("pattern")
    if pattern is None or pattern == wn.get("pattern"):
        return []
    return [f"{path}: cannot prove the writer's strings match the reader's pattern {pattern!r}"]


class _Bound(NamedTuple):
    value: float
    exclusive: bool
    text: str


def _bound(node: dict[str, Any], lower: bool) -> _Bound | None:
    """The tighter of the inclusive and the exclusive bound on one side, if any."""
    inclusive, exclusive = ("minimum", "exclusiveMinimum") if lower else ("maximum", "exclusiveMaximum")
    found = [_Bound(node[k], k == exclusive, f"{k} {node[k]}") for k in (inclusive, exclusive) if k in node]
    if not found:
        return None
    if lower:
        return max(found, key=lambda b: (b.value, b.exclusive))
    return min(found, key=lambda b: (b.value, not b.exclusive))


def _as_integers(bound: _Bound, lower: bool) -> _Bound:
    """An integer-only writer's bound as an inclusive integer, so ``> 4`` equals ``>= 5``."""
    if lower:
        value = math.floor(bound.value) + 1 if bound.exclusive else math.ceil(bound.value)
    else:
        value = math.ceil(bound.value) - 1 if bound.exclusive else math.floor(bound.value)
    return _Bound(value, False, bound.text)


def _compare_numbers(rn: dict[str, Any], wn: dict[str, Any], path: str, integer_only: bool) -> list[str]:
    out: list[str] = []
    for lower in (True, False):
        rb, wb = _bound(rn, lower), _bound(wn, lower)
        if rb is None:
            continue
        if wb is None:
            side = "lower" if lower else "upper"
            out.append(f"{path}: {rb.text} in the reader, no {side} bound in the writer (a tightened limit)")
        elif not _bound_ok(rb, _as_integers(wb, lower) if integer_only else wb, lower):
            out.append(f"{path}: {rb.text} in the reader, {wb.text} in the writer (a tightened limit)")
    return out


def _bound_ok(rb: _Bound, wb: _Bound, lower: bool) -> bool:
    looser = rb.value < wb.value if lower else rb.value > wb.value
    return looser or (rb.value == wb.value and (wb.exclusive or not rb.exclusive))


# --- validating single values (enum and const) ------------------------------------------------


def _accepts(at: _At, value: Any, lenient: bool) -> bool:
    """Whether a node accepts a scalar; ``lenient`` is the answer when that cannot be decided."""
    try:
        at = at.resolved()
    except _RefError:
        return lenient
    node = at.node
    if node is False:
        return False
    if not _scalar_ok(node, value, lenient):
        return False
    return "anyOf" not in node or any(_accepts(at.child(b), value, lenient) for b in node["anyOf"])


def _scalar_ok(node: dict[str, Any], value: Any, lenient: bool) -> bool:
    types = _types_of(node)
    if types is not None and not types & _value_types(value):
        return False
    if "const" in node and not _same(node["const"], value):
        return False
    if "enum" in node and not any(_same(e, value) for e in node["enum"]):
        return False
    if isinstance(value, str):
        return _string_ok(node, value, lenient)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number_ok(node, value)
    return True


def _value_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"integer", "number"} if float(value).is_integer() else {"number"}
    return {"string"} if isinstance(value, str) else set()


def _string_ok(node: dict[str, Any], value: str, lenient: bool) -> bool:
    if len(value) < node.get("minLength", 0) or len(value) > node.get("maxLength", math.inf):
        return False
    if "pattern" not in node:
        return True
    try:
        return re.search(node["pattern"], value) is not None
    except re.error:
        return lenient


def _number_ok(node: dict[str, Any], value: float) -> bool:
    return bool(
        value >= node.get("minimum", -math.inf)
        and value > node.get("exclusiveMinimum", -math.inf)
        and value <= node.get("maximum", math.inf)
        and value < node.get("exclusiveMaximum", math.inf)
    )


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``1 == 1.0`` but ``true`` is not ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


# --- wording -----------------------------------------------------------------------------------


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if _NAME.fullmatch(name) else f"{path}[{json.dumps(name)}]"


def _join(types: set[str] | None) -> str:
    return " or ".join(t for t in _TYPES if t in (types or set()))


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)
