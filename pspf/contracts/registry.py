"""A topic's schema versions as Redis keeps them, and the checks of one topic's values.

The versions live in the topic's schema hash (``keys.schemas_key``), one record each
(``Stored``); the current version is the highest. ``TopicChecks`` holds a topic's versions compiled
(``schema.Checker``) for the doors that write the topic and the workers that read it: an entry
names the version it was written under in its ``schema`` field (``codec.SCHEMA``), and is checked
against that one (the current one when it names none).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from pspf import codec
from pspf.codec import StateDecoder
from pspf.contracts.compat import check_change, problems
from pspf.contracts.schema import Checker, check_schema
from pspf.errors import ConfigError, SchemaError

Compat = Literal["backward", "forward", "full", "none"]
COMPAT_MODES: tuple[Compat, ...] = ("backward", "forward", "full", "none")


class SchemaVersion(msgspec.Struct, frozen=True, kw_only=True):
    """One version of a topic's schema, as kept in Redis and shown by ``pspf topic schema``."""

    topic: str
    version: int
    #: the compatibility the version was checked under when it was set
    compat: Compat
    set_at_ms: int
    schema: dict[str, Any]


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    """A version's record in the topic's schema hash."""

    compat: Compat
    set_at_ms: int
    schema: dict[str, Any]


_decode = msgspec.json.Decoder(Stored).decode


def read_versions(broker: Any, topic: str) -> dict[int, SchemaVersion]:
    """Every version of ``topic``'s schema (none: {}), by number."""
    return {
        version: stored_version(topic, version, raw)
        for version, raw in sorted(broker.topics.schemas(topic).items())
    }


def current_version(broker: Any, topic: str) -> SchemaVersion | None:
    """The current (highest) version of ``topic``'s schema; None when it has none."""
    versions = read_versions(broker, topic)
    return versions[max(versions)] if versions else None


def checkers(broker: Any, topic: str) -> dict[int, Checker]:
    """A compiled checker per version of ``topic``'s schema (none: {})."""
    return {v: Checker(topic, v, found.schema) for v, found in read_versions(broker, topic).items()}


def topic_checks(broker: Any, topic: str) -> TopicChecks:
    """``topic``'s schema versions compiled, read again from ``broker`` when an entry names a newer one."""
    return TopicChecks(topic, lambda: checkers(broker, topic))


def stored_version(topic: str, version: int, raw: bytes) -> SchemaVersion:
    stored = _decode(raw)
    return SchemaVersion(
        topic=topic, version=version, compat=stored.compat, set_at_ms=stored.set_at_ms, schema=stored.schema
    )


class TopicChecks:
    """A topic's schema versions, compiled: what doors check new values and workers entries against."""

    __slots__ = ("_load", "checkers", "topic")

    def __init__(self, topic: str, load: Callable[[], dict[int, Checker]]) -> None:
        self.topic = topic
        self._load = load
        self.checkers = load()

    @property
    def current(self) -> Checker | None:
        """The current version's checker (None: the topic has no schema)."""
        return self.checkers[max(self.checkers)] if self.checkers else None

    def of(self, version: bytes | None) -> Checker | None:
        """The checker of the version an entry names (read again when unknown), else the current one."""
        if version is None:
            return self.current
        try:
            number = int(version)
        except ValueError:
            raise SchemaError(f"topic {self.topic!r}: the entry names schema version {version!r}") from None
        if number not in self.checkers:
            self.checkers = self._load()
            if number not in self.checkers:
                raise SchemaError(f"topic {self.topic!r} has no schema v{number}, which the entry names")
        return self.checkers[number]


class CheckedDecoder:
    """A handler's decoder that first checks the entry's value against the schema version it names.

    The common entry (a JSON value naming a known version, or none) is checked by one call of the
    version's compiled decoder; anything else (msgpack, a flat record, an unknown version, a value
    that does not match) goes the long way, which says why.
    """

    __slots__ = ("_fast", "checks", "inner", "value_type")

    def __init__(self, inner: Any, checks: TopicChecks) -> None:
        self.inner = inner
        self.checks = checks
        self.value_type = inner.value_type
        self._fast: dict[bytes | None, Callable[[bytes], Any]] = {}
        self._learn()

    def _learn(self) -> None:
        """The decoder of each known version by the ``schema`` field naming it (None: the current one)."""
        checkers = self.checks.checkers
        self._fast = {b"%d" % version: checker.decoder for version, checker in checkers.items()}
        current = self.checks.current
        if current is not None:
            self._fast[None] = current.decoder

    def decode(self, fields: dict[bytes, bytes]) -> Any:
        """The value, once it matches; SchemaError (to the DLQ at once) when it does not."""
        raw = fields.get(codec.VALUE)
        if raw is not None and codec.ENCODING not in fields:
            check = self._fast.get(fields.get(codec.SCHEMA))
            if check is not None:
                try:
                    check(raw)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    pass  # the long way says why
                else:
                    return self.inner.decode(fields)
        self._check(fields, raw)
        return self.inner.decode(fields)

    def _check(self, fields: dict[bytes, bytes], raw: bytes | None) -> None:
        if raw is None:  # a flat record: its fields are the value, as text
            checker = self.checks.current
            if checker is not None:
                checker.check_record(
                    {k.decode(): v.decode() for k, v in fields.items() if k != codec.HEADERS}
                )
            return
        known = len(self.checks.checkers)
        checker = self.checks.of(fields.get(codec.SCHEMA))
        if len(self.checks.checkers) != known:
            self._learn()
        if checker is not None:
            checker.check(raw, msgpack=fields.get(codec.ENCODING) == codec.MSGPACK)


