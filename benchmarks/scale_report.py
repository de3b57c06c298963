"""How ``benchmarks/scale.py`` shows its points: a table per curve, a PNG per curve, a JSON file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MB = 1024 * 1024
#: Each curve's x: its name in the tables and on the plot's axis.
X_NAMES = {
    "partitions": "partitions",
    "keys": "state keys",
    "value-size": "value bytes",
    "apps": "apps",
    "global-rows": "global table rows",
    "memory": "state keys",
}
#: Extra columns each curve shows: (key in Point.extra, heading, format).
EXTRA_COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "partitions": [
        ("startup_s", "startup s", "{:.2f}"),
        ("tail_s", "tail s", "{:.2f}"),
        ("with_entries", "fed", "{:.0f}"),
    ],
    "keys": [
        ("disk_mb", "disk MB", "{:.1f}"),
        ("stream_b_per_entry", "stream B/entry", "{:.0f}"),
        ("backup_b_per_key", "backup B/key", "{:.0f}"),
    ],
    "value-size": [("mb_per_s", "steady MB/s", "{:.1f}")],
    "apps": [("rss_sum_mb", "RSS sum MB", "{:.0f}")],
    "global-rows": [("bootstrap_s", "bootstrap s", "{:.2f}")],
    "memory": [("stream_b_per_entry", "stream B/entry", "{:.0f}"), ("overhead", "backup/state", "{:.2f}")],
}


@dataclass
class Point:
    """One run of a curve: what it handled, how fast, and what memory it took."""

    curve: str
    series: str
    x: int
    #: entries handled over all apps (for global-rows: the rows bootstrapped)
    entries: int
    #: entries (rows) per second over the whole Worker.run call(s), and from the first cycle to the
    #: last cycle that read entries (None where not measured)
    rate: float
    steady_rate: float | None
    worker_rss_mb: float
    #: Redis ``used_memory`` after the run, and its growth since before the entries were written
    redis_mb: float
    redis_delta_mb: float
    worker_cpu_per_m: float
    server_cpu_per_m: float
    extra: dict[str, float] = field(default_factory=dict)
    #: Redis keys the point left, by kind: [keys, bytes] (``scale_runs.redis_memory``)
    memory: dict[str, list[int]] = field(default_factory=dict)


def print_table(curve: str, points: list[Point]) -> None:
    """The curve's points, one line each."""
    extras = EXTRA_COLUMNS.get(curve, [])
    head = f"  {X_NAMES[curve]:>17}  {'series':<10} {'entries':>9} {'whole/s':>9} {'steady/s':>9} "
    head += f"{'RSS MB':>7} {'Redis MB':>9} {'+Redis MB':>9} {'CPU s/M':>8} {'srv s/M':>8}"
    head += "".join(f" {title:>{max(len(title), 8)}}" for _, title, _ in extras)
    print(head)
    for p in points:
        steady = f"{p.steady_rate:,.0f}" if p.steady_rate is not None else "-"
        row = f"  {p.x:>17,}  {p.series:<10} {p.entries:>9,} {p.rate:>9,.0f} {steady:>9} "
        row += f"{p.worker_rss_mb:>7.1f} {p.redis_mb:>9.1f} {p.redis_delta_mb:>9.1f} "
        row += f"{p.worker_cpu_per_m:>8.2f} {p.server_cpu_per_m:>8.2f}"
        for name, title, fmt in extras:
            value = fmt.format(p.extra[name]) if name in p.extra else "-"
            row += f" {value:>{max(len(title), 8)}}"
        print(row)


