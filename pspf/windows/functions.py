"""What an app's window declares, read once: its function's types, its entries' event time.

``Aggregation`` (``pspf.windows.aggregation``) builds on these when ``@app.window`` declares it:
the accumulator and value types the window function names, how an entry's event time is found
(the entry id's time, a field, or a function), and the encoding of an accumulator.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec

from pspf.codec import ValueDecoder
from pspf.errors import ConfigError

if TYPE_CHECKING:
    from pspf.context import Context

TimestampFunc = Callable[[Any, "Context"], Any]


def encode_acc(acc: Any) -> bytes:
    try:
        return _acc_encode(acc)
    except (TypeError, msgspec.EncodeError, OverflowError) as exc:
        raise ConfigError(f"the window's accumulator cannot be encoded: {exc}") from None


_acc_encode = msgspec.msgpack.Encoder().encode


def declared_types(func: Callable[..., Any]) -> tuple[Any, Any]:
    """The accumulator and value types a window function declares (``Any`` when not annotated)."""
    try:
        params = list(inspect.signature(func).parameters.values())
        hints = typing.get_type_hints(func)
    except (TypeError, ValueError, NameError) as exc:
        raise ConfigError(f"cannot inspect window function {func!r}: {exc}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != 2:
        raise ConfigError(
            f"window function {func.__qualname__} must take two positional parameters (accumulator, value)"
        )
    acc_type, value_type = (hints.get(p.name, Any) for p in positional)
    for what, kind in (("accumulator", acc_type), ("value", value_type)):
        try:
            msgspec.msgpack.Decoder(kind)
            if what == "value":
                ValueDecoder(kind)
        except TypeError as exc:
            raise ConfigError(
                f"window function {func.__qualname__}: msgspec cannot decode its {what}: {exc}"
            ) from None
    return acc_type, value_type


def timestamp_reader(where: str, timestamp: str | TimestampFunc | None) -> Callable[[Any, Context], int]:
    """The event time of an entry, in epoch milliseconds."""
    if timestamp is None:
        return lambda value, ctx: int(ctx.entry_id.split(b"-", 1)[0])
    if callable(timestamp):
        return lambda value, ctx: to_ms(timestamp(value, ctx), "the timestamp function")
    if not isinstance(timestamp, str) or not timestamp:
        raise ConfigError(f"{where}: timestamp must be a field name or a function")
    name = timestamp

    def field(value: Any, ctx: Context) -> int:
        found = value.get(name) if type(value) is dict else getattr(value, name, None)
        if type(found) is int:  # the common case, first
            return found
        if found is None:
            raise ConfigError(f"the entry has no timestamp field {name!r}")
        return to_ms(found, f"the timestamp field {name!r}")

    return field


def to_ms(value: Any, what: str) -> int:
    """Epoch milliseconds from a number, an RFC 3339 string or a datetime."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} is a bool, not a time")
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(
                f"{what} is neither epoch milliseconds nor an RFC 3339 time: {value!r}"
            ) from None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigError(f"{what} has no time zone: {value.isoformat()!r}")
        return int(value.timestamp() * 1000)
    raise ConfigError(f"{what} is neither epoch milliseconds nor an RFC 3339 time: {value!r}")
