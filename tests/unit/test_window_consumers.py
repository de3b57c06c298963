"""Several consumers of one topic: a handler and windows registered together, named, one attempt.

Registration rules and their one-line errors, the retry policy a shared topic gets, the attempt
that is all or nothing for the handler and every window (through ``TestApp``, which runs the
worker's attempt loop and commit), and the late entries in the counts and the log.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import msgspec
import pytest

from pspf import App, Context, RetryPolicy, windows
from pspf.cycle.timekeeping import LateLog
from pspf.errors import ConfigError
from pspf.hooks import Counts
from pspf.testing import TestApp

SECOND = timedelta(seconds=1)
START = 1_704_067_200_000  # TestApp's clock: entries' ids, and their time without a timestamp field


class Click(msgspec.Struct):
    ts: int
    n: int = 1


def one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def count(total: int | None, value: Any) -> int:
    return (total or 0) + 1


def test_a_window_is_named_after_its_function_unless_given_a_name() -> None:
    app = App("names")
    app.window("clicks", windows.tumbling(SECOND), emit_to="out")(count)
    app.window("clicks", windows.hopping(2 * SECOND, SECOND), emit_to="out", name="count-2s")(count)
    app.window("views", windows.tumbling(SECOND), emit_to="out", name="views.count")(count)
    assert list(app.windows) == ["count", "count-2s", "views.count"]
    assert [w.name for w in app.windows_of("clicks")] == ["count", "count-2s"]
    assert [w.topic for w in app.windows.values()] == ["clicks", "clicks", "views"]
    assert app.topics == ["clicks", "views"]


def test_registration_clashes_are_one_line_errors_naming_app_topic_and_name() -> None:
    app = App("clashes")

    @app.handler("clicks")
    def handle(value: Any, ctx: Context) -> None: ...

    app.window("clicks", windows.tumbling(SECOND), emit_to="out")(count)

    with pytest.raises(ConfigError) as same_name:
        app.window("views", windows.tumbling(SECOND), emit_to="out")(count)
    assert one_line(same_name) == (
        "app 'clashes' already has a window named 'count' (of topic 'clicks'): "
        "the window of topic 'views' needs another name (name=)"
    )

    def again(value: Any, ctx: Context) -> None: ...

    with pytest.raises(ConfigError) as second_handler:
        app.handler("clicks")(again)
    assert one_line(second_handler) == (
        "app 'clashes' already has a handler for topic 'clicks' "
        "(test_registration_clashes_are_one_line_errors_naming_app_topic_and_name.<locals>.handle): "
        "test_registration_clashes_are_one_line_errors_naming_app_topic_and_name.<locals>.again "
        "cannot be a second one"
    )

    with pytest.raises(ConfigError) as bad_name:
        app.window("clicks", windows.tumbling(SECOND), emit_to="out")(lambda acc, value: acc)
    assert one_line(bad_name).startswith(
        "app 'clashes', window of topic 'clicks': invalid window name '<lambda>': use 1-200 letters"
    )
    with pytest.raises(ConfigError, match=r"invalid window name 'per:minute'"):
        app.window("clicks", windows.tumbling(SECOND), emit_to="out", name="per:minute")(count)
    # Nothing of a refused registration stays behind.
    assert list(app.windows) == ["count"]


def test_an_async_handler_cannot_share_its_topic_with_windows_whichever_comes_first() -> None:
    app = App("async")

    async def handle(value: Any, ctx: Context) -> None: ...

    app.handler("clicks")(handle)
    with pytest.raises(ConfigError) as window_after:
        app.window("clicks", windows.tumbling(SECOND), emit_to="out")(count)
    assert "app 'async', topic 'clicks': window 'count' cannot share the topic with the async handler" in (
        one_line(window_after)
    )
    assert not app.windows

    app.window("views", windows.tumbling(SECOND), emit_to="out")(count)
    with pytest.raises(ConfigError) as handler_after:
        app.handler("views")(handle)
    assert "app 'async', topic 'views': the async handler" in one_line(handler_after)
    assert "with window 'count'" in str(handler_after.value)


def test_a_shared_topic_is_retried_with_its_handlers_policy_or_its_first_windows() -> None:
    app = App("policies", retry=RetryPolicy(max_retries=7))
    handler_policy = RetryPolicy(max_retries=2, mode="deferred")

    def handle(value: Any, ctx: Context) -> None: ...

    app.window("clicks", windows.tumbling(SECOND), emit_to="out")(count)
    app.handler("clicks", retry=handler_policy)(handle)
    assert app.handlers["clicks"].retry.max_retries == 2
    assert app.handlers["clicks"].retry.mode == "deferred"
    with pytest.raises(ConfigError) as after_handler:
        app.window("clicks", windows.tumbling(SECOND), emit_to="out", name="c2", retry=handler_policy)(count)
    assert "window 'c2' sets retry=, but the topic's entries are one attempt for all its consumers" in (
        one_line(after_handler)
    )
    assert "its handler" in str(after_handler.value)

    app.window("views", windows.tumbling(SECOND), emit_to="out", name="v1", retry=RetryPolicy(max_retries=1))(
        count
    )
    app.window("views", windows.tumbling(SECOND), emit_to="out", name="v2")(count)
    assert app.handlers["views"].retry.max_retries == 1
    with pytest.raises(ConfigError, match="retried with the policy of its first window 'v1'"):
        app.window("views", windows.tumbling(SECOND), emit_to="out", name="v3", retry=handler_policy)(count)
    with pytest.raises(ConfigError, match="window 'v1' sets retry=, but with the handler"):
        app.handler("views")(handle)

    app.window("pages", windows.tumbling(SECOND), emit_to="out", name="p1")(count)
    assert app.handlers["pages"].retry.max_retries == 7  # the app's


def test_one_entry_is_one_attempt_for_the_handler_and_every_window() -> None:
    """A handler that raises takes the windows' changes with it, and a window that raises the
    handler's state writes and emits: the entry goes to the DLQ and counts nowhere."""
    app = App("together", retry=RetryPolicy(max_retries=2))

    @app.handler("clicks")
    def seen(click: Click, ctx: Context) -> None:
        if click.n < 0:
            raise ValueError("negative")
        ctx.state["n"] = ctx.state.get("n", 0) + click.n
        ctx.emit("seen", {"n": click.n}, key=ctx.key)

    @app.window("clicks", windows.tumbling(10 * SECOND), timestamp="ts", emit_to="counts")
    def per_10s(total: int | None, click: Click) -> int:
        return (total or 0) + 1

    @app.window("clicks", windows.hopping(10 * SECOND, 5 * SECOND), timestamp="ts", emit_to="sums")
    def sum_5s(total: int | None, click: dict[str, Any]) -> int:  # another value type: decoded apart
        if click["n"] == 13:
            raise ValueError("unlucky")
        return (total or 0) + click["n"]

    with TestApp(app, topics={"seen": 1}) as t:
        t.send("clicks", {"ts": 1000, "n": 2}, key="a")
        t.send("clicks", {"ts": 2000, "n": -1}, key="a")  # the handler raises
        t.send("clicks", {"ts": 3000, "n": 13}, key="a")  # a window raises
        t.send("clicks", {"ts": 4000, "n": 3}, key="a")
        t.send("clicks", {"ts": 60_000, "n": 1}, key="b")  # stream time closes a's windows
        assert t.state("a") == {"n": 5}
        assert t.emitted("seen") == [{"n": 2}, {"n": 3}, {"n": 1}]
        assert t.emitted("counts") == [{"key": "a", "start": 0, "end": 10_000, "value": 2}]
        assert t.emitted("sums") == [
            {"key": "a", "start": -5000, "end": 5000, "value": 5},
            {"key": "a", "start": 0, "end": 10_000, "value": 5},
        ]
        dead = t.dead_letters("clicks")
        assert [(d.error_type, d.message, d.attempts) for d in dead] == [
            ("ValueError", "negative", 2),
            ("ValueError", "unlucky", 2),
        ]
        assert (t.counts.handled, t.counts.dead_lettered, t.counts.late) == (3, 2, 0)


