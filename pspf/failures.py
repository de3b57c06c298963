"""What happens when a handler fails: the retry policy, backoff, and the dead-letter record.

Any exception is retryable by default. ``NonRetryableError``, the exception types an app or handler
lists, and entries that cannot be decoded into the handler's type go to the DLQ at once. A
retryable failure is tried again after an exponential backoff with jitter until the entry was
attempted ``max_retries`` times in all; then it goes to the DLQ. In ``ordered`` mode the
partition waits for the retry (per-key order is kept); in ``deferred`` mode the entry is parked
with a due time and the partition goes on (per-key order is NOT kept for that entry).
"""

from __future__ import annotations

import enum
import random
import time
import traceback
from typing import Annotated

import msgspec

from pspf.errors import ConfigError, DecodeError, NonRetryableError
from pspf.settings import RetryMode, RetrySettings

TRACEBACK_LIMIT = 4000


class Outcome(enum.Enum):
    """What a failed attempt means for its entry."""

    RETRY = "retry"  # ordered mode: the stream waits and tries again
    PARKED = "parked"  # deferred mode: tried again when due, the stream goes on
    DEAD = "dead"


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How failing entries are retried; fields left None inherit from the level above.

    Levels, lowest first: built-in defaults, ``PSPF_*`` variables and ``pspf run`` flags, the
    ``App``, the handler.
    """

    max_retries: Annotated[int, msgspec.Meta(ge=1)] | None = None
    base_delay_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    factor: Annotated[float, msgspec.Meta(ge=1)] | None = None
    max_delay_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    mode: RetryMode | None = None
    max_deliveries: Annotated[int, msgspec.Meta(ge=1)] | None = None
    timeout_ms: Annotated[int, msgspec.Meta(gt=0)] | None = None

    def over(self, lower: RetryPolicy) -> RetryPolicy:
        """Return a policy whose unset fields are taken from ``lower``."""
        values = {
            name: getattr(self, name) if getattr(self, name) is not None else getattr(lower, name)
            for name in self.__struct_fields__
        }
        return RetryPolicy(**values)

    def validated(self) -> RetryPolicy:
        """Check the constraints (a Struct built in code is not validated)."""
        try:
            return msgspec.convert(msgspec.to_builtins(self), RetryPolicy)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid retry policy: {exc}") from None

    def delay_s(self, attempt: int) -> float:
        """Backoff before the attempt after ``attempt``: exponential, capped, with equal jitter."""
        base = (self.base_delay_ms or 0) * (self.factor or 1.0) ** (attempt - 1)
        capped = min(base, self.max_delay_ms or 0) / 1000
        return capped / 2 + random.uniform(0, capped / 2)


def policy_from(settings: RetrySettings) -> RetryPolicy:
    """The run-wide settings as the bottom level of a handler's policy."""
    return RetryPolicy(**msgspec.structs.asdict(settings))


class HandlerTimeout(Exception):
    """The handler ran past its ``timeout_ms``."""


class PoisonEntry(Exception):
    """The entry was delivered more than ``max_deliveries`` times without completing."""


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    """The durable record of an entry's failed attempts (retry bookkeeping in the store)."""

    attempts: int
    first_failed_ms: int
    last_failed_ms: int
    error_type: str
    message: str
    traceback: str = ""
    due_ms: int = 0


def classify(exc: BaseException, non_retryable: tuple[type[BaseException], ...]) -> bool:
    """True when retrying cannot help: the entry goes straight to the DLQ."""
    return isinstance(exc, (NonRetryableError, DecodeError, PoisonEntry, *non_retryable))


def decide(
    exc: BaseException,
    previous: Failure | None,
    policy: RetryPolicy,
    non_retryable: tuple[type[BaseException], ...],
    due: bool,
) -> tuple[Outcome, Failure]:
    """The outcome of one more failed attempt, and its bookkeeping.

    ``due``: the attempt was a parked entry's, which stays parked when it fails again.
    """
    failure = record_failure(exc, previous)
    if classify(exc, non_retryable) or failure.attempts >= (policy.max_retries or 1):
        return Outcome.DEAD, failure
    if policy.mode == "deferred" or due:
        due_ms = int(time.time() * 1000 + policy.delay_s(failure.attempts) * 1000) or 1
        return Outcome.PARKED, msgspec.structs.replace(failure, due_ms=due_ms)
    return Outcome.RETRY, failure


def record_failure(exc: BaseException, previous: Failure | None) -> Failure:
    """The bookkeeping after one more failed attempt."""
    now = int(time.time() * 1000)
    text = "".join(traceback.format_exception(exc))
    if len(text) > TRACEBACK_LIMIT:
        text = "...\n" + text[-TRACEBACK_LIMIT:]
    return Failure(
        attempts=(previous.attempts if previous else 0) + 1,
        first_failed_ms=previous.first_failed_ms if previous else now,
        last_failed_ms=now,
        error_type=type(exc).__name__,
        message=str(exc) or type(exc).__name__,
        traceback=text,
    )


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A DLQ entry: the source entry's fields unchanged, where it came from, and why it died."""

    source_topic: str
    source_partition: int
    source_id: str
    app: str
    consumer: str
    original: dict[bytes, bytes]
    error_type: str
    message: str
    traceback: str
    attempts: int
    first_failed_ms: int
    last_failed_ms: int

    @property
    def key(self) -> str | None:
        raw = self.original.get(b"key")
        return None if raw is None else raw.decode(errors="replace")

    def to_fields(self) -> dict[bytes, bytes]:
        """The DLQ stream entry: readable metadata fields plus ``original``, the source fields."""
        fields = {
            name.encode(): str(getattr(self, name)).encode()
            for name in self.__struct_fields__
            if name != "original"
        }
        fields[b"original"] = msgspec.msgpack.encode(self.original)
        if self.key is not None:
            fields[b"key"] = self.original[b"key"]
        return fields

    @classmethod
    def of(
        cls,
        topic: str,
        partition: int,
        entry_id: bytes,
        app: str,
        consumer: str,
        original: dict[bytes, bytes],
        failure: Failure,
    ) -> DeadLetter:
        """The record of an entry that dies with ``failure``."""
        return cls(
            source_topic=topic,
            source_partition=partition,
            source_id=entry_id.decode(),
            app=app,
            consumer=consumer,
            original=original,
            error_type=failure.error_type,
            message=failure.message,
            traceback=failure.traceback,
            attempts=failure.attempts,
            first_failed_ms=failure.first_failed_ms,
            last_failed_ms=failure.last_failed_ms,
        )

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> DeadLetter:
        text = {k.decode(): v.decode(errors="replace") for k, v in fields.items() if k != b"original"}
        return cls(
            source_topic=text["source_topic"],
            source_partition=int(text["source_partition"]),
            source_id=text["source_id"],
            app=text["app"],
            consumer=text["consumer"],
            original=msgspec.msgpack.decode(fields[b"original"], type=dict[bytes, bytes]),
            error_type=text["error_type"],
            message=text["message"],
            traceback=text.get("traceback", ""),
            attempts=int(text["attempts"]),
            first_failed_ms=int(text["first_failed_ms"]),
            last_failed_ms=int(text["last_failed_ms"]),
        )
