"""``pspf sink``: deliver a topic into an external store, each entry once (``pspf.sink``)."""

from __future__ import annotations

from typing import Any

import click

from pspf.cli.main import CliState, broker_option, cli, run_settings, run_summary, worker_options
from pspf.errors import ConfigError


@cli.group()
def sink() -> None:
    """Deliver a topic into an external store, exactly once."""


@sink.command(
    "postgres",
    epilog="\b\nExamples:\n  pspf sink postgres orders --dsn postgresql://app@db/shop --table orders\n"
    "  pspf sink postgres orders --dsn $DSN --table order_latest --mode upsert --until-idle",
)
@click.argument("topic")
@click.option("--dsn", envvar="PSPF_SINK_DSN", show_envvar=True, required=True, help="PostgreSQL DSN or URL.")
@click.option("--table", required=True, help="Table to write, NAME or SCHEMA.NAME; created when missing.")
@click.option(
    "--mode",
    type=click.Choice(["rows", "upsert"]),
    default="rows",
    show_default=True,
    help="rows: one row per entry; upsert: one row per key with its latest value.",
)
@click.option("--name", help="The sink's consumer group  [default: sink-postgres-TABLE].")
@broker_option
@worker_options(leave_out=("--store", "--durability", "--standby"))  # no local state
@click.option("--until-idle", is_flag=True, help="Stop once nothing is left to deliver.")
@click.pass_obj
def postgres(
    obj: CliState,
    /,
    topic: str,
    dsn: str,
    table: str,
    mode: str,
    name: str | None,
    until_idle: bool,
    **options: Any,
) -> None:
    """Write every entry of TOPIC into a PostgreSQL table, once, whatever fails.

    The checkpoint of each partition is written in the same transaction as its rows, so a crash,
    a retry or a takeover never writes a row twice; start several to share the partitions. A row
    the database refuses sends its entry to the DLQ with the database's error.
    """
    try:
        from pspf.sink_postgres import PostgresSink
    except ImportError as exc:
        raise ConfigError(
            f"the PostgreSQL sink needs psycopg 3: pip install 'pspf[postgres]' ({exc})"
        ) from None
    settings = run_settings(obj, options)
    target = PostgresSink(dsn, table, mode="upsert" if mode == "upsert" else "rows", name=name)
    worker = target.worker(topic, settings)
    click.echo(f"sink {target.name}: {topic} into {table} ({mode})", err=True)
    with worker.signals_handled():
        summary = worker.run(until_idle=until_idle)
    click.echo(run_summary(summary), err=True)
