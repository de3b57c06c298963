"""Tracing benchmark: the worker with the OpenTelemetry API and no SDK (tracing off), with the SDK
(a span per entry and per commit), and optionally another checkout's worker, in the same run.

Usage::

    python benchmarks/tracing.py                          # 200,000 entries, 1,000 keys, 5 runs
    python benchmarks/tracing.py --entries 100000 --runs 3
    python benchmarks/tracing.py --baseline ../pspf-main  # also a checkout without tracing

Each run pre-loads the same entries into one partition of a fresh topic per variant (and a plain
stream), then runs, in this order, each variant's worker in a child process of its own
(``benchmarks/throughput.py``'s ``pspf_child``: the typed order-totals app,
``Worker.run(until_idle=True)``, SQLite, state backup on) and the strong redis-py loop of
``benchmarks/throughput.py`` over the plain stream:

- ``off``: this checkout, the API installed, no SDK: ``pspf.tracing.configured`` finds the
  API's proxy provider and the cycle does no tracing work;
- ``baseline`` (with ``--baseline DIR``): the checkout in DIR (e.g. a worktree of the main
  branch, without tracing) runs the same child, so "off costs nothing" is measured, not assumed;
- ``sdk``: this checkout with an SDK ``TracerProvider`` set globally before the worker is built,
  its spans going through a ``BatchSpanProcessor`` to an exporter that drops them: the cost of
  tracing when it is on, short of the network.

The report gives medians over the runs of the whole ``run()`` call's rate and of the steady part
(from the first cycle to the last that read entries), and the ratios. Every run checks the state
the worker left, and the ``sdk`` child checks that it made one span per entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("off", "baseline", "sdk")


def child(args: argparse.Namespace) -> None:
    """One worker run in this process, of the checkout ``--code`` names (this one by default)."""
    sys.path.insert(0, args.code or str(ROOT))
    from benchmarks.throughput import pspf_child

    exporter = None
    if args.variant == "sdk":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        class Dropping(SpanExporter):
            def __init__(self) -> None:
                self.spans = 0

            def export(self, spans: Sequence[Any]) -> SpanExportResult:
                self.spans += sum(1 for span in spans if span.name.startswith("process "))
                return SpanExportResult.SUCCESS

        exporter = Dropping()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65_536))
        trace.set_tracer_provider(provider)
    pspf_child(args)
    if exporter is not None:
        trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
        print(json.dumps({"entry_spans": exporter.spans}))


def run_child(variant: str, url: str, topic: str, app: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pspf-bench-state-") as state_dir:
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            *("--child", "--variant", variant, "--broker", url, "--topic", topic, "--app", app),
            *("--state-dir", state_dir, "--batch-size", str(args.batch_size)),
        ]
        if variant == "baseline":
            command += ["--code", str(Path(args.baseline).resolve())]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {variant} child failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = {}
    for line in done.stdout.strip().splitlines():
        if line.startswith("{"):
            result.update(json.loads(line))
    return result


def one_run(url: str, orders: list[tuple[str, bytes]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each variant on a fresh topic and app, then the strong loop on a plain copy."""
    from benchmarks.throughput import check, cleanup, expected_totals, preload, run_strong

    tag = uuid.uuid4().hex[:8]
    copy = f"bench:plain:{tag}"
    expected = expected_totals(orders)
    results: dict[str, dict[str, Any]] = {}
    try:
        for index, variant in enumerate(args.variants):
            topic = app = f"bench-trace-{variant}-{tag}"
            preload(url, topic, copy if index == 0 else None, orders)
            try:
                results[variant] = run_child(variant, url, topic, app, args)
            finally:
                cleanup(url, topic, app, f"{copy}:none")
            check(variant, results[variant], expected)
            spans = results[variant].get("entry_spans", len(orders))
            if spans != len(orders):
                raise SystemExit(f"{variant}: {spans} entry spans for {len(orders)} entries")
        results["strong"] = run_strong(url, copy, f"strong-{tag}", args.batch_size)
        check("strong loop", results["strong"], expected)
    finally:
        cleanup(url, f"bench-trace-none-{tag}", f"none-{tag}", copy)
    return results


def benchmark(args: argparse.Namespace, url: str, where: str) -> None:
    import os

    from benchmarks.throughput import line, make_orders, rate

    print(
        f"PSPF tracing benchmark: {args.entries:,} entries, {args.keys:,} keys, one partition, "
        f"{args.runs} runs"
    )
    print(f"broker: {where}; python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    if args.baseline:
        print(f"baseline checkout: {args.baseline}")
    orders = make_orders(args.entries, args.keys)
    series: dict[str, list[float]] = {}
    for run in range(1, args.runs + 1):
        res = one_run(url, orders, args)
        figures = {"strong": rate(args.entries, res["strong"]["seconds"])}
        for variant in args.variants:
            figures[variant] = rate(args.entries, res[variant]["seconds"])
            figures[f"{variant} steady"] = rate(args.entries, res[variant]["steady_seconds"])
        for name, value in figures.items():
            series.setdefault(name, []).append(value)
        print(f"run {run}: " + ", ".join(f"{name} {value:,.0f}/s" for name, value in figures.items()))
    med = {name: statistics.median(values) for name, values in series.items()}
    print()
    print(f"Entries/s, median of {args.runs} runs (load after: {os.getloadavg()})")
    labels = {
        "off": "API, no SDK (tracing off)",
        "baseline": "baseline checkout",
        "sdk": "SDK, spans dropped",
    }
    for variant in args.variants:
        line(labels[variant], f"{med[variant]:,.0f}", f"steady {med[f'{variant} steady']:,.0f}")
    line("strong redis-py loop", f"{med['strong']:,.0f}")
    line("ratio off / strong loop", f"{med['off'] / med['strong']:.3f}")
    if "baseline" in args.variants:
        line("ratio off / baseline", f"{med['off'] / med['baseline']:.3f}", "whole call")
        line("  steady", f"{med['off steady'] / med['baseline steady']:.3f}")
    if "sdk" in args.variants:
        line("ratio sdk / off", f"{med['sdk'] / med['off']:.3f}", "whole call")
        line("  steady", f"{med['sdk steady'] / med['off steady']:.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200_000, help="entries per run (200000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; medians are reported (5)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--baseline", metavar="DIR", help="also run the worker of the checkout in DIR")
    parser.add_argument("--no-sdk", action="store_true", help="skip the variant with the SDK")
    # The child process that runs one worker (internal).
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    parser.add_argument("--app", help=argparse.SUPPRESS)
    parser.add_argument("--state-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # What throughput.py's child reads besides these.
    args.store, args.durability, args.state_backup, args.profile = "sqlite", "normal", "on", None
    args.variants = [
        v for v in VARIANTS if (v != "baseline" or args.baseline) and (v != "sdk" or not args.no_sdk)
    ]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.throughput import own_redis_server
    from pspf.settings import mask_url

    if args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
        return
    with own_redis_server() as (url, where):
        benchmark(args, url, where)


if __name__ == "__main__":
    main()
