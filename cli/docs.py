"""``pspf docs``: an AsyncAPI 3.0.0 document of an app, for catalogs and for the teams around its topics."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import click

from pspf.cli.main import CliState, cli, service_for
from pspf.cli.targets import load_app
from pspf.contracts.asyncapi import asyncapi_document, registered_schemas, topic_roles
from pspf.errors import ConfigError


@cli.command(
    epilog="\b\nExamples:\n  pspf docs examples.dataflow:main\n"
    "  pspf docs examples.dataflow:main --format yaml --output asyncapi.yaml\n"
    "  pspf docs examples.dataflow:main --broker redis://127.0.0.1:6379/0"
)
@click.argument("target")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["json", "yaml"]),
    default="json",
    show_default=True,
    help="The document's format (yaml needs PyYAML).",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the document to this file  [default: standard output]",
)
@click.option(
    "--broker",
    metavar="URL",
    help="Take each topic's schema registered on this Redis/Valkey server (as for --broker of the other "
    "commands; TLS files from their PSPF_TLS_* variables)  [default: none: nothing connects]",
)
@click.pass_obj
def docs(obj: CliState, target: str, output_format: str, output: Path | None, broker: str | None) -> None:
    """Write an AsyncAPI 3.0.0 document of the app TARGET (module:attribute): its topics and messages.

    A channel per topic the app reads or writes, with a receive or send operation, and the message
    payload from the value types the app declares. With --broker, a topic's schema registered in
    Redis (pspf topic schema set) is its payload instead; without it nothing connects to a server.
    """
    app = load_app(target)
    app.compile()
    if not app.handlers and not app.global_tables:
        raise ConfigError(f"app {app.name!r} ({target}) reads no topic: it has no handlers to document")
    dump = _yaml_dump() if output_format == "yaml" else _json_dump
    schemas = None
    if broker is not None:
        schemas = registered_schemas(service_for(obj, broker).broker, list(topic_roles(app)))
    text = dump(asyncapi_document(app, schemas))
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise ConfigError(f"--output {output}: {exc.strerror or exc}") from None
    click.echo(f"wrote the AsyncAPI document of app {app.name} to {output}", err=True)


def _json_dump(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2) + "\n"


def _yaml_dump() -> Any:
    """PyYAML's ``safe_dump``, keeping the document's order; refused in one line without PyYAML."""
    try:
        yaml = importlib.import_module("yaml")  # optional: only this format needs it
    except ImportError:
        raise ConfigError("--format yaml needs PyYAML (pip install pyyaml); json needs nothing") from None

    def dump(document: dict[str, Any]) -> str:
        return str(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))

    return dump
