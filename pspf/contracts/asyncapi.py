"""An AsyncAPI 3.0.0 document of an app (``pspf docs``): its topics as channels, with their payloads.

Each topic the app reads or writes is a channel (its address the topic name) with one message,
and the app's part in it is a ``receive`` operation (it reads the topic: a handler, window,
stream or table) and/or a ``send`` one (it writes it: ``ctx.emit`` to a topic declared with
``app.emits``, a chain's ``.to()``, a window's ``emit_to``, a ``group_by``'s re-keying topic).

A message's payload is the topic's schema registered in Redis when one is given (the one the
doors check against), else the JSON Schema of the value type the app declares (any JSON without
one). JSON Schema puts shared definitions under ``$defs`` and points at them with ``#/$defs/X``,
but an AsyncAPI document resolves references against the whole document: so the definitions
move to ``components/schemas`` and the references follow them there.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any

import msgspec

from pspf.contracts.registry import current_version
from pspf.windows.functions import declared_types

if TYPE_CHECKING:
    from pspf.app import App

log = logging.getLogger("pspf.contracts")

ASYNCAPI_VERSION = "3.0.0"

#: the roles in which the app reads a topic (a ``receive`` operation) and writes one (``send``)
READ_ROLES = ("read", "table", "global table", "re-keying")
WRITE_ROLES = ("emitted", "re-keying")

#: what a window emits when it closes: ``Aggregation.closed``; ``value`` is its accumulator
_WINDOW_FIELDS = {"key": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}

_DEF_PREFIXES = ("#/$defs/", "#/definitions/")
_COMPONENT_REF = "#/components/schemas/"
_NOT_A_NAME = re.compile(r"[^\w.\-]")


def asyncapi_document(app: App, schemas: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``app``; ``schemas`` (topic -> JSON Schema) win over value types."""
    registered = schemas or {}
    components: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for topic, roles in topic_roles(app).items():
        message = _message(app, topic, registered.get(topic), components)
        messages[topic] = message
        channels[topic] = {
            "address": topic,
            "description": "; ".join(f"{role} ({detail})" for role, detail in roles.items()),
            "messages": {topic: {"$ref": f"#/components/messages/{_pointer(topic)}"}},
            "x-pspf-roles": list(roles),
        }
        for action, wanted in (("receive", READ_ROLES), ("send", WRITE_ROLES)):
            if any(role in wanted for role in roles):
                operations[f"{action}.{topic}"] = {
                    "action": action,
                    "channel": {"$ref": f"#/channels/{_pointer(topic)}"},
                    "messages": [{"$ref": f"#/channels/{_pointer(topic)}/messages/{_pointer(topic)}"}],
                }
    found: dict[str, Any] = {"messages": messages}
    if components:
        found["schemas"] = components
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": app.name,
            "version": _pspf_version(),
            "description": f"The topics the PSPF app {app.name} reads and writes, with their messages.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": found,
    }


def topic_roles(app: App) -> dict[str, dict[str, str]]:
    """Each topic the app reads or writes: its roles (``READ_ROLES``, ``WRITE_ROLES``) and by what."""
    roles: dict[str, dict[str, str]] = {}

    def add(topic: str, role: str, detail: str) -> None:
        details = roles.setdefault(topic, {})
        details[role] = f"{details[role]}, {detail}" if role in details else detail

    described = app.describe()
    managed = set(app.managed_topics)
    for topic in app.handlers:
        if topic in app.tables:
            add(topic, "table", "the app keeps a table of it, looked up with ctx.table")
        elif topic in managed:
            add(topic, "re-keying", "a group_by step writes it and the app reads it back")
        else:
            for reader in _readers(app, described, topic):
                add(topic, "read", reader)
    for topic in app.global_tables:
        add(topic, "global table", "every worker holds all of it, looked up with ctx.table")
    for topic in app.outputs:
        add(topic, "emitted", "ctx.emit, declared with app.emits")
    for topic in app.dataflow.outputs:
        add(topic, "emitted", "a stream's .to()")
    for name, window in described["windows"].items():
        add(window["emit_to"], "emitted", f"the results of window {name}")
    return roles


def record_document(broker: Any, app: App) -> None:
    """Keep the app's document in its record, with the topics' registered schemas: the admin API serves it.

    A document that cannot be made (a value type msgspec cannot describe) is said and left out: it
    never stops a worker.
    """
    try:
        document = asyncapi_document(app, registered_schemas(broker, list(topic_roles(app))))
    except (TypeError, ValueError) as exc:
        log.warning("app %s: no AsyncAPI document recorded: %s", app.name, exc)
        return
    broker.apps.record_asyncapi(app.name, msgspec.json.encode(document))


def registered_schemas(broker: Any, topics: list[str]) -> dict[str, dict[str, Any]]:
    """The current schema registered in Redis of each of ``topics`` that has one."""
    current = {topic: current_version(broker, topic) for topic in topics}
    return {topic: version.schema for topic, version in current.items() if version is not None}


def _readers(app: App, described: dict[str, Any], topic: str) -> list[str]:
    """What reads ``topic``: its handler, its windows, a stream."""
    readers = [f"handler {described['handlers'][topic]}"] if topic in described["handlers"] else []
    readers += [f"window {name}" for name, w in described["windows"].items() if w["topic"] == topic]
    if topic in app.dataflow.sources:
        readers.append("a stream")
    return readers


