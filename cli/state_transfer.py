"""``pspf state export`` and ``import``: an app's state as NDJSON, and back into its stores."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from pspf.cli.commands import state
from pspf.cli.main import CliState, broker_option, service_for, state_dir_option, store_option
from pspf.service.wording import counted


@state.command(
    "export",
    epilog="\b\nExamples:\n  pspf state export order-totals > state.ndjson\n"
    "  pspf state export order-totals --all > everything.ndjson",
)
@click.argument("app")
@click.option("--partition", type=click.IntRange(min=0), help="Only this partition.")
@click.option(
    "--all",
    "internal",
    is_flag=True,
    help="Also the bookkeeping (outbox, consumers, retries, ...), not only the app's state.",
)
@broker_option
@state_dir_option
@store_option
@click.pass_obj
def state_export(
    obj: CliState,
    app: str,
    partition: int | None,
    internal: bool,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
) -> None:
    """Write APP's state and checkpoints as NDJSON to stdout (a snapshot, also while it runs).

    The app's state: its state values, open windows, table rows, scheduled callbacks, stream time
    and timer periods. From the state backups in Redis, or from the stores under --state-dir.
    """
    out = sys.stdout.buffer

    def warn(text: str) -> None:
        click.echo(f"Warning: {text}", err=True)

    service = service_for(obj, broker, state_dir, store)
    for line in service.state.state_export(app, partition, warn, internal=internal):
        out.write(line + b"\n")
    out.flush()


@state.command(
    "import",
    epilog="\b\nExample:\n  pspf state import order-totals --store rocksdb < state.ndjson",
)
@click.argument("app")
@click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="Read from this file instead of stdin.",
)
@state_dir_option
@store_option
@click.pass_obj
def state_import(
    obj: CliState, app: str, path: Path | None, state_dir: Path | None, store: str | None
) -> None:
    """Load `pspf state export` output into APP's (empty) stores; the app must be stopped.

    An export without --all keeps each partition's bookkeeping from its backup, which must be
    where the export was taken (else exit 2).
    """
    service = service_for(obj, None, state_dir, store)
    if path is None:
        result = service.state.state_import(app, sys.stdin.buffer)
    else:
        with path.open("rb") as lines:
            result = service.state.state_import(app, lines)
    values, partitions = counted(result.values, "value"), counted(result.partitions, "partition")
    kept = f", kept {counted(result.kept, 'value')} of bookkeeping from the backups" if result.kept else ""
    click.echo(f"imported {values} into {partitions}{kept}", err=True)
