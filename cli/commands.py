"""``pspf topic``, ``pspf produce`` and ``pspf state``: thin calls into ``pspf.service``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import msgspec

from cli.main import CliState, broker_option, cli, json_option, service_for, state_dir_option


def _print_json(value: Any) -> None:
    click.echo(msgspec.json.encode(value).decode())


def _print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


# -- topics ---------------------------------------------------------------------------------------


@cli.group()
def topic() -> None:
    """Create, list and describe topics."""


@topic.command("create")
@click.argument("name")
@click.option("--partitions", "-p", type=int, default=1, show_default=True, help="Partition count (fixed).")
@broker_option
@json_option
@click.pass_obj
def topic_create(obj: CliState, name: str, partitions: int, broker: str | None, as_json: bool) -> None:
    """Create topic NAME (succeeds if it exists with the same partition count)."""
    service = service_for(obj, broker)
    info, created = service.create_topic(name, partitions)
    if as_json:
        _print_json(info)
    else:
        verb = "created" if created else "already exists:"
        click.echo(f"topic {info.name} {verb} {info.partitions} partition(s)")


@topic.command("list")
@broker_option
@json_option
@click.pass_obj
def topic_list(obj: CliState, broker: str | None, as_json: bool) -> None:
    """List topics."""
    topics = service_for(obj, broker).list_topics()
    if as_json:
        _print_json(topics)
    else:
        _print_table(["TOPIC", "PARTITIONS"], [[t.name, t.partitions] for t in topics])


@topic.command("describe")
@click.argument("name")
@broker_option
@json_option
@click.pass_obj
def topic_describe(obj: CliState, name: str, broker: str | None, as_json: bool) -> None:
    """Show each partition of NAME: its stream key, length, last id and consumer groups."""
    description = service_for(obj, broker).describe_topic(name)
    if as_json:
        _print_json(description)
        return
    click.echo(
        f"topic {description.name}: {len(description.partitions)} partition(s), {description.length} entries"
    )
    rows = []
    for p in description.partitions:
        groups = ", ".join(f"{g.name} (pending {g.pending})" for g in p.groups) or None
        rows.append([p.partition, p.stream, p.length, p.last_id, groups])
    _print_table(["PARTITION", "STREAM", "LENGTH", "LAST ID", "GROUPS"], rows)


# -- produce --------------------------------------------------------------------------------------


@cli.command(
    epilog="\b\nExamples:\n  pspf produce orders --key u1 '{\"amount\": 3}'\n"
    "  pspf produce orders --key-field user < orders.ndjson"
)
@click.argument("topic")
@click.argument("value", required=False)
@click.option("--key", help="Key of the single VALUE.")
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
    key_field: str | None,
    path: Path | None,
    broker: str | None,
) -> None:
    """Write VALUE (JSON) to TOPIC, or NDJSON lines from stdin or --file."""
    service = service_for(obj, broker)
    if value is not None:
        if path is not None or key_field is not None:
            raise click.UsageError("give either VALUE (with --key) or NDJSON input (--file, --key-field)")
        service.produce(topic, value.encode(), key)
        click.echo("1 entry written", err=True)
        return
    if key is not None:
        raise click.UsageError("--key goes with a single VALUE; use --key-field for NDJSON input")
    if path is None and sys.stdin.isatty():
        raise click.UsageError("no VALUE given and stdin is a terminal: pipe NDJSON in or use --file")
    if path is None:
        count = service.produce_lines(topic, sys.stdin.buffer, key_field)
    else:
        with path.open("rb") as lines:
            count = service.produce_lines(topic, lines, key_field)
    click.echo(f"{count} entries written", err=True)


# -- state ----------------------------------------------------------------------------------------


@cli.group()
def state() -> None:
    """Read an app's state (without opening its files yourself)."""


@state.command("get")
@click.argument("app")
@click.argument("key")
@broker_option
@state_dir_option
@json_option
@click.pass_obj
def state_get(
    obj: CliState, app: str, key: str, broker: str | None, state_dir: Path | None, as_json: bool
) -> None:
    """Print the state of KEY in APP."""
    value = service_for(obj, broker, state_dir).state_get(app, key)
    if as_json:
        _print_json(value)
    else:
        for name, item in value.items():
            click.echo(f"{name}: {msgspec.json.encode(item).decode()}")


@state.command("list")
@click.argument("app")
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many keys.")
@broker_option
@state_dir_option
@json_option
@click.pass_obj
def state_list(
    obj: CliState,
    app: str,
    prefix: str,
    limit: int | None,
    broker: str | None,
    state_dir: Path | None,
    as_json: bool,
) -> None:
    """List the keys that have state in APP."""
    found = service_for(obj, broker, state_dir).state_keys(app, prefix, limit)
    if as_json:
        _print_json(found)
    else:
        for key in found:
            click.echo(key)
