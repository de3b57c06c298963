"""Tracing benchmark: the worker with the OpenTelemetry API and no SDK (tracing off), with the SDK
(a span per entry and per commit), and optionally another checkout's worker, in the same run.

Usage::

    python benchmarks/tracing.py                          # 200,000 entries, 1,000 keys, 5 runs
    python benchmarks/tracing.py --entries 100000 --runs 3
    python benchmarks/tracing.py --baseline ../pspf-main  # also a checkout without tracing
    python benchmarks/tracing.py --runs 0 --baseline ../pspf-main  # the hot path alone

Each run pre-loads the same entries into one partition of a fresh topic per variant (and a plain
stream), then runs, in this order, each variant's worker in a child process of its own
(``benchmarks/throughput.py``'s ``pspf_child``: the typed order-totals app,
``Worker.run(until_idle=True)``, SQLite, state backup on) and the strong redis-py loop of
``benchmarks/throughput.py`` over the plain stream:

- ``off``: this checkout, the API installed, no SDK: ``pspf.observability.tracing.configured`` finds the
  API's proxy provider and the cycle does no tracing work;
- ``baseline`` (with ``--baseline DIR``): the checkout in DIR (e.g. a worktree of the main
  branch, without tracing) runs the same child, so "off costs nothing" is measured, not assumed;
- ``sdk``: this checkout with an SDK ``TracerProvider`` set globally before the worker is built,
  its spans going through a ``BatchSpanProcessor`` to an exporter that drops them: the cost of
  tracing when it is on, short of the network.

Then the hot path alone, with less noise than a whole run: each variant's ``Attempts.run`` (the
handler loop of the cycle: context, decode, handler, state encoding) over a tenth of the entries
in reads of 1,000 on a memory store, the least CPU time of 5 passes, in a child per variant and
round (``--hot-path-rounds``, ``--runs 0`` for this part alone).

The variants take turns at going first. The report gives medians over the runs of the whole
``run()`` call's rate and of the steady part (from the first cycle to the last that read
entries), and the medians of the ratios taken within each run. Every run checks the state
the worker left, and the ``sdk`` child checks that it made one span per entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("off", "baseline", "sdk")
LABELS = {"off": "API, no SDK (tracing off)", "baseline": "baseline checkout", "sdk": "SDK, spans dropped"}
#: the ratios reported: name -> (numerator, denominator), each a variant's rate
RATIOS = {
    "off / strong loop": ("off", "strong"),
    "off / baseline": ("off", "baseline"),
    "off / baseline, steady": ("off steady", "baseline steady"),
    "sdk / off": ("sdk", "off"),
    "sdk / off, steady": ("sdk steady", "off steady"),
}


def sdk_exporter() -> Any:
    """A global SDK provider whose spans go through a batch processor to nowhere; its exporter."""
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
    return exporter


def child(args: argparse.Namespace) -> None:
    """One worker run in this process, of the checkout ``--code`` names (this one by default)."""
    sys.path.insert(0, args.code or str(ROOT))
    from benchmarks.throughput import pspf_child

    exporter = sdk_exporter() if args.variant == "sdk" else None
    pspf_child(args)
    if exporter is not None:
        from opentelemetry import trace

        trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]
        print(json.dumps({"entry_spans": exporter.spans}))


def hot_path_child(args: argparse.Namespace) -> None:
    """The handler loop alone: ``Attempts.run`` over reads of 1,000 entries on a memory store.

    Prints the least CPU time of ``--reps`` passes over the entries: no server, no store
    commit, so what tracing adds per entry stands out of the noise a whole worker run has.
    """
    sys.path.insert(0, args.code or str(ROOT))
    if args.variant == "sdk":
        sdk_exporter()
    from benchmarks.throughput import make_orders, order_totals_app
    from pspf import Settings, keys
    from pspf.cycle.attempts import Attempts
    from pspf.failures import policy_from
    from pspf.outbox.emit import Emitter
    from pspf.outbox.partition_outbox import PartitionOutbox
    from pspf.partition.batch import PartitionBatch
    from pspf.partition.owned import OwnedPartition, Read, StreamCursor
    from pspf.state_stores.memory import MemoryStore

    try:
        from pspf.observability.tracing import configured

        traced = (configured("bench"),)
    except ImportError:  # a checkout without tracing
        traced = ()
    app = order_totals_app("bench", "orders", typed=True)
    run_policy = policy_from(Settings.load({}, environ={}).retry)
    policies = {topic: h.retry.over(run_policy) for topic, h in app.handlers.items()}
    emitter = Emitter(_OnePartition(), app.name)
    attempts = Attempts(app, "bench", emitter, policies, *traced)
    entries = [
        (f"{i + 1}-0".encode(), {b"key": k.encode(), b"value": v})
        for i, (k, v) in enumerate(make_orders(args.entries, args.keys))
    ]
    store = MemoryStore()
    names = (keys.stream_key("orders", 0), keys.dlq_key("orders", 0), keys.lease_key("orders", 0, "bench"))
    cursor = StreamCursor("orders", 0, *names, "bench", None)
    owned = OwnedPartition(0, store, {"orders": cursor}, PartitionOutbox(store, app.name, 0, "bench"))
    times = []
    for _ in range(args.reps):
        batch = PartitionBatch(owned, app.state_decoder, emitter, None)
        started = time.process_time()
        for start in range(0, len(entries), 1000):
            read = entries[start : start + 1000]
            attempts.run(batch, Read(cursor, read, {}), read)
        times.append(time.process_time() - started)
    print(json.dumps({"seconds": min(times)}))


class _OnePartition:
    def topic_partitions(self, topic: str) -> int:
        return 1


def hot_path(args: argparse.Namespace) -> None:
    """Each variant's hot path in a child of its own, in turns, ``--hot-path-rounds`` times."""
    from benchmarks.throughput import line, rate

    entries = args.entries // 10
    series: dict[str, list[float]] = {}
    for round_ in range(args.hot_path_rounds):
        order = args.variants[round_ % len(args.variants) :] + args.variants[: round_ % len(args.variants)]
        for variant in order:
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                *(
                    "--hot-path-child",
                    "--variant",
                    variant,
                    "--entries",
                    str(entries),
                    "--keys",
                    str(args.keys),
                ),
            ]
            if variant == "baseline":
                command += ["--code", str(Path(args.baseline).resolve())]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            series.setdefault(variant, []).append(rate(entries, json.loads(done.stdout)["seconds"]))
    med = {name: statistics.median(values) for name, values in series.items()}
    print()
    print(
        f"Hot path alone (Attempts.run, {entries:,} entries, memory store, CPU time), entries/s, "
        f"median of {args.hot_path_rounds} rounds"
    )
    for variant in args.variants:
        line(LABELS[variant], f"{med[variant]:,.0f}")
    if "baseline" in med:
        line("ratio off / baseline", f"{med['off'] / med['baseline']:.3f}")
    if "sdk" in med:
        line("ratio sdk / off", f"{med['sdk'] / med['off']:.3f}")


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


