"""A topic's schema: the JSON Schema (draft 2020-12) subset PSPF checks, compiled once to a msgspec type.

Checking a value is decoding it with a msgspec type built from the schema (``compile_schema``):
a Struct per object (its properties as fields, ``required`` without defaults, unknown properties
refused where ``additionalProperties`` is false), ``Annotated`` constraints for the bounds,
lengths and patterns, ``Literal`` for ``enum`` and ``const``, unions for type lists and
``anyOf``. So a check runs at msgspec's speed, and its error names the field and the rule
("Expected `int`, got `str` - at `$.amount`").

The subset (``check_schema`` refuses anything else, naming the keyword and where): ``type``,
``properties``, ``required``, ``additionalProperties`` (a boolean), ``items``, ``minItems``,
``maxItems``, ``enum``, ``const``, ``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum``, ``minLength``, ``maxLength``, ``pattern``, ``anyOf``, ``$defs`` with
``$ref`` to ``#/$defs/NAME``, and the annotations ``title``, ``description``, ``default``,
``format``, ``examples``, ``$schema``, ``$id``. What ``msgspec.json.schema`` makes of a Struct
is inside it.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import msgspec

from pspf.errors import ConfigError, SchemaError

TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
ANNOTATIONS = frozenset({"title", "description", "default", "format", "examples", "$schema", "$id"})
_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "anyOf",
        "$defs",
        "$ref",
    }
)
#: keywords that need a ``type`` beside them (a schema without one would accept other types)
_TYPED = {
    "properties": "object",
    "required": "object",
    "additionalProperties": "object",
    "items": "array",
    "minItems": "array",
    "maxItems": "array",
    "minimum": "number",
    "maximum": "number",
    "exclusiveMinimum": "number",
    "exclusiveMaximum": "number",
    "minLength": "string",
    "maxLength": "string",
    "pattern": "string",
}


def check_schema(doc: Any) -> dict[str, Any]:
    """``doc`` if it is a schema of the subset PSPF checks, else ConfigError naming what and where."""
    if not isinstance(doc, dict):
        raise ConfigError(f"a schema is a JSON object, got {type(doc).__name__}")
    defs = doc.get("$defs", {})
    if not isinstance(defs, dict):
        raise ConfigError("schema: $defs must be an object")
    _check_node(doc, "$", defs, root=True)
    for name, node in defs.items():
        _check_node(node, f"$defs.{name}", defs, root=False)
    compile_schema(doc)  # what msgspec cannot check (a union of two object types) is refused here
    return doc


def _check_node(node: Any, where: str, defs: dict[str, Any], root: bool) -> None:
    if node is True or node == {}:
        return
    if not isinstance(node, dict):
        raise ConfigError(f"schema: {where}: a schema is an object (or true), got {node!r}")
    _check_keywords(node, where, defs, root)
    for name, sub in (node.get("properties") or {}).items():
        _check_node(sub, f"{where}.{name}", defs, root=False)
    if "items" in node:
        _check_node(node["items"], f"{where}[]", defs, root=False)
    for n, sub in enumerate(node.get("anyOf") or []):
        _check_node(sub, f"{where}.anyOf[{n}]", defs, root=False)


def _check_keywords(node: dict[str, Any], where: str, defs: dict[str, Any], root: bool) -> None:
    """One node's own keywords: known, beside the type they apply to, with values of their kind."""
    for keyword in node:
        if keyword not in ANNOTATIONS and (keyword not in _KEYWORDS or (keyword == "$defs" and not root)):
            raise ConfigError(f"schema: {where}: {keyword!r} is not supported (see the contracts guide)")
    types = _types(node, where)
    for keyword, needs in _TYPED.items():
        if keyword in node and not any(t == needs or (needs == "number" and t == "integer") for t in types):
            raise ConfigError(f'schema: {where}: {keyword!r} needs "type": {needs!r} beside it')
    ref = node.get("$ref")
    if ref is not None and (
        not isinstance(ref, str) or not ref.startswith("#/$defs/") or ref[8:] not in defs
    ):
        raise ConfigError(f"schema: {where}: $ref {ref!r} must name an entry of $defs (#/$defs/NAME)")
    if not isinstance(node.get("additionalProperties", True), bool):
        raise ConfigError(f"schema: {where}: additionalProperties must be true or false")
    if "anyOf" in node and any(k not in ANNOTATIONS and k != "anyOf" for k in node):
        raise ConfigError(
            f"schema: {where}: anyOf beside other keywords is not supported: move them into its branches"
        )
    if "pattern" in node:
        _check_pattern(node["pattern"], where)
    for value in node.get("enum", []) + ([node["const"]] if "const" in node else []):
        if isinstance(value, bool) or not (value is None or isinstance(value, (str, int))):
            raise ConfigError(
                f"schema: {where}: enum and const take strings, integers and null, got {value!r}"
            )


def _check_pattern(pattern: Any, where: str) -> None:
    try:
        re.compile(pattern)
    except (TypeError, re.error) as exc:
        raise ConfigError(
            f"schema: {where}: pattern {pattern!r} is not a regular expression: {exc}"
        ) from None


def _types(node: dict[str, Any], where: str) -> list[str]:
    kind = node.get("type")
    if kind is None:
        return []
    types = [kind] if isinstance(kind, str) else kind
    if not isinstance(types, list) or not types or any(t not in TYPES for t in types):
        raise ConfigError(f"schema: {where}: type must be one of {', '.join(TYPES)} (or a list of them)")
    return list(types)


