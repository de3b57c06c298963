"""Views: Redis hashes and sorted sets an app keeps, written as final values after each acknowledgement.

``app.view(name, kind)`` declares one; a handler writes it through ``ctx.view(name)`` (a ``View``),
a dataflow through ``Stream.to_view``. The view is the Redis key ``name`` itself, so any client
reads it (``HGETALL``, ``ZRANGE``).

A view follows the outbox's protocol: what an attempt writes joins its batch only if the attempt
returns; the batch's writes are committed with the batch (one store row per commit, in the state
backup too: ``PartitionViews``), and sent to Redis in one write once the batch's acknowledgement
succeeded, their replies read in the next cycle. Each write is a final value (``HSET``/``HDEL``,
``ZADD``/``ZREM``), never an increment, so writing one again changes nothing: a partition's next
owner writes the rows not known to be written again when it takes the partition on. On a cluster
the view is one key of its own slot, written after the acknowledgement's reply, never in the same
call.

What it does not fence: a worker paused between its acknowledgement and the view's write for longer
than its lease may write a value its successor has since replaced (the window is one round trip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

import msgspec

from pspf import keys
from pspf.codec import interleaved
from pspf.errors import ConfigError

ViewKind = Literal["hash", "zset"]
KINDS: tuple[ViewKind, ...] = ("hash", "zset")
#: A view's field's final value: text, bytes, an int (a hash's, as its digits), a score (a sorted
#: set's), or None: removed
Value = str | bytes | int | float | None
#: One final value of a view, as a handler wrote it: (view, field or member, value or score). A
#: plain tuple: one is made per write, on the hot path.
ViewWrite = tuple[str, "str | bytes", Value]
#: A commit's writes, the last per field: view -> field -> value
Writes = dict[str, dict["str | bytes", Value]]


class Sent(Protocol):
    """Writes sent whose replies are read later (``pspf.broker.publishing.ViewsSent``)."""

    def wait(self) -> None: ...

    def abandon(self) -> None: ...


_encode = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder()
_decode_rows = msgspec.msgpack.Decoder(list[tuple[str, list[Any]]]).decode  # no str | bytes union


def latest(writes: Sequence[ViewWrite], views: Collection[str]) -> Writes:
    """A batch's writes, the last per field of each view (``views``: the app's views)."""
    if len(views) == 1:  # the common app: every write is its one view's, one pass at C speed
        return {view: {field: value for _, field, value in writes} for view in views} if writes else {}
    found: Writes = {}
    for view, field, value in writes:
        fields = found.get(view)
        if fields is None:
            fields = found[view] = {}
        fields[field] = value
    return found


def encode_row(writes: Writes) -> bytes:
    """A commit's store row: per view, its name and its fields and values in turn."""
    return _encode([(view, interleaved((), fields, fields.values())) for view, fields in writes.items()])


def decode_row(raw: bytes) -> Writes:
    """The writes of a row ``encode_row`` made."""
    found: Writes = {}
    for view, flat in _decode_rows(raw):
        pairs = iter(flat)
        found[view] = dict(zip(pairs, pairs, strict=True))
    return found


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


def _field(what: str, field: Any) -> str | bytes:
    """A field or member as one spelling: text (bytes that are UTF-8 become text), or an int's digits."""
    kind = type(field)
    if kind is str:
        return field  # type: ignore[no-any-return]
    if kind is int:
        return str(field)
    if isinstance(field, bytes):
        try:
            return field.decode()
        except UnicodeDecodeError:
            return field
    raise TypeError(f"{what} must be a str, bytes or int, got {kind.__name__}")


def encode_value(value: Any) -> str | bytes:
    """A hash field's value as Redis keeps it.

    Text as it is, bytes as text when they are UTF-8, an int as its digits, anything else as JSON
    text.
    """
    kind = type(value)
    if kind is str:
        return value  # type: ignore[no-any-return]
    if kind is int:
        return str(value)
    if kind is bytes:
        try:
            return value.decode()  # type: ignore[no-any-return]
        except UnicodeDecodeError:
            return value  # type: ignore[no-any-return]
    try:
        return _json.encode(value).decode()
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"a view's value must be text, bytes or JSON-encodable: {exc}") from None