def described(value_type: Any) -> dict[str, Any] | None:
    """The JSON Schema of a value type; None for one msgspec cannot describe (``object``, a custom class)."""
    try:
        return dict(msgspec.json.schema(value_type))
    except TypeError:
        return None


def check_state(broker: Any, app: str, decoder: StateDecoder) -> None:
    """Refuse an app whose state type cannot read what its stores may hold; record what they may hold.

    The app record keeps the JSON Schemas of every state type whose values may still be stored
    (``msgspec.json.schema`` of the type of ``ctx.state``'s values). A new type must read each of them
    (``compat.problems``), or the app must migrate from a type that reads them
    (``App.migrate_state``): then the old schemas are kept, as keys are migrated only when read.
    """
    new = described(decoder.value_type)
    if new is None:  # a type msgspec cannot describe: nothing to record or compare
        return
    raw = broker.apps.state_schemas(app)
    stored: list[dict[str, Any]] = [] if raw is None else msgspec.json.decode(raw)
    unread = [old for old in stored if problems(new, old)]
    if unread and decoder.migrate is None:
        found = "; ".join(problems(new, unread[-1])[:3])
        raise ConfigError(
            f"app {app!r}: its state type {decoder.value_type!r} cannot read the state its stores hold "
            f"({found}): declare @app.migrate_state(OldType) with a function from the old state"
        )
    if unread and decoder.migrate is not None:
        source = described(decoder.migrate[0]) or {}
        left = [old for old in unread if problems(source, old)]
        if left:
            found = "; ".join(problems(source, left[-1])[:3])
            raise ConfigError(
                f"app {app!r}: @app.migrate_state({decoder.migrate[0]!r}) cannot read all the state its "
                f"stores hold ({found})"
            )
    kept = [*unread, new] if unread else [new]
    if kept != stored:
        broker.apps.record_state_schemas(app, msgspec.json.encode(kept))


def add_version(broker: Any, topic: str, schema: Any, compat: str) -> SchemaVersion:
    """Add ``schema`` as the topic's next version, once ``compat`` accepts it against the current one."""
    check_schema(schema)
    current = current_version(broker, topic)
    if current is not None:
        found = check_change(current.schema, schema, compat)
        if found:
            listed = "; ".join(found)
            raise ConfigError(
                f"topic {topic!r}: the schema is not {compat} compatible with v{current.version}: {listed}"
            )
    number = 1 if current is None else current.version + 1
    raw = msgspec.json.encode(Stored(compat=compat, set_at_ms=int(time.time() * 1000), schema=schema))  # type: ignore[arg-type]
    if not broker.topics.add_schema(topic, number, raw):
        raise ConfigError(f"topic {topic!r}: another schema was set meanwhile (v{number}); look again")
    return stored_version(topic, number, raw)


def check_value_types(broker: Any, app: Any) -> None:
    """At a worker's start: each typed handler reads its topic's schema (``App(schemas=...)``).

    "check" refuses a value type that cannot read the topic's current schema (``compat.problems``);
    "declare" also sets the value type's schema on a topic that has none; "off" does neither.
    """
    if app.schemas == "off":
        return
    for topic, handler in app.handlers.items():
        value_type = getattr(handler.decoder, "value_type", Any)
        if topic in app.tables or value_type is Any or isinstance(value_type, tuple):
            continue
        declared = described(value_type)
        if declared is None:
            continue
        current = current_version(broker, topic)
        if current is None:
            if app.schemas == "declare":
                add_version(broker, topic, declared, "backward")
            continue
        found = problems(declared, current.schema)
        if found:
            raise ConfigError(
                f"app {app.name!r}: the handler of topic {topic!r} reads {value_type!r}, which cannot read "
                f"the topic's schema v{current.version}: {found[0]}"
            )
