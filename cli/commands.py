"""``pspf topic``, ``produce``, ``state`` and ``dlq``: thin calls into ``pspf.service``.

Each command calls the service and prints its result through ``pspf.cli.render`` (tables, fields,
``--json``), so only the sentences a single command says are written here, beside it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import click

from pspf.cli.main import (
    CliState,
    broker_option,
    cli,
    confirm,
    parse_headers,
    service_for,
    state_dir_option,
    store_option,
)
from pspf.cli.render import first_line, json_option, json_text, print_fields, print_json, print_table
from pspf.service import TopicEntry, parse_duration_ms, parse_read_start
from pspf.service.wording import counted
from pspf.worker.retention import Retention

# -- topics ---------------------------------------------------------------------------------------


@cli.group()
def topic() -> None:
    """Create, list, describe, read and trim topics."""


@topic.command("create")
@click.argument("name")
@click.option("--partitions", "-p", type=int, default=1, show_default=True, help="Partition count (fixed).")
@broker_option
@json_option
@click.pass_obj
def topic_create(obj: CliState, name: str, partitions: int, broker: str | None, as_json: bool) -> None:
    """Create topic NAME (succeeds if it exists with the same partition count)."""
    service = service_for(obj, broker)
    info, created = service.topics.create_topic(name, partitions)
    if as_json:
        print_json(info)
    else:
        verb = "created" if created else "already exists"
        click.echo(f"topic {info.name} {verb} with {counted(info.partitions, 'partition')}")


@topic.command("list")
@broker_option
@json_option
@click.pass_obj
def topic_list(obj: CliState, broker: str | None, as_json: bool) -> None:
    """List topics."""
    topics = service_for(obj, broker).topics.list_topics()
    if as_json:
        print_json(topics)
    else:
        print_table(["TOPIC", "PARTITIONS"], [[t.name, t.partitions] for t in topics])


@topic.command("describe")
@click.argument("name")
@broker_option
@json_option
@click.pass_obj
def topic_describe(obj: CliState, name: str, broker: str | None, as_json: bool) -> None:
    """Show each partition of NAME: its stream key, length, last id and consumer groups."""
    description = service_for(obj, broker).topics.describe_topic(name)
    if as_json:
        print_json(description)
        return
    partitions = counted(len(description.partitions), "partition")
    click.echo(f"topic {description.name}: {partitions}, {counted(description.length, 'entry')}")
    rows = []
    for p, trim in zip(description.partitions, description.trims, strict=True):
        groups = ", ".join(f"{g.name} (pending {g.pending})" for g in p.groups) or None
        frees = f"{trim.removable} (held by {trim.held_by})" if description.retention.active else None
        rows.append([p.partition, p.stream, p.length, trim.memory_bytes, p.last_id, groups, frees])
    click.echo(f"retention: {_retention_text(description.retention)}")
    print_table(["PARTITION", "STREAM", "LENGTH", "BYTES", "LAST ID", "GROUPS", "RETENTION FREES"], rows)


def _retention_text(retention: Retention) -> str:
    if not retention.active:
        return "none (never trimmed)"
    parts = []
    if retention.max_age_ms is not None:
        parts.append(f"max age {retention.max_age_ms} ms")
    if retention.max_len is not None:
        parts.append(f"max length {retention.max_len}")
    if retention.replay_window_ms:
        parts.append(f"replay window {retention.replay_window_ms} ms")
    return ", ".join(parts)


def _retention_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "--max-len", type=click.IntRange(min=0), help="Keep at most this many entries per partition."
    )(func)
    return click.option("--max-age", help="Remove entries older than this (e.g. 7d, 12h, 30m).")(func)


def _retention(max_age: str | None, max_len: int | None, replay_window: str | None = None) -> Retention:
    return Retention(
        max_age_ms=None if max_age is None else parse_duration_ms(max_age, "max_age"),
        max_len=max_len,
        replay_window_ms=0 if replay_window is None else parse_duration_ms(replay_window, "replay_window"),
    )


@topic.command("retention")
@click.argument("name")
@_retention_options
@click.option("--replay-window", help="Keep entries younger than this whatever else says (e.g. 1d).")
@click.option("--clear", is_flag=True, help="Remove the retention: the topic is never trimmed.")
@broker_option
@json_option
@click.pass_obj
def topic_retention(
    obj: CliState,
    name: str,
    max_age: str | None,
    max_len: int | None,
    replay_window: str | None,
    clear: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Show or set the retention of NAME, which running workers apply to the partitions they own.

    Trimming never removes an entry some consumer group of the topic has not acknowledged (or
    that one of the apps reading it still needs), nor one inside the replay window.
    """
    service = service_for(obj, broker)
    if clear or max_age is not None or max_len is not None or replay_window is not None:
        shown = service.topics.set_retention(
            name, Retention() if clear else _retention(max_age, max_len, replay_window)
        )
    else:
        shown = service.topics.describe_topic(name).retention
    if as_json:
        print_json(shown)
    else:
        click.echo(f"topic {name} retention: {_retention_text(shown)}")


