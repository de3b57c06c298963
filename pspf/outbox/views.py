"""Views: Redis hashes and sorted sets an app keeps, written as final values after each acknowledgement.

``app.view(name, kind)`` declares one; a handler writes it through ``ctx.view(name)`` (a
``HashView`` or a ``SortedSetView``), a dataflow through ``Stream.to_view``. The view is the Redis
key ``name`` itself, so any client reads it (``HGETALL``, ``ZRANGE``).

A view follows the outbox's protocol: what an attempt writes joins its batch only if the attempt
returns; the batch's writes are committed with the batch (the store row ``VIEWS_NAMESPACE/unwritten``
holds every committed write not yet known to be in Redis, so it travels in the state backup too), and
written to Redis once the batch's acknowledgement succeeded (``PartitionViews.confirm``), in one
pipelined round trip. Each write is a final value (``HSET``/``HDEL``, ``ZADD``/``ZREM``), never an
increment, so writing one again changes nothing: a partition's next owner writes the unwritten row
again when it takes the partition on. On a cluster the view is one key of its own slot, written
after the acknowledgement's reply, never in the same call.

What it does not fence: a worker paused between its acknowledgement and the view's write for longer
than its lease may write a value its successor has since replaced (the window is one round trip).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from pspf import keys
from pspf.errors import ConfigError

ViewKind = Literal["hash", "zset"]
KINDS: tuple[ViewKind, ...] = ("hash", "zset")
#: The store key (in ``keys.VIEWS_NAMESPACE``) of a partition's committed, unwritten view writes
UNWRITTEN = "unwritten"


class ViewWrite(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One final value of a view: a hash field's value or a sorted set member's score; None removes it."""

    view: str
    kind: str
    #: the hash field or the sorted set member
    field: bytes
    #: the hash field's value (bytes) or the member's score (float); None deletes it
    value: bytes | float | None


_encode_writes = msgspec.msgpack.Encoder().encode
_decode_writes = msgspec.msgpack.Decoder(list[ViewWrite]).decode
_json = msgspec.json.Encoder()


def check_view(name: str, kind: str) -> ViewKind:
    """The kind of a view named ``name``, refusing a name PSPF's keys could collide with."""
    if not isinstance(name, str) or not name or "\n" in name:
        raise ConfigError(f"app.view: a view's name is its Redis key, a non-empty line of text; got {name!r}")
    if name.startswith(f"{keys.PREFIX}:"):
        raise ConfigError(
            f"app.view({name!r}): names starting with {keys.PREFIX + ':'!r} are PSPF's own keys"
        )
    if kind not in KINDS:
        raise ConfigError(f"app.view({name!r}): kind must be 'hash' or 'zset', got {kind!r}")
    return kind


def check_view_types(kinds: Mapping[str, ViewKind], found: list[str]) -> None:
    """Refuse views whose keys hold another type (``found``: each key's ``TYPE``, in order)."""
    for (name, kind), actual in zip(kinds.items(), found, strict=True):
        if actual not in ("none", kind):
            raise ConfigError(
                f"view {name!r}: the key holds a {actual}, not a {kind}; delete it or rename the view"
            )


def _text(what: str, value: Any) -> bytes:
    if type(value) is str:
        return value.encode()
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(f"{what} must be a str, bytes or int, got {type(value).__name__}")


def encode_value(value: Any) -> bytes:
    """A hash field's value as Redis keeps it: text and bytes as they are, anything else as JSON."""
    if type(value) is str:
        return value.encode()
    if isinstance(value, bytes):
        return value
    try:
        return _json.encode(value)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"a view's value must be text, bytes or JSON-encodable: {exc}") from None


class HashView:
    """``ctx.view(name)`` of a hash view: ``view[field] = value`` and ``del view[field]``."""

    __slots__ = ("_name", "_writes")

    def __init__(self, name: str, writes: list[ViewWrite]) -> None:
        self._name = name
        self._writes = writes

    def __setitem__(self, field: str | bytes | int, value: Any) -> None:
        self._writes.append(
            ViewWrite(self._name, "hash", _text("a view's field", field), encode_value(value))
        )

    def __delitem__(self, field: str | bytes | int) -> None:
        self._writes.append(ViewWrite(self._name, "hash", _text("a view's field", field), None))