def print_memory(point: Point) -> None:
    """Where Redis's bytes go at one key count: per kind of key, per entry and per state key."""
    e = point.extra
    print(f"  Redis keys after the run, by kind ({point.x:,} state keys, {point.entries:,} entries):")
    for kind, (count, size) in point.memory.items():
        print(f"    {kind:<40} {count:>6,} keys {size / MB:>10.2f} MB")
    print(
        f"  stream: {e['stream_b_per_entry']:.1f} bytes per entry "
        f"(values {e['mean_value_bytes']:.0f} bytes on average)"
    )
    print(
        f"  state the store holds: {e['state_keys']:,.0f} state keys, {e['state_bytes'] / MB:.2f} MB "
        f"(len(key) + len(value)), {e['state_bytes'] / e['state_keys']:.1f} bytes per key; all namespaces: "
        f"{e['store_values']:,.0f} values, {e['store_bytes'] / MB:.2f} MB"
    )
    print(
        f"  backup (values hash + meta): {e['backup_bytes'] / MB:.2f} MB, {e['backup_b_per_key']:.1f} bytes "
        f"per state key; overhead = backup bytes / store bytes = {e['overhead']:.2f}"
    )
    print(
        f"  backup log (the last updates, for standbys and stores a few batches behind): "
        f"{e['backup_log_bytes'] / MB:.2f} MB; (backup + log) / store bytes = {e['overhead_with_log']:.2f}"
    )
    print(
        f"  bookkeeping (the log, fences, leases, app and topic records): "
        f"{e['bookkeeping_bytes'] / MB:.3f} MB; entries left pending in the group: none (checked)"
    )


def dump_json(path: str, header: dict[str, Any], points: list[Point]) -> None:
    Path(path).write_text(
        json.dumps({**header, "points": [dataclasses.asdict(p) for p in points]}, indent=1) + "\n"
    )


def plot(curve: str, points: list[Point], folder: str, title: str) -> Path:
    """``scale-<curve>.png``: entries/s on the left axis, RSS and Redis MB on the right; log x."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, left = plt.subplots(figsize=(8, 4.8))
    right = left.twinx()
    series = list(dict.fromkeys(p.series for p in points))
    for i, name in enumerate(series):
        mine = [p for p in points if p.series == name]
        xs = [p.x for p in mine]
        color = f"C{2 * i}"
        left.plot(xs, [p.rate for p in mine], "o-", color=color, label=f"{name}: whole/s")
        steady = [(p.x, p.steady_rate) for p in mine if p.steady_rate is not None]
        if steady:
            left.plot(*zip(*steady, strict=True), "o--", color=color, alpha=0.6, label=f"{name}: steady/s")
        right.plot(xs, [p.worker_rss_mb for p in mine], "s:", color=f"C{2 * i + 1}", label=f"{name}: RSS MB")
        right.plot(
            xs, [p.redis_delta_mb for p in mine], "^-.", color=f"C{2 * i + 1}", label=f"{name}: Redis +MB"
        )
    left.set_xscale("log")
    left.set_xticks(sorted({p.x for p in points}))
    left.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel(X_NAMES[curve])
    left.set_ylabel("rows/s (bootstrap)" if curve == "global-rows" else "entries/s")
    right.set_ylabel("MB")
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    handles = left.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    fig.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="lower center", ncol=4)
    left.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.03 + 0.04 * len(series), 1, 1))
    path = Path(folder) / f"scale-{curve}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(point: Point, folder: str, title: str) -> Path:
    """``scale-memory.png``: bytes per stream entry, per state key in the backup and in the store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = point.extra
    bars = {
        "stream\nper entry": e["stream_b_per_entry"],
        "backup\nper state key": e["backup_b_per_key"],
        "store (key + value)\nper state key": e["store_bytes"] / e["state_keys"],
    }
    fig, axis = plt.subplots(figsize=(7, 4.2))
    drawn = axis.bar(list(bars), list(bars.values()), color=["C0", "C1", "C2"])
    axis.bar_label(drawn, fmt="%.0f")
    axis.set_ylabel("bytes")
    axis.set_title(f"{title}\n{point.x:,} keys; backup / state = {e['overhead']:.2f}", fontsize=9)
    fig.tight_layout()
    path = Path(folder) / "scale-memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
