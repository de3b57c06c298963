"""OpenTelemetry tracing: a span per handled entry and per batch commit, when a provider is set.

Everything PSPF does with OpenTelemetry is here. A worker (``BatchProcessor``) and ``TestApp``
ask ``configured`` once, when they are built: it returns ``None`` unless a real tracer
provider is installed (by ``opentelemetry-instrument`` or by code that ran before), and then
the cycle does no tracing work at all: no span, no header lookup, only a ``None`` check per
read. Only the ``opentelemetry-api`` package is needed here; without it tracing is off.

With a provider, each attempt of an entry gets a CONSUMER span ``process <topic>`` whose parent
is the entry's W3C ``traceparent`` header (through the global propagator, so a configured one is
honoured). The span is current while the handler runs (sync handlers, the helper thread of a
handler with a deadline, and each async handler's task), so the handler's own spans are its
children, and ``ctx.emit`` writes a ``traceparent`` header for the current span unless the handler
gave one. The span ends when the attempt's outcome is known: ``handled``, ``retry`` (ordered
retry), ``parked`` (deferred retry), ``dead_lettered``, or ``discarded`` (an async attempt that
returned after an earlier entry's failure held the stream: it runs again). Each store commit of
a batch gets an INTERNAL span ``pspf commit``. Timers and scheduled callbacks run outside any
entry span: what they emit carries no ``traceparent``.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pspf import codec
from pspf.context import Context
from pspf.errors import DecodeError
from pspf.failures import Outcome

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

#: the W3C Trace Context header an entry's trace travels in
TRACEPARENT = "traceparent"
#: ``messaging.system`` of every span: the entries are PSPF's format on Redis streams
MESSAGING_SYSTEM = "pspf"
#: ``pspf.outcome`` of an attempt that returned and joined its batch
HANDLED = "handled"
#: ``pspf.outcome`` of an async attempt that returned after an entry whose retry holds the stream
DISCARDED = "discarded"
#: ``pspf.outcome`` of a failed attempt, by what ``failures.decide`` made of it
FAILED = {Outcome.RETRY: "retry", Outcome.PARKED: "parked", Outcome.DEAD: "dead_lettered"}

#: the environment variable that names a tracer provider the API loads on first use
_NAMED_PROVIDER = "OTEL_PYTHON_TRACER_PROVIDER"

SyncHandler = Callable[[Any, Context], Any]
After = Callable[[bytes], None]
AsyncHandler = Callable[[Any, Context], Awaitable[Any]]


def configured(app: str, provider: TracerProvider | None = None) -> Tracing | None:
    """The app's tracing when a tracer provider is set up (``provider``, else the global one).

    None when opentelemetry is not installed, when nothing imported it and no environment
    variable names a provider (nobody can have set one up), when the global provider is still
    the API's default (a proxy or no-op), or when the SDK is disabled (``OTEL_SDK_DISABLED``).
    """
    if provider is None and "opentelemetry.trace" not in sys.modules and _NAMED_PROVIDER not in os.environ:
        return None
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    tracer = provider.get_tracer("pspf", _version())
    if isinstance(tracer, trace.NoOpTracer | trace.ProxyTracer):
        return None
    return Tracing(tracer, app)


def sync_run(
    tracing: Tracing | None, func: SyncHandler, passed: After | None
) -> tuple[SyncHandler, After | None, type[Context]]:
    """What ``execution.run_sync`` calls: the handler, ``passed`` and the context type, traced or not."""
    if tracing is None:
        return func, passed, Context
    return tracing.wrap_sync(func), tracing.passing(passed), TracedContext


class Tracing:
    """Spans of one app's attempts and commits, with the tracer of a configured provider."""

    def __init__(self, tracer: Tracer, app: str) -> None:
        from opentelemetry import context, propagate, trace

        self.tracer = tracer
        self.app = app
        self._context = context
        self._propagate = propagate
        self._trace = trace
        #: entry id -> the span of its attempt in progress, until its outcome ends it
        self.open: dict[bytes, Span] = {}
        #: entry id -> when its async handler returned (ns), for its span's end
        self.returned_ns: dict[bytes, int] = {}

    # -- an entry's attempt ---------------------------------------------------------------------

    def wrap_sync(self, func: SyncHandler) -> SyncHandler:
        """``func`` run inside its entry's span, started here and ended by ``passing`` or ``settle``.

        ``settle`` records the failure, whether the handler raised it or it came after (its
        deadline, a state that cannot be stored). Called at the start of a run: spans a
        previous run left open (a store failure stopped it) are forgotten, unended.
        """
        self.open.clear()

        def traced(value: Any, ctx: Context) -> Any:
            span = self._start(ctx)
            token = self._context.attach(self._trace.set_span_in_context(span))
            try:
                return func(value, ctx)
            finally:
                self._context.detach(token)

        return traced

    def wrap_async(self, func: AsyncHandler) -> AsyncHandler:
        """``wrap_sync`` for an async handler: the span is current in the handler's task.

        Its span ends when ``joined`` knows whether the batch kept what it did, at the time
        the handler returned.
        """
        self.open.clear()
        returned = self.returned_ns
        returned.clear()

        async def traced(value: Any, ctx: Context) -> Any:
            span = self._start(ctx)
            token = self._context.attach(self._trace.set_span_in_context(span))
            try:
                result = await func(value, ctx)
            finally:
                self._context.detach(token)
            returned[ctx.entry_id] = time.time_ns()
            return result

        return traced

    def joined(self, ids: Sequence[tuple[int, bytes]], ran: int) -> None:
        """The async attempts that returned, by (index, id): those before ``ran`` joined the batch.

        The others ran ahead on other keys after an entry whose retry holds the stream: their
        effects are dropped and they run again (``discarded``).
        """
        for index, id_b in ids:
            span = self.open.pop(id_b, None)
            if span is not None:
                span.set_attribute("pspf.outcome", HANDLED if index < ran else DISCARDED)
                span.end(self.returned_ns.pop(id_b, None))

    def passing(self, passed: After | None) -> After:
        """``run_sync``'s ``passed``, first ending the entry's span as handled (if still open)."""
        handled = self.handled

        def after(id_b: bytes) -> None:
            handled(id_b)
            if passed is not None:
                passed(id_b)

        return after

    def handled(self, id_b: bytes) -> None:
        """The entry's attempt returned and joined its batch: its span ends as handled."""
        span = self.open.pop(id_b, None)
        if span is not None:
            span.set_attribute("pspf.outcome", HANDLED)
            span.end()

    def settle(
        self,
        topic: str,
        partition: int,
        entry: tuple[bytes, dict[bytes, bytes]],
        exc: BaseException,
        outcome: Outcome,
    ) -> None:
        """A failed attempt's span ends with what ``failures.decide`` made of it.

        An entry that failed before its handler ran (it could not be decoded, was delivered too
        often, is in the wrong partition) gets its span here, so every attempt has one.
        """
        id_b, fields = entry
        span = self.open.pop(id_b, None)
        if span is None:
            span = self._start_span(topic, partition, id_b, _key_text(fields), _headers_of(fields))
        span.record_exception(exc)
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.set_attribute("pspf.outcome", FAILED[outcome])
        span.end()

    def _start(self, ctx: Context) -> Span:
        span = self._start_span(ctx.topic, ctx.partition, ctx.entry_id, ctx.key, ctx.headers)
        self.open[ctx.entry_id] = span
        return span

    def _start_span(
        self, topic: str, partition: int, id_b: bytes, key: str, headers: dict[str, str] | None
    ) -> Span:
        parent = self._propagate.extract(headers) if headers else None
        return self.tracer.start_span(
            f"process {topic}",
            parent,
            self._trace.SpanKind.CONSUMER,
            {
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "messaging.message.id": id_b.decode(),
                "messaging.consumer.group.name": self.app,
                "pspf.key": key,
            },
        )

    # -- a batch's commit -----------------------------------------------------------------------

    def commit(
        self, partition: int, topics: list[str], counts: tuple[int, int, int], started_ns: int
    ) -> None:
        """A span ``pspf commit`` for a store commit that began at ``started_ns`` and just ended.

        ``counts``: the entries it holds (handled, skipped as done, dead-lettered) of ``topics``.
        """
        handled, skipped, dead_lettered = counts
        span = self.tracer.start_span(
            "pspf commit",
            kind=self._trace.SpanKind.INTERNAL,
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.consumer.group.name": self.app,
                "messaging.destination.partition.id": str(partition),
                "pspf.topics": topics,
                "pspf.handled": handled,
                "pspf.skipped": skipped,
                "pspf.dead_lettered": dead_lettered,
            },
            start_time=started_ns,
        )
        span.end()


class TracedContext(Context):
    """The ``Context`` of an entry whose attempt has a span: its emits carry ``traceparent``."""

    __slots__ = ()

    def emit(
        self, topic: str, value: Any, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """``Context.emit``, with the current span's ``traceparent`` unless ``headers`` has one."""
        if not headers or TRACEPARENT not in headers:
            from opentelemetry import propagate

            carrier = dict(headers) if headers else {}
            propagate.inject(carrier)
            headers = carrier
        super().emit(topic, value, key, headers)


def _version() -> str | None:
    """PSPF's installed version, for the tracer's instrumentation scope (None from a bare checkout)."""
    try:
        return importlib.metadata.version("pspf")
    except importlib.metadata.PackageNotFoundError:
        return None


def _key_text(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(codec.KEY)
    return "" if raw is None else raw.decode(errors="replace")


def _headers_of(fields: dict[bytes, bytes]) -> dict[str, str] | None:
    """The entry's headers, or None when it has none or they cannot be read (then: no parent)."""
    raw = fields.get(codec.HEADERS)
    if raw is None or type(fields) is not dict:
        return None
    try:
        return codec.decode_headers(raw)
    except DecodeError:
        return None
