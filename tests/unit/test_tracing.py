"""pspf.observability.tracing through TestApp: entry and commit spans, traceparent, no work when off."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pspf import App, Context, RetryPolicy
from pspf.observability.tracing import TracedContext, configured
from pspf.outbox.emit import SOURCE_ID_HEADER
from pspf.testing import TestApp

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
GIVEN = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


class Traced:
    """A tracer provider of its own (the global one stays untouched) and what it exported."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


@pytest.fixture
def traced() -> Iterator[Traced]:
    tracing = Traced()
    yield tracing
    tracing.provider.shutdown()


def forwarding_app(fail_on: str | None = None, retry: RetryPolicy | None = None) -> App:
    app = App("fwd", retry=retry)

    @app.handler("orders")
    def forward(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        if fail_on is not None and order.get("note") == fail_on:
            raise ValueError(f"bad order {ctx.key}")
        ctx.state["n"] = ctx.state.get("n", 0) + 1
        ctx.emit("out", {"user": ctx.key}, key=ctx.key)

    return app


def trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def traceparent_of(span: ReadableSpan) -> str:
    """The W3C header naming ``span``, as the propagator writes it (flags as sampled)."""
    assert span.context is not None
    return f"00-{trace_id(span)}-{span_id(span)}-{int(span.context.trace_flags):02x}"


def parent_id(span: ReadableSpan) -> str | None:
    return None if span.parent is None else f"{span.parent.span_id:016x}"


def test_the_entry_span_continues_the_traceparent_and_the_emit_carries_it_on(traced: Traced) -> None:
    with TestApp(forwarding_app(), topics={"out": 1}, tracer_provider=traced.provider) as t:
        entry_id = t.send("orders", {"amount": 3}, key="u1", headers={"traceparent": TRACEPARENT})
        (out,) = t.emitted_entries("out")
    (span,) = traced.spans("process orders")
    assert span.kind is SpanKind.CONSUMER
    assert trace_id(span) == TRACE_ID and parent_id(span) == PARENT_ID
    assert span.parent is not None and span.parent.is_remote
    assert dict(span.attributes or {}) == {
        "messaging.system": "pspf",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "orders",
        "messaging.destination.partition.id": "0",
        "messaging.message.id": entry_id,
        "messaging.consumer.group.name": "fwd",
        "pspf.key": "u1",
        "pspf.outcome": "handled",
    }
    assert span.status.status_code is StatusCode.UNSET
    # The emitted entry names the entry span as its parent, beside the source headers.
    assert out.headers["traceparent"] == traceparent_of(span)
    assert out.headers[SOURCE_ID_HEADER] == entry_id
    # The emitted entry was handled in turn (the app reads "orders" only: no second span).
    (commit,) = traced.spans("pspf commit")
    assert commit.kind is SpanKind.INTERNAL
    assert (commit.attributes or {})["pspf.handled"] == 1
    assert (commit.attributes or {})["messaging.consumer.group.name"] == "fwd"


def test_an_entry_without_traceparent_starts_a_trace_and_its_emit_joins_it(traced: Traced) -> None:
    with TestApp(forwarding_app(), topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send("orders", {"amount": 3}, key="u1")
        (out,) = t.emitted_entries("out")
    (span,) = traced.spans("process orders")
    assert span.parent is None
    assert out.headers["traceparent"] == traceparent_of(span)


def test_a_chain_of_apps_stays_in_one_trace(traced: Traced) -> None:
    """An app that reads what it emits: the second entry's span is the first one's child."""
    app = App("chain")

    @app.handler("a")
    def first(value: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        ctx.emit("b", value, key=ctx.key)

    @app.handler("b")
    def second(value: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        ctx.state["seen"] = True

    with TestApp(app, tracer_provider=traced.provider) as t:
        t.send("a", {}, key="k", headers={"traceparent": TRACEPARENT})
    (a,) = traced.spans("process a")
    (b,) = traced.spans("process b")
    assert trace_id(a) == trace_id(b) == TRACE_ID
    assert parent_id(b) == span_id(a)


def test_the_handler_s_own_spans_are_children_and_its_emits_name_them(traced: Traced) -> None:
    tracer = traced.provider.get_tracer("user")
    app = App("user-spans")

    @app.handler("orders")
    def handle(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        with tracer.start_as_current_span("lookup"):
            ctx.emit("out", order, key=ctx.key)
        ctx.emit("out", order, key=ctx.key, headers={"traceparent": GIVEN})

    with TestApp(app, topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send("orders", {}, key="u1", headers={"traceparent": TRACEPARENT})
        inner, given = t.emitted_entries("out")
    (entry,) = traced.spans("process orders")
    (lookup,) = traced.spans("lookup")
    assert parent_id(lookup) == span_id(entry) and trace_id(lookup) == TRACE_ID
    assert inner.headers["traceparent"] == traceparent_of(lookup)
    # A traceparent the handler gave is kept as it is.
    assert given.headers["traceparent"] == GIVEN


def test_failed_attempts_end_with_their_outcome_and_the_dead_letter_keeps_the_traceparent(
    traced: Traced,
) -> None:
    app = forwarding_app(fail_on="bad", retry=RetryPolicy(max_retries=3))
    with TestApp(app, topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send("orders", {"note": "bad"}, key="u1", headers={"traceparent": TRACEPARENT})
        (dead,) = t.dead_letters()
        assert t.emitted("out") == []
    spans = traced.spans("process orders")
    assert [(s.attributes or {})["pspf.outcome"] for s in spans] == ["retry", "retry", "dead_lettered"]
    for span in spans:
        assert trace_id(span) == TRACE_ID and parent_id(span) == PARENT_ID
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "ValueError: bad order u1"
        assert [e.name for e in span.events] == ["exception"]
    assert b"traceparent" in dead.original[b"headers"]
    assert TRACEPARENT.encode() in dead.original[b"headers"]


def test_an_entry_that_fails_before_its_handler_gets_a_span_too(traced: Traced) -> None:
    with TestApp(forwarding_app(), topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send_fields(
            "orders",
            {
                b"key": b"u1",
                b"value": b"{not json",
                b"headers": f'{{"traceparent": "{TRACEPARENT}"}}'.encode(),
            },
        )
        assert len(t.dead_letters()) == 1
    (span,) = traced.spans("process orders")
    assert trace_id(span) == TRACE_ID and parent_id(span) == PARENT_ID
    assert (span.attributes or {})["pspf.outcome"] == "dead_lettered"
    assert (span.attributes or {})["pspf.key"] == "u1"
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description is not None and span.status.description.startswith("DecodeError")


def test_parked_attempts_say_so(traced: Traced) -> None:
    app = forwarding_app(fail_on="bad", retry=RetryPolicy(mode="deferred", max_retries=2))
    with TestApp(app, topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send("orders", {"note": "bad"}, key="u1")
    outcomes = [(s.attributes or {})["pspf.outcome"] for s in traced.spans("process orders")]
    assert outcomes == ["parked", "dead_lettered"]


def test_async_handlers_trace_each_entry_in_its_own_task(traced: Traced) -> None:
    app = App("async-fwd")
    tracer = traced.provider.get_tracer("user")

    @app.handler("orders")
    async def forward(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        await asyncio.sleep(0)
        with tracer.start_as_current_span(f"inner {ctx.key}"):
            await asyncio.sleep(0)
        ctx.emit("out", order, key=ctx.key)

    with TestApp(app, topics={"out": 1}, tracer_provider=traced.provider) as t:
        for n in range(3):
            parent = f"00-{TRACE_ID[:-1]}{n}-{PARENT_ID}-01"
            t.send("orders", {"n": n}, key=f"k{n}", headers={"traceparent": parent})
        out = t.emitted_entries("out")
    spans = traced.spans("process orders")
    assert len(spans) == 3 and len(out) == 3
    for n, (span, emitted) in enumerate(zip(spans, out, strict=True)):
        assert trace_id(span) == f"{TRACE_ID[:-1]}{n}"
        assert (span.attributes or {})["pspf.outcome"] == "handled"
        (inner,) = traced.spans(f"inner k{n}")
        assert parent_id(inner) == span_id(span)
        assert emitted.headers["traceparent"] == traceparent_of(span)


def test_a_sync_handler_with_a_deadline_runs_in_its_span(traced: Traced) -> None:
    app = forwarding_app(retry=RetryPolicy(timeout_ms=5_000))
    with TestApp(app, topics={"out": 1}, tracer_provider=traced.provider) as t:
        t.send("orders", {}, key="u1", headers={"traceparent": TRACEPARENT})
        (out,) = t.emitted_entries("out")
    (span,) = traced.spans("process orders")
    assert out.headers["traceparent"] == traceparent_of(span)


def test_a_handler_past_its_deadline_ends_its_span_as_failed(traced: Traced) -> None:
    app = App("slow", retry=RetryPolicy(timeout_ms=50))
    late = threading.Event()

    @app.handler("orders")
    def handle(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        if ctx.delivery_count == 1:
            time.sleep(0.3)  # runs on in its thread after the attempt failed
            late.set()
            raise ValueError("too late")
        ctx.state["done"] = True

    with TestApp(app, tracer_provider=traced.provider) as t:
        t.send("orders", {}, key="u1")
        assert t.state("u1") == {"done": True}
    assert late.wait(5)
    spans = traced.spans("process orders")
    assert [(s.attributes or {})["pspf.outcome"] for s in spans] == ["retry", "handled"]
    assert spans[0].status.description == "HandlerTimeout: the handler ran past its timeout of 50 ms"


def test_without_a_provider_nothing_is_traced() -> None:
    # The API's default global provider is a proxy: no tracing, plain contexts, no header.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert configured("app") is None
    seen: list[type] = []
    app = App("plain")

    @app.handler("orders")
    def handle(order: dict, ctx: Context) -> None:  # type: ignore[type-arg]
        seen.append(type(ctx))
        ctx.emit("out", order, key=ctx.key)

    with TestApp(app, topics={"out": 1}) as t:
        t.send("orders", {}, key="u1", headers={"traceparent": TRACEPARENT})
        t.send("orders", {}, key="u1")
        headers = [e.headers for e in t.emitted_entries("out")]
    assert seen == [Context, Context]
    assert all("traceparent" not in h for h in headers)


def test_a_disabled_sdk_counts_as_no_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configured("app", TracerProvider()) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    tracing = configured("app", TracerProvider())
    assert tracing is not None and tracing.app == "app"
    assert issubclass(TracedContext, Context)
