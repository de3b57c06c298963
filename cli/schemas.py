"""``pspf topic schema``: set, show and list the versions of a topic's schema (``pspf.service.schemas``)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import click

from pspf.cli.commands import topic
from pspf.cli.main import CliState, broker_option, service_for
from pspf.cli.render import json_option, json_text, print_json, print_table
from pspf.contracts.registry import COMPAT_MODES, SchemaVersion
from pspf.contracts.schema import schema_of_type
from pspf.errors import ConfigError


@topic.group("schema")
def schema() -> None:
    """A topic's schema: every door that writes the topic checks values against it."""


@schema.command(
    "set",
    epilog="\b\nExamples:\n  pspf topic schema set orders --type shop.models:Order\n"
    "  pspf topic schema set orders --file order.schema.json --compat full",
)
@click.argument("name")
@click.option("--type", "type_spec", help="MODULE:TYPE, a msgspec Struct (or a pydantic model).")
@click.option("--file", "path", type=click.Path(dir_okay=False, path_type=Path), help="A JSON Schema file.")
@click.option(
    "--compat",
    type=click.Choice(COMPAT_MODES),
    default="backward",
    show_default=True,
    help="What the new version must keep of the current one.",
)
@broker_option
@json_option
@click.pass_obj
def schema_set(
    obj: CliState,
    name: str,
    type_spec: str | None,
    path: Path | None,
    compat: str,
    broker: str | None,
    as_json: bool,
) -> None:
    """Set NAME's schema: its next version, once compatible with the current one (JSON Schema 2020-12)."""
    if (type_spec is None) == (path is None):
        raise ConfigError("give the schema with --type MODULE:TYPE or --file SCHEMA.json (one of them)")
    document = schema_of_type(type_spec) if type_spec is not None else _read(path)
    version = service_for(obj, broker).schemas.set_schema(name, document, compat)
    if as_json:
        print_json(version)
    else:
        click.echo(f"topic {name} schema v{version.version} set ({version.compat})")


def _read(path: Path | None) -> Any:
    assert path is not None
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--file {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--file {path}: not JSON: {exc}") from None


@schema.command("show")
@click.argument("name")
@click.option("--version", type=click.IntRange(min=1), help="This version  [default: the current one]")
@broker_option
@json_option
@click.pass_obj
def schema_show(obj: CliState, name: str, version: int | None, broker: str | None, as_json: bool) -> None:
    """Show NAME's current schema, or one version of it."""
    found = service_for(obj, broker).schemas.show(name, version)
    if as_json:
        print_json(found)
        return
    click.echo(f"# topic {found.topic} schema v{found.version} ({found.compat}, set {_when(found)})")
    click.echo(json_text(found.schema))


@schema.command("history")
@click.argument("name")
@broker_option
@json_option
@click.pass_obj
def schema_history(obj: CliState, name: str, broker: str | None, as_json: bool) -> None:
    """List the versions of NAME's schema, the first first."""
    versions = service_for(obj, broker).schemas.history(name)
    if as_json:
        print_json(versions)
        return
    rows = [[v.version, v.compat, _when(v), ", ".join(sorted(_fields(v.schema)))] for v in versions]
    print_table(["VERSION", "COMPAT", "SET", "FIELDS"], rows)


def _when(version: SchemaVersion) -> str:
    return datetime.datetime.fromtimestamp(version.set_at_ms / 1000, datetime.UTC).isoformat(
        timespec="seconds"
    )


def _fields(document: dict[str, Any]) -> list[str]:
    """The top-level properties of a schema (through a root $ref, as msgspec writes them)."""
    ref = document.get("$ref", "")
    node = document.get("$defs", {}).get(ref[8:], {}) if ref.startswith("#/$defs/") else document
    return list(node.get("properties", {}))