class SortedSetView:
    """``ctx.view(name)`` of a sorted set view: ``view.add(member, score)`` and ``view.remove(member)``."""

    __slots__ = ("_name", "_writes")

    def __init__(self, name: str, writes: list[ViewWrite]) -> None:
        self._name = name
        self._writes = writes

    def add(self, member: str | bytes | int, score: float) -> None:
        """Set ``member``'s score (added when missing)."""
        if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isnan(score):
            raise TypeError(f"a sorted set view's score must be a number, got {score!r}")
        self._writes.append(ViewWrite(self._name, "zset", _text("a view's member", member), float(score)))

    def remove(self, member: str | bytes | int) -> None:
        self._writes.append(ViewWrite(self._name, "zset", _text("a view's member", member), None))


def handle(kinds: Mapping[str, ViewKind], name: str, writes: list[ViewWrite]) -> HashView | SortedSetView:
    """What ``ctx.view(name)`` gives, writing into ``writes``."""
    kind = kinds.get(name)
    if kind is None:
        raise ConfigError(f"ctx.view: the app has no view {name!r} (declare it with app.view({name!r}))")
    return HashView(name, writes) if kind == "hash" else SortedSetView(name, writes)


class PartitionViews:
    """One owned partition's view writes: committed with its batches, written after their acknowledgement.

    ``unwritten`` maps (view, field) to its latest committed write and the number of the commit
    that made it; the writes of commits up to ``confirmed`` (acknowledged) are the ones to write.
    """

    __slots__ = ("_commits", "confirmed", "kinds", "unconfirmed", "unwritten")

    def __init__(self, kinds: Mapping[str, ViewKind], unwritten: list[ViewWrite] | None = None) -> None:
        self.kinds = dict(kinds)
        self._commits = 0
        #: what the state committed holds and Redis may not: a fresh owner writes it all
        self.unwritten: dict[tuple[str, bytes], tuple[int, ViewWrite]] = {
            (w.view, w.field): (0, w) for w in unwritten or ()
        }
        self.unconfirmed = 0
        self.confirmed = 0

    @classmethod
    def load(cls, kinds: Mapping[str, ViewKind], raw: bytes | None) -> PartitionViews:
        """The partition's views as its store left them (``raw``: the ``UNWRITTEN`` row)."""
        return cls(kinds, _decode_writes(raw) if raw else None)

    def staged(self, writes: list[ViewWrite]) -> tuple[dict[tuple[str, bytes], tuple[int, ViewWrite]], bytes]:
        """What ``unwritten`` becomes with a batch's writes, and the row the batch commits."""
        number = self._commits + 1
        merged = dict(self.unwritten)
        for write in writes:
            merged[(write.view, write.field)] = (number, write)
        return merged, _encode_writes([w for _, w in merged.values()])

    def committed(self, merged: dict[tuple[str, bytes], tuple[int, ViewWrite]]) -> None:
        """The batch's commit holding ``merged`` (from ``staged``) is done."""
        self._commits += 1
        self.unconfirmed = self._commits
        self.unwritten = merged

    def confirm(self) -> None:
        """The commits so far were acknowledged: their writes may go to Redis."""
        self.confirmed = self.unconfirmed

    @property
    def ready(self) -> bool:
        """Whether acknowledged writes wait to be written."""
        return bool(self.unwritten) and any(n <= self.confirmed for n, _ in self.unwritten.values())

    def to_write(self) -> list[tuple[int, ViewWrite]]:
        """The acknowledged writes to send (each with its commit's number, for ``written``)."""
        return [(n, w) for n, w in self.unwritten.values() if n <= self.confirmed]

    def written(self, sent: list[tuple[int, ViewWrite]]) -> None:
        """``sent`` is in Redis: forget each write no later commit replaced."""
        for number, write in sent:
            name = (write.view, write.field)
            if self.unwritten.get(name, (None,))[0] == number:
                del self.unwritten[name]
