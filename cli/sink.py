"""``pspf sink``: deliver a topic into an external store, each entry once (``pspf.sink``)."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import click

from pspf.cli.main import (
    CliState,
    broker_option,
    cli,
    confirm,
    run_settings,
    run_summary,
    service_for,
    worker_options,
)
from pspf.errors import ConfigError

if TYPE_CHECKING:
    from pspf.settings import Settings
    from pspf.sink import Sink


def _postgres() -> ModuleType:
    """``pspf.sink_postgres``, or the extra to install."""
    try:
        import pspf.sink_postgres
    except ImportError as exc:
        raise ConfigError(
            f"the PostgreSQL sink needs psycopg 3: pip install 'pspf[postgres]' ({exc})"
        ) from None
    return pspf.sink_postgres


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
    settings = run_settings(obj, options)
    target = _postgres().PostgresSink(dsn, table, mode="upsert" if mode == "upsert" else "rows", name=name)
    _deliver(target, topic, settings, f"{table} ({mode})", until_idle)


def _deliver(target: Sink, topic: str, settings: Settings, into: str, until_idle: bool) -> None:
    """Run a sink's worker over ``topic``, saying where it delivers, then its summary."""
    worker = target.worker(topic, settings)
    click.echo(f"sink {target.name}: {topic} into {into}", err=True)
    with worker.signals_handled():
        summary = worker.run(until_idle=until_idle)
    click.echo(run_summary(summary), err=True)


@sink.command(
    "files",
    epilog="\b\nExamples:\n  pspf sink files orders --url ./lake/orders --format parquet --until-idle\n"
    "  pspf sink files orders --url ./lake/orders --roll-entries 50000 --roll-seconds 60\n"
    "  AWS_ENDPOINT_URL=http://127.0.0.1:9000 pspf sink files orders --url s3://lake/raw",
)
@click.argument("topic")
@click.option("--url", required=True, help="A local folder, or s3://BUCKET/PREFIX (AWS_* variables).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "parquet"]), default="jsonl", show_default=True)
@click.option("--name", help="The sink's consumer group  [default: sink-files-URL].")
@click.option("--roll-entries", type=int, help="The most entries of a partition one object holds.")
@click.option(
    "--roll-seconds", type=float, help="After an object that filled less, wait this long to read again."
)
@broker_option
@worker_options(leave_out=("--store", "--durability", "--standby"))  # no local state
@click.option("--until-idle", is_flag=True, help="Stop once nothing is left to deliver.")
@click.pass_obj
def files(
    obj: CliState,
    /,
    topic: str,
    url: str,
    fmt: str,
    name: str | None,
    roll_entries: int | None,
    roll_seconds: float | None,
    until_idle: bool,
    **options: Any,
) -> None:
    """Write every entry of TOPIC into JSON Lines or Parquet objects under URL, once, whatever fails.

    Each batch of a partition is one object, URL/TOPIC/PARTITION/FIRST_LAST.FORMAT, named by the
    ids of its first and last entries and written whole; it carries the partition's position, so
    a crash, a retry or a takeover writes no entry into two objects. Start several to share the
    partitions. Needs the files extra (pip install 'pspf[files]').
    """
    from pspf.sink.files import FilesSink

    settings = run_settings(obj, options)
    target = FilesSink(
        url,
        "parquet" if fmt == "parquet" else "jsonl",
        name=name,
        roll_entries=roll_entries,
        roll_seconds=roll_seconds,
    )
    _deliver(target, topic, settings, target.describe(), until_idle)


@sink.command(
    "iceberg",
    epilog="\b\nExamples:\n  pspf sink iceberg orders --table lake.orders --until-idle\n"
    "  PYICEBERG_CATALOG__PROD__URI=http://rest:8181 pspf sink iceberg orders --table lake.orders "
    "--catalog prod",
)
@click.argument("topic")
@click.option(
    "--table", required=True, help="NAMESPACE.TABLE; the namespace and table are created when missing."
)
@click.option(
    "--catalog",
    default="default",
    show_default=True,
    help="The pyiceberg catalog (PYICEBERG_CATALOG__NAME__* variables or .pyiceberg.yaml).",
)
@click.option("--name", help="The sink's consumer group  [default: sink-iceberg-TABLE].")
@broker_option
@worker_options(leave_out=("--store", "--durability", "--standby"))  # no local state
@click.option("--until-idle", is_flag=True, help="Stop once nothing is left to deliver.")
@click.pass_obj
def iceberg(
    obj: CliState, /, topic: str, table: str, catalog: str, name: str | None, until_idle: bool, **options: Any
) -> None:
    """Write every entry of TOPIC into an Apache Iceberg table, once, whatever fails.

    Each batch of a partition is one snapshot (an append) whose summary holds the partition's
    position, so a crash, a retry or a takeover writes no row twice; a worker taken over writes
    nothing more. Start several to share the partitions. Needs the iceberg extra
    (pip install 'pspf[iceberg]').
    """
    from pspf.sink.iceberg import IcebergSink

    settings = run_settings(obj, options)
    target = IcebergSink(table, catalog=catalog, name=name)
    _deliver(target, topic, settings, target.describe(), until_idle)


@sink.command(
    "reset",
    epilog="\b\nExamples:\n  pspf sink reset sink-postgres-orders --dsn postgresql://app@db/shop\n"
    "  pspf sink reset sink-postgres-orders --dsn $DSN --keep-checkpoints --yes",
)
@click.argument("name")
@click.option("--dsn", envvar="PSPF_SINK_DSN", show_envvar=True, required=True, help="PostgreSQL DSN or URL.")
@click.option(
    "--keep-checkpoints",
    is_flag=True,
    help="Only accept the table as it is now (after a VACUUM FULL or a CLUSTER, which keep the rows).",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@click.pass_obj
def reset(
    obj: CliState, /, name: str, dsn: str, keep_checkpoints: bool, yes: bool, broker: str | None
) -> None:
    """Deliver the topic of the stopped sink NAME again from its first entry.

    For a table that was dropped, truncated or replaced, which the sink refuses: its consumer
    groups move to the first entry of each partition, then its checkpoints, bookkeeping and the
    record of its table are deleted from the database. The next start creates the table when
    missing and writes every row again (rows already there are skipped, or never made older).
    Running it again after a failure completes it.
    """
    forget = _postgres().forget
    if keep_checkpoints:
        forget(dsn, name, keep_checkpoints=True)
        click.echo(f"sink {name}: its table is accepted as it is at its next start; checkpoints kept")
        return
    if not yes:
        confirm(f"Deliver every entry to sink {name} again, from the first?")
    topics = service_for(obj, broker).replay.restart_groups(name)
    partitions = forget(dsn, name)
    where = ", ".join(topics) or "(it never ran on this server)"
    click.echo(
        f"sink {name} reset: its groups start at the first entry of {where}; checkpoints of "
        f"{partitions} partitions deleted. Start it to deliver everything again"
    )
