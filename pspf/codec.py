"""The entry wire format and the reusable msgspec codecs.

An entry is a Redis stream entry with the fields

- ``key``: the partition and state key, UTF-8 (optional);
- ``value``: the payload bytes, JSON unless ``encoding`` says ``msgpack``;
- ``headers``: a JSON object of strings (optional);
- ``encoding``: ``json`` (default) or ``msgpack`` (optional);
- ``schema``: the version of the topic's schema the value was checked against (optional).

An entry without a ``value`` field is a flat record: its field map (but ``headers``) is the value, so
``XADD 'pspf:{orders:0}' * user u1 amount 3`` is a valid input. Flat values are text, so a typed
handler receives them converted leniently (``"3"`` becomes ``3`` for an ``int`` field).

An entry whose ``headers`` are not a JSON object of strings, or that gives a field name twice, is
a DecodeError, as is a value that cannot be decoded.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import msgspec

from pspf.errors import ConfigError, DecodeError, StateError

KEY = b"key"
VALUE = b"value"
HEADERS = b"headers"
ENCODING = b"encoding"
MSGPACK = b"msgpack"
#: the version of the topic's schema a value was checked against when written (``pspf.contracts``)
SCHEMA = b"schema"

json_encoder = msgspec.json.Encoder()
state_encoder = msgspec.msgpack.Encoder()
state_decoder: msgspec.msgpack.Decoder[dict[str, Any]] = msgspec.msgpack.Decoder(dict[str, Any])


class StateDecoder:
    """Decodes a key's stored state into the value type an app declared for its state.

    With a migration (``App.migrate_state``), a stored state the type cannot read is read with the
    type it was written under and handed to the migration, whose result is the key's state: a key
    is migrated when it is read, and stored migrated when its batch commits.
    """

    __slots__ = ("_decoder", "_old", "_untyped", "migrate", "value_type")

    def __init__(
        self,
        value_type: Any = Any,
        migrate: tuple[Any, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
    ) -> None:
        self.value_type = value_type
        self._untyped = value_type is Any
        self._decoder: msgspec.msgpack.Decoder[dict[str, Any]] = msgspec.msgpack.Decoder(
            dict[str, value_type]
        )
        #: (the type the state was written under, the function from that state to this type's)
        self.migrate = migrate
        old_type: Any = None if migrate is None else migrate[0]
        self._old: msgspec.msgpack.Decoder[dict[str, Any]] | None = (
            None if migrate is None else msgspec.msgpack.Decoder(dict[str, old_type])
        )

    def decode(self, key: str, raw: bytes) -> dict[str, Any]:
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if self._old is not None and self.migrate is not None:
                return self._migrated(key, raw, exc)
            raise StateError(
                f"stored state of key {key!r} does not match the app's state type {self.value_type!r}: {exc}"
            ) from None

    def _migrated(self, key: str, raw: bytes, exc: Exception) -> dict[str, Any]:
        assert self._old is not None and self.migrate is not None
        try:
            old = self._old.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as old_exc:
            raise StateError(
                f"stored state of key {key!r} matches neither the app's state type {self.value_type!r} "
                f"({exc}) nor the one it migrates from, {self.migrate[0]!r} ({old_exc})"
            ) from None
        return self.migrate[1](old)

    def check(self, key: str, state: dict[Any, Any], raw: bytes) -> None:
        """StateError when ``raw``, the encoding of ``state``, would not read back with ``decode``.

        Without a declared state type, whatever msgspec encodes reads back once the top-level
        keys are strings: checking their types spares a decode per handled entry.
        """
        if self._untyped:
            for name in state:
                if type(name) is not str:
                    break
            else:
                return
        self.decode(key, raw)


def unreadable_state(key: str, state: dict[Any, Any], decode: Callable[[str, bytes], object]) -> str:
    """Why ``decode``, the app's read of the state of ``key``, cannot read ``state`` back.

    Names the first item at fault: a key of ``ctx.state`` that is not a string, or an item the
    app's state type rejects (msgspec's own path says only ``$[...]``).
    """
    prefix = f"state of key {key!r} cannot be stored"
    for name, value in state.items():
        try:
            state_decoder.decode(state_encoder.encode({name: None}))
        except msgspec.ValidationError:
            return (
                f"{prefix}: ctx.state has the key {name!r} ({type(name).__name__}); "
                "the keys of ctx.state must be strings"
            )
        try:
            decode(key, state_encoder.encode({name: value}))
        except StateError as exc:
            return f"{prefix}: ctx.state[{name!r}] would not read back ({exc})"
    return f"{prefix}: it would not read back"


_headers_decoder = msgspec.json.Decoder(dict[str, str])


class ValueDecoder:
    """Turns an entry's fields into the value a handler declared; built once per handler."""

    __slots__ = ("_json_decode", "_msgpack", "_typed", "value_type")

    def __init__(self, value_type: Any = Any) -> None:
        self.value_type = value_type
        self._json_decode = msgspec.json.Decoder(value_type).decode
        self._msgpack: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(value_type)
        self._typed = value_type is not Any

    def decode(self, fields: dict[bytes, bytes]) -> Any:
        """Decode the value of one entry, raising DecodeError with the reason."""
        raw = fields.get(VALUE)
        try:
            if raw is None:
                return self._flat(fields)
            if ENCODING in fields and fields[ENCODING] == MSGPACK:
                return self._msgpack.decode(raw)
            return self._json_decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise DecodeError(f"cannot decode value: {exc}") from None
        except RecursionError:
            raise DecodeError("cannot decode value: it is nested too deeply") from None

    def _flat(self, fields: dict[bytes, bytes]) -> Any:
        record = {name.decode(): value.decode() for name, value in fields.items() if name != HEADERS}
        if not record:
            raise DecodeError("cannot decode value: the entry has no fields")
        if not self._typed:
            return record
        return msgspec.convert(record, self.value_type, strict=False)