class _Builder:
    """Builds the msgspec type of a schema: one Struct per object node, ``$defs`` built once each."""

    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs
        self.built: dict[str, Any] = {}
        self.count = 0

    def node(self, node: Any) -> Any:
        if node is True or node == {}:
            return Any
        if "$ref" in node:
            name = node["$ref"][8:]
            if name not in self.built:
                self.built[name] = Any  # a recursive reference checks nothing below itself
                self.built[name] = self.node(self.defs[name])
            return self.built[name]
        if "const" in node:
            return Literal[node["const"]]
        if "enum" in node:
            return Literal[tuple(node["enum"])]
        if "anyOf" in node:
            kinds = [self.node(sub) for sub in node["anyOf"]]
        else:
            kinds = [self.typed(node, t) for t in (_types(node, "$") or ["any"])]
        if len(kinds) == 1:
            return kinds[0]
        return Union[tuple(kinds)]  # noqa: UP007 - built at run time

    def typed(self, node: dict[str, Any], kind: str) -> Any:
        if kind == "any":
            return Any
        if kind == "object":
            return self.struct(node)
        if kind == "array":
            items = self.node(node["items"]) if "items" in node else Any
            return _annotated(list[items], min_length=node.get("minItems"), max_length=node.get("maxItems"))  # type: ignore[valid-type]
        if kind == "string":
            return _annotated(
                str,
                min_length=node.get("minLength"),
                max_length=node.get("maxLength"),
                pattern=node.get("pattern"),
            )
        if kind in ("integer", "number"):
            return _annotated(
                int if kind == "integer" and _whole(node) else float,
                ge=node.get("minimum"),
                le=node.get("maximum"),
                gt=node.get("exclusiveMinimum"),
                lt=node.get("exclusiveMaximum"),
            )
        return {"boolean": bool, "null": None}[kind]

    def struct(self, node: dict[str, Any]) -> Any:
        properties: dict[str, Any] = node.get("properties") or {}
        required = list(node.get("required") or [])
        if not properties and not required and node.get("additionalProperties", True):
            return dict[str, Any]
        self.count += 1
        fields: list[Any] = []
        rename: dict[str, str] = {}
        for n, name in enumerate([*properties, *[r for r in required if r not in properties]]):
            attribute = f"f{n}"
            rename[attribute] = name
            kind = self.node(properties[name]) if name in properties else Any
            fields.append((attribute, kind) if name in required else (attribute, kind, msgspec.UNSET))
        fields.sort(key=lambda field: len(field) == 3)  # required fields first
        return msgspec.defstruct(
            f"Object{self.count}",
            fields,
            kw_only=True,
            rename=rename,
            forbid_unknown_fields=node.get("additionalProperties", True) is False,
        )


def _whole(node: dict[str, Any]) -> bool:
    """Whether an integer's bounds are whole numbers (msgspec's int constraints take ints)."""
    bounds = [node.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
    return all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in bounds)


def _annotated(kind: Any, **constraints: Any) -> Any:
    given = {k: v for k, v in constraints.items() if v is not None}
    if not given:
        return kind
    for name, value in given.items():
        if name != "pattern" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
        ):
            raise ConfigError(f"schema: {name} must be a number, got {value!r}")
    return Annotated[kind, msgspec.Meta(**given)]


def compile_schema(doc: dict[str, Any]) -> Any:
    """The msgspec type that accepts exactly the values ``doc`` accepts (within the subset)."""
    builder = _Builder(doc.get("$defs") or {})
    kind = builder.node(doc)
    try:
        msgspec.json.Decoder(kind)
    except TypeError as exc:
        raise ConfigError(f"schema: PSPF cannot check it: {exc}") from None
    return kind


class Checker:
    """One schema version of a topic, compiled: checks values as JSON or msgpack bytes."""

    __slots__ = ("_msgpack", "decoder", "kind", "topic", "version")

    def __init__(self, topic: str, version: int, doc: dict[str, Any]) -> None:
        self.topic = topic
        self.version = version
        self.kind = kind = compile_schema(doc)
        #: decodes (so checks) a JSON value, raising msgspec's errors
        self.decoder: Callable[[bytes], Any] = msgspec.json.Decoder(kind).decode
        self._msgpack: Callable[[bytes], Any] = msgspec.msgpack.Decoder(kind).decode

    def check(self, raw: bytes, msgpack: bool = False) -> None:
        """Raise SchemaError (the field and the rule) when the value ``raw`` does not match."""
        try:
            (self._msgpack if msgpack else self.decoder)(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise SchemaError(f"topic {self.topic!r} schema v{self.version}: {exc}") from None

    def check_record(self, record: dict[str, str]) -> None:
        """Check a flat entry's fields (text), converted as a typed handler converts them ("3" is 3)."""
        try:
            msgspec.convert(record, self.kind, strict=False)
        except msgspec.ValidationError as exc:
            raise SchemaError(f"topic {self.topic!r} schema v{self.version}: {exc}") from None


def schema_of_type(spec: str) -> dict[str, Any]:
    """The JSON Schema of ``module:Type``: a msgspec type (``msgspec.json.schema``) or a pydantic model."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"--type {spec!r}: give MODULE:TYPE, e.g. myapp.models:Order")
    try:
        found: Any = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--type {spec!r}: {exc}") from None
    if hasattr(found, "model_json_schema"):  # a pydantic model
        return dict(found.model_json_schema())
    try:
        return dict(msgspec.json.schema(found))
    except TypeError as exc:
        raise ConfigError(f"--type {spec!r}: not a type msgspec can describe: {exc}") from None