@topic.command("trim")
@click.argument("name")
@_retention_options
@click.option("--dry-run", is_flag=True, help="Show what would go; remove nothing.")
@broker_option
@json_option
@click.pass_obj
def topic_trim(
    obj: CliState,
    name: str,
    max_age: str | None,
    max_len: int | None,
    dry_run: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Trim NAME now by its retention (or by --max-age / --max-len for this once).

    Only entries every consumer group of the topic has acknowledged go.
    """
    override = None if max_age is None and max_len is None else _retention(max_age, max_len)
    done = service_for(obj, broker).topics.trim_topic(name, dry_run=dry_run, override=override)
    if as_json:
        print_json(done)
        return
    rows = [[p.partition, p.length, p.trim_before or None, p.removable, p.held_by] for p in done.partitions]
    print_table(["PARTITION", "LENGTH", "TRIM BEFORE", "WOULD GO" if dry_run else "GOES", "HELD BY"], rows)
    if dry_run:
        click.echo(f"dry run: {counted(sum(p.removable for p in done.partitions), 'entry')} would go")
    else:
        click.echo(f"trimmed {counted(done.removed, 'entry')} from topic {name}")


@topic.command("delete", epilog="\b\nExample:\n  pspf topic delete old-orders --dry-run")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def topic_delete(
    obj: CliState, name: str, dry_run: bool, yes: bool, broker: str | None, as_json: bool
) -> None:
    """Delete topic NAME: its entries, DLQs and records. Refused while an app reads it."""
    service = service_for(obj, broker)
    preview = service.retire.delete_topic(name, dry_run=True)
    if not dry_run and not yes:
        confirm(f"Delete topic {name} and every entry of its {counted(preview.partitions, 'partition')}?")
    done = preview if dry_run else service.retire.delete_topic(name)
    if as_json:
        print_json(done)
        return
    click.echo(f"{'would remove' if dry_run else 'removed'} topic {name}: {', '.join(done.keys)}")


@topic.command(
    "read",
    epilog="\b\nExamples:\n  pspf topic read out --count 5\n"
    "  pspf topic read orders --partition 2 --from 2026-11-27T10:00:00Z --json\n"
    "  pspf topic read out --follow",
)
@click.argument("name")
@click.option("--partition", "-p", type=click.IntRange(min=0), help="Only this partition (default: all).")
@click.option("--from", "start", help="Start at this entry id (1700000000000-0) or time (RFC 3339, unix ms).")
@click.option(
    "--count", "-n", type=click.IntRange(min=1), default=10, show_default=True, help="Entries to print."
)
@click.option("--follow", "-f", is_flag=True, help="Then print new entries as they arrive, until Ctrl-C.")
@broker_option
@json_option
@click.pass_obj
def topic_read(
    obj: CliState,
    name: str,
    partition: int | None,
    start: str | None,
    count: int,
    follow: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Print entries of NAME without a consumer group, in id order across partitions.

    Without --from, the last --count entries. Values are decoded (JSON, msgpack); a value that is
    not JSON is printed as its text. --json prints one object per line (JSON Lines).
    """
    service = service_for(obj, broker)
    begin = None if start is None else parse_read_start(start)
    try:
        entries, positions = service.reading.read_topic(name, partition, begin, count)
        for entry in entries:
            _print_entry(entry, as_json)
        if follow:
            for entry in service.reading.follow_topic(name, positions, service.settings.consumer.block_ms):
                _print_entry(entry, as_json)
    except KeyboardInterrupt:
        return  # Ctrl-C is how --follow ends


def _print_entry(entry: TopicEntry, as_json: bool) -> None:
    """One line: JSON Lines for scripts, or id, partition, key, value and headers for people."""
    if as_json:
        print_json(entry)
        return
    value = entry.value if entry.encoding in ("text", "bytes") else json_text(entry.value)
    if not value.isprintable():  # text with a line break stays on its line, quoted
        value = json_text(value)
    line = f"{entry.id}  p{entry.partition}  {entry.key if entry.key is not None else '-'}  {value}"
    if entry.headers:
        line += f"  headers {json_text(entry.headers)}"
    click.echo(line)


# -- produce --------------------------------------------------------------------------------------


@cli.command(
    epilog="\b\nExamples:\n  pspf produce orders --key u1 '{\"amount\": 3}'\n"
    "  pspf produce orders --key-field user < orders.ndjson"
)
@click.argument("topic")
@click.argument("value", required=False)
@click.option("--key", help="Key of the single VALUE.")
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="NAME=VALUE",
    help="A header of the single VALUE (repeatable), e.g. a W3C traceparent.",
)
@click.option("--key-field", help="Field of each NDJSON record to use as its key.")
@click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Read NDJSON from this file instead of stdin.",
)
@broker_option
@click.pass_obj
def produce(
    obj: CliState,
    topic: str,
    value: str | None,
    key: str | None,
    headers: tuple[str, ...],
    key_field: str | None,
    path: Path | None,
    broker: str | None,
) -> None:
    """Write VALUE (JSON) to TOPIC, or NDJSON lines from stdin or --file."""
    service = service_for(obj, broker)
    if value is not None:
        if path is not None or key_field is not None:
            raise click.UsageError("give either VALUE (with --key) or NDJSON input (--file, --key-field)")
        # A VALUE that is not UTF-8 reaches the JSON check as the bytes it was, and fails there.
        service.topics.produce(topic, value.encode(errors="surrogateescape"), key, parse_headers(headers))
        click.echo("1 entry written", err=True)
        return
    if key is not None or headers:
        raise click.UsageError("--key and --header go with a single VALUE; use --key-field for NDJSON input")
    if path is None and sys.stdin.isatty():
        raise click.UsageError("no VALUE given and stdin is a terminal: pipe NDJSON in or use --file")
    if path is None:
        count = service.topics.produce_lines(topic, sys.stdin.buffer, key_field)
    else:
        size = path.stat().st_size
        with (
            path.open("rb") as lines,
            click.progressbar(
                length=size, label="producing", file=sys.stderr, hidden=size < _PROGRESS_FROM_BYTES
            ) as bar,
        ):
            count = service.topics.produce_lines(topic, _counted(lines, bar.update), key_field)
    click.echo(f"{counted(count, 'entry')} written", err=True)


