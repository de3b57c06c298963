"""``pspf source``: add rows from outside PSPF to a topic, each once (``pspf.source``)."""

from __future__ import annotations

import logging

import click

from pspf.cli.main import CliState, broker_option, cli
from pspf.cli.render import json_option, print_json
from pspf.service.wording import counted


@cli.group()
def source() -> None:
    """Add rows from outside PSPF to a topic, each exactly once."""


@source.command(
    "files",
    epilog="\b\nExamples:\n  pspf source files ./exports orders --format csv --key-field user\n"
    "  AWS_ENDPOINT_URL=http://127.0.0.1:9000 pspf source files s3://lake/orders orders "
    "--format parquet --key-field user --follow",
)
@click.argument("url")
@click.argument("topic")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "csv", "parquet"]),
    default="jsonl",
    show_default=True,
    help="The objects' format; only files ending .jsonl/.ndjson, .csv or .parquet are read.",
)
@click.option("--key-field", help="The row field that is the entry's key  [default: none, spread by row]")
@click.option("--name", help="The source's name, which its positions are kept under  [default: TOPIC-URL]")
@click.option("--follow", is_flag=True, help="Keep looking for new objects until SIGTERM or Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between two looks for new objects with --follow.",
)
@broker_option
@json_option
@click.pass_obj
def files(
    obj: CliState,
    /,
    url: str,
    topic: str,
    fmt: str,
    key_field: str | None,
    name: str | None,
    follow: bool,
    interval: float,
    broker: str | None,
    as_json: bool,
) -> None:
    """Add every row of the objects under URL (a folder or s3://BUCKET/PREFIX) to TOPIC, once.

    Objects are read in path order; each row becomes one entry, its value the row as a JSON
    object (CSV values are strings), its key the --key-field. Killed and started again, it adds
    no row twice and skips the objects it finished. A row it cannot add stops it with the
    object and the row's number. Needs the files extra (pip install 'pspf[files]').
    """
    from pspf.source.files import FilesSource

    settings = obj.settings({"PSPF_BROKER": broker})
    target = FilesSource(
        url, topic, "csv" if fmt == "csv" else "parquet" if fmt == "parquet" else "jsonl", key_field, name
    )
    if obj.verbose == 0:
        logging.getLogger("pspf").setLevel(logging.INFO)
    click.echo(f"source {target.name}: {target.url} into {topic}", err=True)
    summary = target.run(settings, follow=follow, interval_s=interval)
    if as_json:
        print_json(summary)
        return
    click.echo(
        f"added {counted(summary.rows_added, 'row')} from {counted(summary.objects, 'object')} "
        f"({summary.rows_already} already in the topic; "
        f"{counted(summary.objects_done_before, 'object')} done before)",
        err=True,
    )