class Views(dict[str, "View"]):
    """A source's views by name: ``ctx.view(name)`` is one lookup; a name it lacks is a ConfigError."""

    __slots__ = ()

    def __missing__(self, name: str) -> View:
        raise ConfigError(f"ctx.view: the app has no view {name!r} (declare it with app.view({name!r}))")


def bind(kinds: Mapping[str, ViewKind], writes: list[ViewWrite]) -> Views:
    """The views ``ctx.view`` hands out, each appending to ``writes``.

    One ``View`` per view and source (a batch, an async chain), not per entry: a handler's writes
    land in the source's list at once, and the runner that ran the attempt cuts them off again
    when it fails (it knows where they start: the list's length before the attempt).
    """
    return Views({name: _VIEWS[kind](name, writes) for name, kind in kinds.items()})


#: The ints a hash view keeps as ints: those a commit's store row (msgpack) holds; larger ones are
#: kept as their digits. Redis holds either as the same digits. Precomputed: checked on every write.
_LOWEST, _HIGHEST = -(2**63), 2**63 - 1


class View:
    """``ctx.view(name)``: ``view[field] = value``, ``del view[field]`` (hash); ``.add``, ``.remove`` (zset).

    One type for both kinds, so a handler type-checks either way; each kind is a subclass that
    overrides its own methods (no kind check per write), and the other kind's raise TypeError.
    """

    __slots__ = ("_name", "_writes")
    kind: ClassVar[ViewKind]

    def __init__(self, name: str, writes: list[ViewWrite]) -> None:
        self._name = name
        self._writes = writes

    def __setitem__(self, field: str | bytes | int, value: Any) -> None:
        raise TypeError(f"view {self._name!r} is a sorted set: view.add(member, score)")

    def __delitem__(self, field: str | bytes | int) -> None:
        raise TypeError(f"view {self._name!r} is a sorted set: view.remove(member)")

    def add(self, member: str | bytes | int, score: float) -> None:
        """Set ``member``'s score (added when missing)."""
        raise TypeError(f"view {self._name!r} is a hash: view[field] = value")

    def remove(self, member: str | bytes | int) -> None:
        """Remove ``member``."""
        raise TypeError(f"view {self._name!r} is a hash: del view[field]")


class HashView(View):
    """A hash view: fields and their values."""

    __slots__ = ()
    kind = "hash"

    def __setitem__(self, field: str | bytes | int, value: Any) -> None:
        kind = type(value)
        if kind is not str and (kind is not int or not _LOWEST <= value <= _HIGHEST):
            value = encode_value(value)
        if type(field) is not str:
            field = _field("a view's field", field)
        self._writes.append((self._name, field, value))

    def __delitem__(self, field: str | bytes | int) -> None:
        self._writes.append((self._name, _field("a view's field", field), None))


class SortedSetView(View):
    """A sorted set view: members and their scores."""

    __slots__ = ()
    kind = "zset"

    def add(self, member: str | bytes | int, score: float) -> None:
        """Set ``member``'s score (added when missing)."""
        kind = type(score)
        if kind is not float or score != score:  # NaN is not equal to itself
            if kind is bool or not isinstance(score, (int, float)) or math.isnan(score):
                raise TypeError(f"a sorted set view's score must be a number, got {score!r}")
            score = float(score)
        named = member if type(member) is str else _field("a view's member", member)
        self._writes.append((self._name, named, score))

    def remove(self, member: str | bytes | int) -> None:
        """Remove ``member``."""
        self._writes.append((self._name, _field("a view's member", member), None))


_VIEWS: dict[str, type[View]] = {"hash": HashView, "zset": SortedSetView}


