from __future__ import annotations

import pytest

from pspf import App, Context, NonRetryableError
from pspf.errors import ConfigError, DecodeError
from pspf.failures import (
    TRACEBACK_LIMIT,
    DeadLetter,
    PoisonEntry,
    RetryPolicy,
    classify,
    policy_from,
    record_failure,
)
from pspf.settings import Settings


def test_policy_levels_override_only_what_they_set() -> None:
    run = policy_from(Settings.load({"PSPF_MAX_RETRIES": 7}, environ={}).retry)
    app = App("a", retry=RetryPolicy(mode="deferred", base_delay_ms=5))

    @app.handler("t", retry=RetryPolicy(max_retries=2))
    def handle(value: object, ctx: Context) -> None: ...

    effective = app.handlers["t"].retry.over(run)
    assert effective.max_retries == 2  # handler
    assert effective.mode == "deferred" and effective.base_delay_ms == 5  # app
    assert effective.max_deliveries == 5 and effective.max_delay_ms == 30_000  # settings defaults


def test_policy_built_in_code_is_validated() -> None:
    with pytest.raises(ConfigError, match="invalid retry policy"):
        App("a", retry=RetryPolicy(max_retries=0))


def test_backoff_grows_is_capped_and_jittered() -> None:
    policy = RetryPolicy(base_delay_ms=100, factor=2.0, max_delay_ms=1_000)
    for attempt, full in [(1, 0.1), (2, 0.2), (3, 0.4), (6, 1.0), (20, 1.0)]:
        delays = [policy.delay_s(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > 0  # jitter


def test_classification() -> None:
    assert classify(NonRetryableError("no"), ())
    assert classify(DecodeError("bad"), ())
    assert classify(PoisonEntry("kills"), ())
    assert classify(KeyError("k"), (KeyError,))
    assert not classify(RuntimeError("flaky"), (KeyError,))


def test_failures_accumulate_and_tracebacks_are_bounded() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise RuntimeError("x" * 10_000)
        deep(n - 1)

    try:
        deep(50)
    except RuntimeError as exc:
        first = record_failure(exc, None)
        second = record_failure(exc, first)
    assert first.attempts == 1 and second.attempts == 2
    assert second.first_failed_ms == first.first_failed_ms <= second.last_failed_ms
    assert second.error_type == "RuntimeError"
    assert len(second.traceback) <= TRACEBACK_LIMIT + 10


def test_dead_letter_round_trips_through_stream_fields_with_bytes_unchanged() -> None:
    original = {b"key": b"k", b"value": b"\xff\x00 not utf-8", b"headers": b'{"a": "b"}'}
    record = DeadLetter(
        source_topic="t",
        source_partition=3,
        source_id="1-2",
        app="a",
        consumer="c",
        original=original,
        error_type="DecodeError",
        message="cannot decode value",
        traceback="tb",
        attempts=1,
        first_failed_ms=10,
        last_failed_ms=20,
    )
    fields = record.to_fields()
    assert fields[b"key"] == b"k" and fields[b"error_type"] == b"DecodeError"
    again = DeadLetter.from_fields(fields)
    assert again == record and again.original[b"value"] == b"\xff\x00 not utf-8"
