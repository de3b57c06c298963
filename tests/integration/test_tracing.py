"""OpenTelemetry tracing against a real server: ``opentelemetry-instrument pspf run``, the outbox
relay, the DLQ and a redrive all keep an entry's trace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pspf import App, Context, NonRetryableError, Producer, Settings, Worker, codec
from pspf.cycle import processor
from pspf.keys import stream_key
from pspf.observability import tracing
from pspf.service import Service
from tests.conftest import pspf_command, subprocess_env

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def forwarding() -> App:
    """Reads PSPF_TEST_TOPIC, emits each value to PSPF_TEST_OUT; values that say "bad" fail for good
    unless PSPF_TEST_FIXED is 1."""
    app = App(os.environ["PSPF_TEST_APP"])
    out = os.environ["PSPF_TEST_OUT"]

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def forward(value: dict[str, Any], ctx: Context) -> None:
        if value.get("bad") and os.environ.get("PSPF_TEST_FIXED") != "1":
            raise NonRetryableError("marked bad")
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        ctx.emit(out, value, key=ctx.key)

    return app


def produce(url: str, topic: str, value: Any, headers: dict[str, str] | None = None) -> None:
    with Producer(settings=Settings.load({"PSPF_BROKER": url}, environ={})) as producer:
        producer.send(topic, value, key="u1", headers=headers)


def headers_of(rclient: redis.Redis, topic: str) -> list[dict[str, str]]:
    return [codec.decode_headers(f.get(codec.HEADERS)) for _, f in rclient.xrange(stream_key(topic, 0))]


def console_spans(stdout: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed: JSON objects, each starting on a line of its own."""
    decoder = json.JSONDecoder()
    spans = []
    position = 0
    while (start := stdout.find("{\n", position)) != -1:
        try:
            found, position = decoder.raw_decode(stdout, start)
        except json.JSONDecodeError:
            position = start + 1
            continue
        if isinstance(found, dict) and "context" in found:
            spans.append(found)
    return spans


def instrument_command() -> str | None:
    """``opentelemetry-instrument`` of this Python's environment (else on PATH), None without one."""
    beside = Path(sys.executable).parent / "opentelemetry-instrument"
    return str(beside) if beside.exists() else shutil.which("opentelemetry-instrument")