def _message(
    app: App, topic: str, registered: dict[str, Any] | None, components: dict[str, Any]
) -> dict[str, Any]:
    """The topic's message: its payload from the registered schema, or from the app's value types."""
    message: dict[str, Any] = {"name": topic}
    if registered is not None:
        message["payload"] = hoist(registered, components)
        message["description"] = "The topic's current schema, registered in Redis."
        return message
    for source, build in (
        ("The value type the app reads the topic as.", _read_schema),
        ("The value type declared with app.emits.", _emitted_schema),
        (
            "What its windows emit when they close: key, start, end and value (the accumulator).",
            _window_schema,
        ),
    ):
        payload = build(app, topic, components)
        if payload:
            message["payload"] = payload
            message["description"] = source
            return message
    message["payload"] = {}
    message["description"] = "Any JSON value: the app declares no value type for the topic."
    return message


def _read_schema(app: App, topic: str, components: dict[str, Any]) -> dict[str, Any]:
    """The schema of what reading ``topic`` accepts: a value of each type its readers decode into."""
    table = app.tables.get(topic) or app.global_tables.get(topic)
    if table is not None:
        if table.value_type is Any:
            return {}
        return type_schema(table.value_decoder.value_type, components)  # or JSON null: a row deleted
    handler = app.handlers.get(topic)
    if handler is None:
        return {}
    value_type = handler.decoder.value_type
    types = list(value_type) if isinstance(value_type, tuple) else [value_type]
    found = [s for s in (type_schema(t, components) for t in types) if s]
    if len(found) > 1:  # one attempt decodes the entry into each type: it must be all of them
        return {"allOf": found}
    return found[0] if found else {}


def _emitted_schema(app: App, topic: str, components: dict[str, Any]) -> dict[str, Any]:
    return type_schema(app.outputs.get(topic), components)


def _window_schema(app: App, topic: str, components: dict[str, Any]) -> dict[str, Any]:
    """``{"key", "start", "end", "value"}`` of each window emitting to ``topic`` (one of them)."""
    found = []
    for window in app.windows.values():
        if window.emit_to != topic or window.chained:
            continue
        value = type_schema(declared_types(window.func)[0], components)
        found.append(
            {
                "type": "object",
                "properties": {**_WINDOW_FIELDS, "value": value},
                "required": ["key", "start", "end", "value"],
            }
        )
    if len(found) > 1:
        return {"anyOf": found}
    return found[0] if found else {}


def type_schema(value_type: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a msgspec type, its definitions moved into ``components``; any JSON: {}."""
    if value_type is None or value_type is Any:
        return {}
    try:
        schema = msgspec.json.schema(value_type)
    except TypeError:  # a type msgspec decodes with a hook but cannot describe
        return {"description": f"a value of {getattr(value_type, '__qualname__', repr(value_type))}"}
    return hoist(schema, components)


def hoist(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` (or ``definitions``) moved into ``components``, refs rewritten.

    A definition whose name another one holds already (not the same schema) is renamed, so two
    types of one name in different modules stay apart.
    """
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    names = {name: _NOT_A_NAME.sub("_", name) for name in defs}
    while True:
        moved = {name: _rewrite(node, names) for name, node in defs.items()}
        clashes = [n for n in defs if names[n] in components and components[names[n]] != moved[n]]
        if not clashes:
            break
        for name in clashes:
            names[name] = _free_name(names[name], components, set(names.values()))
    for name, node in moved.items():
        components[names[name]] = node
    dropped = ("$defs", "definitions", "$schema", "$id")
    root = _rewrite({k: v for k, v in schema.items() if k not in dropped}, names)
    assert isinstance(root, dict)
    return root


def _rewrite(node: Any, names: dict[str, str]) -> Any:
    """``node`` with each ``#/$defs/X`` (or ``#/definitions/X``) pointing into ``components/schemas``."""
    if isinstance(node, list):
        return [_rewrite(item, names) for item in node]
    if not isinstance(node, dict):
        return node
    rewritten = {key: _rewrite(value, names) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        rewritten["$ref"] = _moved_ref(ref, names)
    return rewritten


def _moved_ref(ref: str, names: dict[str, str]) -> str:
    for prefix in _DEF_PREFIXES:
        if ref.startswith(prefix):
            step, slash, rest = ref[len(prefix) :].partition("/")
            name = step.replace("~1", "/").replace("~0", "~")
            if name in names:
                return f"{_COMPONENT_REF}{names[name]}{slash}{rest}"
    return ref


def _free_name(name: str, components: dict[str, Any], taken: set[str]) -> str:
    number = 2
    while f"{name}{number}" in components or f"{name}{number}" in taken:
        number += 1
    return f"{name}{number}"


def _pointer(name: str) -> str:
    """``name`` as one step of a JSON pointer."""
    return name.replace("~", "~0").replace("/", "~1")


def _pspf_version() -> str:
    try:
        return metadata.version("pspf")
    except metadata.PackageNotFoundError:
        return "0.0.0"