class PartitionViews:
    """One owned partition's view writes: committed with its batches, written after their acknowledgement.

    Each commit with view writes puts ONE store row, ``VIEWS_NAMESPACE/<commit number>``, holding
    that batch's writes (the last per field), and keeps them in ``pending`` until they are known
    to be in Redis. The commits up to ``confirmed`` (acknowledged) go to Redis together, a later
    commit's write of a field replacing an earlier one's; once their replies are read, their rows
    are done and the next commit deletes them. The rows left are always the last commits, so a new
    owner that applies them in order gets each field's latest value.
    """

    __slots__ = (
        "_commits",
        "_in_flight",
        "_rows",
        "_sent",
        "confirmed",
        "kinds",
        "obsolete",
        "pending",
        "unconfirmed",
    )

    def __init__(self, kinds: Mapping[str, ViewKind], rows: list[tuple[int, Writes]] | None = None) -> None:
        self.kinds = dict(kinds)
        #: per commit not known written, in order: its number and its writes
        self.pending: list[tuple[int, Writes]] = sorted(rows or (), key=lambda row: row[0])
        #: the numbers of the rows in the store, in order
        self._rows = [number for number, _ in self.pending]
        #: what a new owner loads is committed and acknowledged: all of it is to be written
        self._commits = self.unconfirmed = self.confirmed = self._rows[-1] if self._rows else 0
        #: the commits whose writes were sent (or are in flight)
        self._sent = 0
        #: the rows the next commit deletes
        self.obsolete: list[int] = []
        #: the writes sent whose replies are still to be read, the commit they reach, the one before
        self._in_flight: tuple[Sent, int, int] | None = None

    @classmethod
    def load(cls, kinds: Mapping[str, ViewKind], items: Iterable[tuple[str, bytes]]) -> PartitionViews:
        """The partition's views as its store left them (``items``: the ``VIEWS_NAMESPACE`` rows)."""
        return cls(kinds, [(int(name), decode_row(raw)) for name, raw in items])

    def staged(self, writes: list[ViewWrite]) -> tuple[Writes, dict[tuple[str, str], bytes | None]]:
        """A batch's writes (the last per field), and its commit's store writes (its row; done rows gone)."""
        found = latest(writes, self.kinds)
        updates: dict[tuple[str, str], bytes | None] = {
            (keys.VIEWS_NAMESPACE, f"{number:020d}"): None for number in self.obsolete
        }
        if found:
            updates[(keys.VIEWS_NAMESPACE, f"{self._commits + 1:020d}")] = encode_row(found)
        return found, updates

    def committed(self, found: Writes) -> None:
        """The commit of a batch's ``staged`` writes is done."""
        if self.obsolete:
            self._rows = self._rows[len(self.obsolete) :]
            self.obsolete = []
        if found:
            self._commits = number = self._commits + 1
            self.unconfirmed = number
            self._rows.append(number)
            self.pending.append((number, found))

    def confirm(self) -> None:
        """The commits so far were acknowledged: their writes may go to Redis."""
        self.confirmed = self.unconfirmed

    @property
    def ready(self) -> bool:
        """Whether acknowledged writes wait to be sent."""
        return any(self._sent < number <= self.confirmed for number, _ in self.pending)

    @property
    def busy(self) -> bool:
        """Whether acknowledged writes wait to be written, or to be known written."""
        return self._in_flight is not None or self.ready

    def take(self) -> tuple[int, Writes]:
        """The acknowledged writes not sent yet, the last per field, and the commit they reach."""
        upto = self.confirmed
        taken = [writes for number, writes in self.pending if self._sent < number <= upto]
        self._sent = upto
        if len(taken) == 1:
            return upto, taken[0]
        merged: Writes = {}
        for writes in taken:
            for view, fields in writes.items():
                merged.setdefault(view, {}).update(fields)
        return upto, merged

    def send(self, send: Callable[[Mapping[str, str], Writes], Sent]) -> None:
        """Read the writes in flight, then send the acknowledged ones (their replies read next time).

        ``send`` is ``Publishing.send_views``. Writes whose replies say they failed stay pending
        and go again: they are final values.
        """
        self.settle()
        if self.ready:
            before = self._sent
            upto, writes = self.take()
            try:
                self._in_flight = send(self.kinds, writes), upto, before
            except BaseException:
                self._sent = before
                raise

    def settle(self) -> None:
        """Read the replies of the writes in flight, if any (raises the broker's error)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            sent, upto, before = in_flight
            try:
                sent.wait()
            except BaseException:
                self._sent = before
                raise
            self.written(upto)

    def abandon(self) -> None:
        """Leave the writes in flight unread: they stay pending, for whoever goes on."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight[0].abandon()
            self._sent = in_flight[2]

    def written(self, upto: int) -> None:
        """The writes of the commits up to ``upto`` are in Redis: forget them; their rows are done."""
        self.pending = [(number, writes) for number, writes in self.pending if number > upto]
        self.obsolete = [number for number in self._rows if number <= upto]