def test_a_windows_timestamp_field_may_hold_epoch_ms_a_float_or_rfc_3339_text_in_a_dict_or_a_struct() -> None:
    """Each form of event time lands in the window it names; an entry without one is dead-lettered."""
    app = App("event-times")
    app.window("clicks", windows.tumbling(10 * SECOND), timestamp="ts", emit_to="out", name="d")(count)

    @app.window("taps", windows.tumbling(10 * SECOND), timestamp="ts", emit_to="out", name="s")
    def per_struct(total: int | None, click: Click) -> int:
        return (total or 0) + 1

    with TestApp(app) as t:
        t.send("clicks", {"ts": 1000}, key="a")
        t.send("clicks", {"ts": 12_000.5}, key="a")
        t.send("clicks", {"ts": "1970-01-01T00:00:13Z"}, key="a")
        t.send("clicks", {"n": 1}, key="a")  # no event time: the entry fails
        t.send("taps", {"ts": 14_000}, key="a")
        t.send("clicks", {"ts": 60_000}, key="b")
        t.send("taps", {"ts": 60_000}, key="b")
        assert sorted((v["start"], v["value"]) for v in t.emitted("out") if v["key"] == "a") == [
            (0, 1),
            (10_000, 1),
            (10_000, 2),
        ]
        dead = t.dead_letters("clicks")
        assert [(d.error_type, d.message) for d in dead] == [
            ("ConfigError", "the entry has no timestamp field 'ts'")
        ]