@pytest.mark.skipif(
    instrument_command() is None,
    reason="opentelemetry-instrument is not installed (pip install 'pspf[otel]')",
)
def test_opentelemetry_instrument_pspf_run_continues_the_trace_into_the_emitted_entry(
    redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis, tmp_path: Path
) -> None:
    topic, out = make_topic(1), make_topic(1)
    produce(redis_url, topic, {"n": 1}, {"traceparent": TRACEPARENT})
    env = subprocess_env(
        PSPF_TEST_APP=f"traced-{topic}",
        PSPF_TEST_TOPIC=topic,
        PSPF_TEST_OUT=out,
        OTEL_SERVICE_NAME="pspf-tracing-test",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_PROPAGATORS="tracecontext,baggage",
    )
    env.pop("OTEL_SDK_DISABLED", None)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    command = [
        str(instrument_command()),
        "--traces_exporter",
        "console",
        "--metrics_exporter",
        "none",
        "--logs_exporter",
        "none",
        *pspf_command("run", f"{__name__}:forwarding", "--until-idle"),
        *("--broker", redis_url, "--state-dir", str(tmp_path / "state"), "--block-ms", "100"),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    spans = console_spans(done.stdout)
    (process,) = [s for s in spans if s["name"] == f"process {topic}"]
    assert process["context"]["trace_id"] == f"0x{TRACE_ID}"
    assert process["parent_id"] == f"0x{PARENT_ID}"
    assert process["kind"] == "SpanKind.CONSUMER"
    attributes = process["attributes"]
    assert attributes["messaging.destination.name"] == topic
    assert attributes["messaging.destination.partition.id"] == "0"
    assert attributes["messaging.consumer.group.name"] == f"traced-{topic}"
    assert attributes["pspf.outcome"] == "handled"
    assert process["resource"]["attributes"]["service.name"] == "pspf-tracing-test"
    assert any(s["name"] == "pspf commit" for s in spans)
    # The emitted entry, published by the relay, carries the process span as its parent.
    (emitted,) = headers_of(rclient, out)
    span_id = process["context"]["span_id"].removeprefix("0x")
    assert emitted["traceparent"].split("-")[1:3] == [TRACE_ID, span_id]


#: A program that sets the SDK up in code, globally, then runs a worker: what it traced, as JSON.
SDK_IN_CODE = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pspf import Settings, Worker
from tests.integration.test_tracing import forwarding

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
Worker(forwarding(), Settings.load()).run(until_idle=True)
print(json.dumps([[s.name, f"{s.context.trace_id:032x}"] for s in exporter.get_finished_spans()]))
"""


def test_a_worker_traces_with_the_sdk_set_up_in_code(
    redis_url: str, make_topic: Callable[[int], str], rclient: redis.Redis, tmp_path: Path
) -> None:
    topic, out = make_topic(1), make_topic(1)
    produce(redis_url, topic, {"n": 1}, {"traceparent": TRACEPARENT})
    env = subprocess_env(
        PSPF_TEST_APP=f"in-code-{topic}",
        PSPF_TEST_TOPIC=topic,
        PSPF_TEST_OUT=out,
        PSPF_BROKER=redis_url,
        PSPF_STATE_DIR=str(tmp_path / "state"),
        PSPF_BLOCK_MS="100",
    )
    done = subprocess.run(
        [sys.executable, "-c", SDK_IN_CODE], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    assert [f"process {topic}", TRACE_ID] in spans
    assert any(name == "pspf commit" for name, _ in spans)
    (emitted,) = headers_of(rclient, out)
    assert emitted["traceparent"].split("-")[1] == TRACE_ID


class Traced:
    """An in-process worker traced with a provider of its own (the global one stays untouched)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        provider = self.provider
        monkeypatch.setattr(processor, "configured", lambda app: tracing.configured(app, provider))

    def spans(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traced]:
    found = Traced(monkeypatch)
    yield found
    found.provider.shutdown()


def test_the_traceparent_survives_the_dlq_and_a_redrive(
    redis_url: str,
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    traced: Traced,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic, out = make_topic(1), make_topic(1)
    for name, value in (
        ("PSPF_TEST_APP", f"redrive-{topic}"),
        ("PSPF_TEST_TOPIC", topic),
        ("PSPF_TEST_OUT", out),
    ):
        monkeypatch.setenv(name, value)
    settings = make_settings()
    produce(redis_url, topic, {"bad": True}, {"traceparent": TRACEPARENT, "tenant": "t1"})
    Worker(forwarding(), settings).run(until_idle=True)
    (dead,) = traced.spans(f"process {topic}")
    assert (dead.attributes or {})["pspf.outcome"] == "dead_lettered"
    service = Service(settings)
    try:
        (listed,) = service.dlq.dlq_list(topic)
        detail = service.dlq.dlq_show(topic, listed.dlq_id)
        assert detail.headers["traceparent"] == TRACEPARENT
        assert service.dlq.dlq_redrive(topic, all_entries=True).changed == 1
    finally:
        service.close()
    redriven = headers_of(rclient, topic)[-1]
    assert redriven["traceparent"] == TRACEPARENT and redriven["tenant"] == "t1"

    monkeypatch.setenv("PSPF_TEST_FIXED", "1")
    Worker(forwarding(), settings).run(until_idle=True)
    handled = [
        s for s in traced.spans(f"process {topic}") if (s.attributes or {})["pspf.outcome"] == "handled"
    ]
    (span,) = handled
    assert span.context is not None and span.parent is not None
    assert (f"{span.context.trace_id:032x}", f"{span.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
    (emitted,) = headers_of(rclient, out)
    assert emitted["traceparent"].split("-")[1:3] == [TRACE_ID, f"{span.context.span_id:016x}"]