class RepeatedFields(dict[bytes, bytes]):
    """The fields of an entry that gives a field name more than once, each with its last value.

    Which value was meant is unknown (redis-cli writes ``XADD s * value a value b`` as it is), so
    such an entry is a DecodeError; the DLQ keeps these fields.
    """

    __slots__ = ("problem",)

    def __init__(self, fields: dict[bytes, bytes], name: bytes, times: int) -> None:
        super().__init__(fields)
        how_often = "twice" if times == 2 else f"{times} times"
        self.problem = (
            f"the field {name.decode(errors='replace')!r} appears {how_often} in the entry "
            "(the DLQ keeps its last value): write each field once"
        )


def entry_fields_of(flat: list[bytes]) -> dict[bytes, bytes]:
    """An entry's flat field list (name, value, ...) as a map; RepeatedFields when a name repeats."""
    it = iter(flat)
    fields = dict(zip(it, it, strict=True))
    if 2 * len(fields) == len(flat):
        return fields
    names, seen = flat[::2], set()
    for name in names:
        if name in seen:
            break
        seen.add(name)
    return RepeatedFields(fields, name, names.count(name))


def interleaved(head: Sequence[Any], firsts: Collection[Any], seconds: Iterable[Any]) -> list[Any]:
    """``head``, then each of ``firsts`` followed by its partner in ``seconds`` (C speed, no pairs)."""
    start = len(head)
    flat = [*head, *[None] * (2 * len(firsts))]
    flat[start::2] = firsts
    flat[start + 1 :: 2] = seconds
    return flat


def decode_headers(raw: bytes | None) -> dict[str, str]:
    """The headers of an entry; an unreadable headers field is a DecodeError."""
    if raw is None:
        return {}
    try:
        return _headers_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"cannot decode headers: {exc}") from None


def encode_value(value: Any) -> bytes:
    """JSON bytes for a value to produce; bytes pass unchanged (they are taken as JSON already)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    try:
        return json_encoder.encode(value)
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise ConfigError(f"cannot encode value as JSON: {exc}") from None


def encode_text(what: str, text: str) -> bytes:
    """``text`` as UTF-8; a ConfigError naming it when it holds a lone surrogate.

    Python keeps each byte that is not UTF-8 in a command line, an environment variable or a
    file name as one (surrogateescape); such text has no UTF-8 form to store.
    """
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{what} {text!r} is not valid UTF-8: {text[exc.start]!r} is a lone surrogate "
            "(a byte that was not UTF-8 where the text came from)"
        ) from None


def _encode_headers(headers: dict[str, str]) -> bytes:
    """The headers field; ConfigError for a header that readers could not decode."""
    for name, value in headers.items():
        if not isinstance(name, str):
            raise ConfigError(f"header name {name!r} must be a string, not {type(name).__name__}")
        if not isinstance(value, str):
            raise ConfigError(f"header {name!r} value must be a string, not {type(value).__name__}")
        encode_text("header name", name)
        encode_text(f"header {name!r} value", value)
    return json_encoder.encode(headers)


def entry_fields(
    value: bytes, key: str | None = None, headers: dict[str, str] | None = None
) -> dict[bytes, bytes]:
    """The stream fields of one entry in the wire format."""
    fields: dict[bytes, bytes] = {}
    if key is not None:
        fields[KEY] = encode_text("key", key)
    fields[VALUE] = value
    if headers:
        fields[HEADERS] = _encode_headers(headers)
    return fields


def value_type_of(func: Callable[..., Any]) -> Any:
    """The declared type of the handler's first parameter, ``Any`` when not annotated."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot inspect handler {func!r}: {exc}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 2:
        raise ConfigError(f"handler {func.__qualname__} must take two positional parameters (value, ctx)")
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:
        raise ConfigError(f"cannot resolve the annotations of {func.__qualname__}: {exc}") from None
    value_type = hints.get(positional[0].name, Any)
    try:
        ValueDecoder(value_type)
    except TypeError as exc:
        raise ConfigError(
            f"handler {func.__qualname__}: msgspec cannot decode into {value_type!r}: {exc}"
        ) from None
    return value_type