def late_app(strict: bool) -> App:
    """A handler and windows of 10 s and 60 s on one topic; ``strict``: one more, late="dlq"."""
    app = App("late-for-one")

    @app.handler("clicks")
    def seen(click: dict[str, int], ctx: Context) -> None:
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    app.window("clicks", windows.tumbling(10 * SECOND), timestamp="ts", emit_to="out", name="short")(count)
    app.window("clicks", windows.tumbling(60 * SECOND), timestamp="ts", emit_to="out", name="long")(count)
    if strict:
        strict_spec = windows.tumbling(10 * SECOND)
        app.window("clicks", strict_spec, timestamp="ts", emit_to="out", name="strict", late="dlq")(count)
    return app


def test_an_entry_late_for_one_window_is_counted_for_it_while_the_others_take_it() -> None:
    with TestApp(late_app(strict=False)) as t:
        t.send("clicks", {"ts": 1000}, key="a")
        t.send("clicks", {"ts": 25_000}, key="a")  # closes [0, 10 s) of short
        t.send("clicks", {"ts": 2000}, key="a")  # late for short, on time for long
        t.send("clicks", {"ts": 200_000}, key="a")
        assert t.state("a") == {"n": 4}
        assert (t.counts.late, t.counts.late_windows) == (1, {"short": 1})
        values = {(v["start"], v["end"]): v["value"] for v in t.emitted("out")}
        assert values[(0, 60_000)] == 3 and values[(0, 10_000)] == 1


def test_an_entry_late_for_a_window_that_dead_letters_late_ones_fails_for_all() -> None:
    with TestApp(late_app(strict=True)) as t:
        t.send("clicks", {"ts": 1000}, key="a")
        t.send("clicks", {"ts": 25_000}, key="a")
        t.send("clicks", {"ts": 2000}, key="a")  # late for short and strict: strict sends it to the DLQ
        t.send("clicks", {"ts": 200_000}, key="a")
        assert [d.error_type for d in t.dead_letters()] == ["LateEntry"]
        assert "in window 'strict'" in t.dead_letters()[0].message
        assert t.state("a") == {"n": 3}
        assert t.counts.late == 0  # the entry failed as a whole: counted late nowhere
        values = {(v["start"], v["end"]): v["value"] for v in t.emitted("out")}
        assert values[(0, 60_000)] == 2


def test_counts_add_up_late_entries_per_window() -> None:
    total = Counts(late=1, late_windows={"a": 1})
    total.add(Counts(late=3, late_windows={"a": 1, "b": 2}, handled=4))
    assert (total.late, total.late_windows, total.handled) == (4, {"a": 2, "b": 2}, 4)


def test_the_late_log_says_it_at_most_every_few_seconds_with_the_counts_since_the_last_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    late = LateLog(every_s=5.0)
    with caplog.at_level(logging.WARNING, logger="pspf.timekeeping"):
        late.add({"short": 2}, now=100.0)  # the first says it at once
        late.add({"short": 1, "long": 4}, now=101.0)
        late.add({"short": 1}, now=104.9)
        late.flush(now=104.99)
        assert len(caplog.records) == 1
        late.flush(now=105.0)  # 5 s after the last line: what came since
        late.flush(now=200.0)  # nothing new: no line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "late entries dropped (all their windows had closed) since the last such line, by window: short=2",
        "late entries dropped (all their windows had closed) since the last such line, by window: "
        "long=4 short=2",
    ]


def test_a_tables_topic_takes_neither_a_handler_nor_a_window() -> None:
    app = App("tables")
    app.table("users")
    app.global_table("countries")

    def handle(value: Any, ctx: Context) -> None: ...

    with pytest.raises(ConfigError) as handler:
        app.handler("users")(handle)
    assert one_line(handler).startswith("app 'tables': topic 'users' is already read by a table: handler ")
    with pytest.raises(ConfigError) as window:
        app.window("countries", windows.tumbling(SECOND), emit_to="out")(count)
    assert one_line(window) == (
        "app 'tables': topic 'countries' is already read by a global table: window 'count' cannot read it"
    )
    assert (app.topics, list(app.windows)) == (["users"], [])