_PROGRESS_FROM_BYTES = 10_000_000


def _counted(lines: Iterable[bytes], progress: Callable[[int], None]) -> Iterator[bytes]:
    """The lines, reporting the bytes read every 1,000 lines."""
    read = 0
    for number, line in enumerate(lines, start=1):
        read += len(line)
        if number % 1000 == 0:
            progress(read)
            read = 0
        yield line
    progress(read)


# -- state ----------------------------------------------------------------------------------------


@cli.group()
def state() -> None:
    """Read an app's state (without opening its files yourself)."""


@state.command("get")
@click.argument("app")
@click.argument("key")
@click.option("--window", is_flag=True, help="Show KEY's open windows (of @app.window) instead.")
@click.option("--table", help="Show KEY's row in this table (or global table) of APP instead.")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def state_get(
    obj: CliState,
    app: str,
    key: str,
    window: bool,
    table: str | None,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """Print the state of KEY in APP (with --window, its open windows; with --table, its row).

    A table's row comes from the state backup in Redis, as state does; a global table's from the
    store of a worker under --state-dir (each worker holds it whole, in no backup).
    """
    if window and table is not None:
        raise click.UsageError("give --window or --table, not both")
    service = service_for(obj, broker, state_dir, store)
    if table is not None:
        _print_value(service.tables.table_row(app, table, key), as_json)
        return
    if window:
        windows = service.state.state_windows(app, key)
        if as_json:
            print_json(windows)
            return
        for w in windows:
            name = f"{w.window} ({w.topic})" if w.window else f"({w.topic})"
            click.echo(f"{name} [{w.start}, {w.end}]: {json_text(w.value)}")
        return
    _print_value(service.state.state_get(app, key), as_json)


def _print_value(value: Any, as_json: bool) -> None:
    """A key's state or row: JSON, or a mapping's fields one a line (another value on one)."""
    if as_json:
        print_json(value)
    elif isinstance(value, dict):
        for name, item in value.items():
            click.echo(f"{name}: {json_text(item)}")
    else:
        click.echo(json_text(value))


@state.command("list")
@click.argument("app")
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many keys.")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def state_list(
    obj: CliState,
    app: str,
    prefix: str,
    limit: int | None,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """List the keys that have state in APP."""
    found = service_for(obj, broker, state_dir, store).state.state_keys(app, prefix, limit)
    if as_json:
        print_json(found)
    else:
        for key in found:
            click.echo(key)


# -- DLQ ------------------------------------------------------------------------------------------


@cli.group()
def dlq() -> None:
    """Inspect, redrive and purge dead-lettered entries."""


@dlq.command("list")
@click.argument("topic")
@click.option("--app", help="Only entries this app dead-lettered.")
@click.option("--error-type", help="Only entries that failed with this error type, e.g. DecodeError.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many entries.")
@broker_option
@json_option
@click.pass_obj
def dlq_list(
    obj: CliState,
    topic: str,
    app: str | None,
    error_type: str | None,
    limit: int | None,
    broker: str | None,
    as_json: bool,
) -> None:
    """List the DLQ entries of TOPIC."""
    found = service_for(obj, broker).dlq.dlq_list(topic, app, error_type, limit)
    if as_json:
        print_json(found)
        return
    rows = [
        [d.dlq_id, d.source_id, d.key, d.app, d.error_type, first_line(d.message), d.attempts, d.failed_at]
        for d in found
    ]
    print_table(["DLQ ID", "SOURCE ID", "KEY", "APP", "ERROR", "MESSAGE", "ATTEMPTS", "FAILED AT"], rows)


@dlq.command("show")
@click.argument("topic")
@click.argument("dlq_id")
@broker_option
@json_option
@click.pass_obj
def dlq_show(obj: CliState, topic: str, dlq_id: str, broker: str | None, as_json: bool) -> None:
    """Show one DLQ entry of TOPIC whole (DLQ_ID as `pspf dlq list` prints it)."""
    detail = service_for(obj, broker).dlq.dlq_show(topic, dlq_id)
    if as_json:
        print_json(detail)
        return
    print_fields(detail, skip=("traceback",))
    click.echo("traceback:\n" + detail.traceback)


_PROGRESS_FROM = 100


def _confirm(what: str, count: int, yes: bool) -> None:
    if not yes:
        confirm(f"{what} {counted(count, 'DLQ entry', 'DLQ entries')}?")


@dlq.command(
    "redrive",
    epilog="\b\nExamples:\n  pspf dlq redrive orders 0:1700000000000-0\n"
    "  pspf dlq redrive orders --error-type DecodeError --dry-run\n  pspf dlq redrive orders --all --yes",
)
@click.argument("topic")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_entries", is_flag=True, help="Every DLQ entry of the topic.")
@click.option("--error-type", help="Entries that failed with this error type.")
@click.option("--app", help="Entries this app dead-lettered.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many entries.")
@click.option("--dry-run", is_flag=True, help="Say what would move; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def dlq_redrive(
    obj: CliState,
    topic: str,
    ids: tuple[str, ...],
    all_entries: bool,
    error_type: str | None,
    app: str | None,
    limit: int | None,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Put DLQ entries of TOPIC back into their partitions, each exactly once."""
    service = service_for(obj, broker)
    if not dry_run:
        preview = service.dlq.dlq_redrive(topic, ids, all_entries, error_type, app, limit, dry_run=True)
        _confirm("Redrive", preview.selected, yes)
        shown = preview.selected >= _PROGRESS_FROM
        with click.progressbar(
            length=preview.selected, label="redriving", file=sys.stderr, hidden=not shown
        ) as bar:
            change = service.dlq.dlq_redrive(
                topic, ids, all_entries, error_type, app, limit, progress=bar.update
            )
    else:
        change = service.dlq.dlq_redrive(topic, ids, all_entries, error_type, app, limit, dry_run=True)
    if as_json:
        print_json(change)
    elif dry_run:
        click.echo(f"would redrive {counted(change.selected, 'entry')} (dry run, nothing changed)")
    else:
        click.echo(f"redrove {change.changed} of {counted(change.selected, 'selected entry')}")


@dlq.command("purge")
@click.argument("topic")
@click.argument("ids", nargs=-1)
@click.option("--all", "all_entries", is_flag=True, help="Every DLQ entry of the topic.")
@click.option("--older-than", help="Entries that failed longer ago than this, e.g. 7d, 12h, 30m.")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def dlq_purge(
    obj: CliState,
    topic: str,
    ids: tuple[str, ...],
    all_entries: bool,
    older_than: str | None,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Delete DLQ entries of TOPIC for good."""
    service = service_for(obj, broker)
    older_than_ms = None if older_than is None else parse_duration_ms(older_than, "older_than")
    preview = service.dlq.dlq_purge(topic, ids, all_entries, older_than_ms, dry_run=True)
    if not dry_run:
        _confirm("Delete", preview.selected, yes)
        change = service.dlq.dlq_purge(topic, ids, all_entries, older_than_ms)
    else:
        change = preview
    if as_json:
        print_json(change)
    elif dry_run:
        click.echo(f"would delete {counted(change.selected, 'entry')} (dry run, nothing changed)")
    else:
        click.echo(f"deleted {counted(change.changed, 'entry')}")