def one_run(
    url: str, orders: list[tuple[str, bytes]], args: argparse.Namespace, order: list[str]
) -> dict[str, dict[str, Any]]:
    """Each variant in ``order`` on a fresh topic and app, then the strong loop on a plain copy."""
    from benchmarks.throughput import check, cleanup, expected_totals, preload, run_strong

    tag = uuid.uuid4().hex[:8]
    copy = f"bench:plain:{tag}"
    expected = expected_totals(orders)
    results: dict[str, dict[str, Any]] = {}
    try:
        for index, variant in enumerate(order):
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
        # The variants take turns at going first: a run's later children meet a warmer server.
        order = args.variants[run % len(args.variants) :] + args.variants[: run % len(args.variants)]
        res = one_run(url, orders, args, order)
        figures = {"strong": rate(args.entries, res["strong"]["seconds"])}
        for variant in args.variants:
            figures[variant] = rate(args.entries, res[variant]["seconds"])
            figures[f"{variant} steady"] = rate(args.entries, res[variant]["steady_seconds"])
        for name, value in figures.items():
            series.setdefault(name, []).append(value)
        print(f"run {run}: " + ", ".join(f"{name} {value:,.0f}/s" for name, value in figures.items()))
        # Ratios are taken within a run (the same load on the machine), then their median.
        for name, (a, b) in RATIOS.items():
            if a in figures and b in figures:
                series.setdefault(name, []).append(figures[a] / figures[b])
    med = {name: statistics.median(values) for name, values in series.items()}
    print()
    print(f"Entries/s, median of {args.runs} runs (load after: {os.getloadavg()})")
    for variant in args.variants:
        line(LABELS[variant], f"{med[variant]:,.0f}", f"steady {med[f'{variant} steady']:,.0f}")
    line("strong redis-py loop", f"{med['strong']:,.0f}")
    print(f"Ratios within each run, median of {args.runs} runs")
    for name in RATIOS:
        if name in med:
            values = ", ".join(f"{value:.3f}" for value in series[name])
            line(name, f"{med[name]:.3f}", f"runs: {values}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200_000, help="entries per run (200000)")
    parser.add_argument("--keys", type=int, default=1_000, help="distinct keys (1000)")
    parser.add_argument("--runs", type=int, default=5, help="runs; medians are reported (5)")
    parser.add_argument("--broker", help="use this Redis URL instead of starting a server")
    parser.add_argument("--batch-size", type=int, default=1_000, help="PSPF_BATCH_SIZE (1000)")
    parser.add_argument("--baseline", metavar="DIR", help="also run the worker of the checkout in DIR")
    parser.add_argument("--no-sdk", action="store_true", help="skip the variant with the SDK")
    parser.add_argument(
        "--hot-path-rounds", type=int, default=7, help="rounds of the hot path alone; 0 skips it (7)"
    )
    # The child process that runs one worker (internal).
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hot-path-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
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
    if args.hot_path_child:
        hot_path_child(args)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.throughput import own_redis_server
    from pspf.settings import mask_url

    if not args.runs:
        pass
    elif args.broker:
        benchmark(args, args.broker, mask_url(args.broker))
    else:
        with own_redis_server() as (url, where):
            benchmark(args, url, where)
    if args.hot_path_rounds:
        hot_path(args)


if __name__ == "__main__":
    main()
