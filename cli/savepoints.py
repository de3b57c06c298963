"""``pspf app savepoint|savepoints|restore``: an app's state and positions at one cut, and back."""

from __future__ import annotations

import click

from pspf.cli.main import CliState, broker_option, confirm, service_for
from pspf.cli.operations import app_group
from pspf.cli.render import json_option, print_json, print_table
from pspf.service import SavepointRestored
from pspf.service.records import iso_time
from pspf.service.wording import counted


@app_group.command(
    "savepoint",
    epilog="\b\nExamples:\n  pspf app savepoint order-totals --to /backups/pspf\n"
    "  pspf app savepoint order-totals --to s3://bucket/savepoints --name before-v2\n"
    "  pspf app savepoint order-totals --to /backups/pspf --stop\n"
    "  pspf app savepoint order-totals --resume\n  pspf app savepoint order-totals --delete before-v2",
)
@click.argument("app")
@click.option("--to", "url", metavar="URL", help="A directory, or s3://bucket/prefix (the files extra).")
@click.option("--name", help="The savepoint's name (default: the UTC time it is taken).")
@click.option("--stop", is_flag=True, help="Stop the app's workers first (each finishes its batch).")
@click.option(
    "--timeout", type=click.FloatRange(0), default=60.0, show_default=True, help="Seconds --stop waits."
)
@click.option("--resume", is_flag=True, help="Take again the savepoint a crash interrupted.")
@click.option("--delete", "delete", metavar="NAME", help="Delete the savepoint NAME (its files too).")
@click.option("--yes", is_flag=True, help="Do not ask before --delete.")
@broker_option
@json_option
@click.pass_obj
def app_savepoint(
    obj: CliState,
    app: str,
    url: str | None,
    name: str | None,
    stop: bool,
    timeout: float,
    resume: bool,
    delete: str | None,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Write a savepoint of APP: its state and positions at one cut, to URL/NAME.

    The app may run: each partition's cut is its last batch its state backup holds (values,
    windows, tables, timers, TTLs, unpublished outbox rows) with each stream's position. With
    --stop its workers stop first, each after its batch (as on SIGTERM), and workers started
    meanwhile stop at once; new ones run once it is taken. Prints the savepoint's path, which
    `pspf app restore --from` takes.
    """
    service = service_for(obj, broker)
    if delete is not None:
        service.savepoints.delete(app, delete, dry_run=True)
        if not yes:
            confirm(f"Delete savepoint {delete} of app {app} and its files?")
        entry = service.savepoints.delete(app, delete)
        if as_json:
            print_json(entry)
        else:
            click.echo(f"deleted savepoint {entry.name} of app {app} ({entry.path})")
        return
    taken = service.savepoints.take(app, url, name, resume=resume, stop=stop, timeout_s=timeout)
    if as_json:
        print_json(taken)
        return
    click.echo(
        f"savepoint {taken.name} of app {app}: {counted(taken.partitions, 'partition')}, "
        f"{counted(taken.keys, 'key')}, {counted(taken.values, 'value')}, {taken.bytes:,} bytes in "
        f"{taken.seconds:.2f}s{' (app stopped)' if taken.stopped else ' (app running)'}"
    )
    click.echo(taken.path)


@app_group.command("savepoints", epilog="\b\nExamples:\n  pspf app savepoints order-totals --json")
@click.argument("app")
@broker_option
@json_option
@click.pass_obj
def app_savepoints(obj: CliState, app: str, broker: str | None, as_json: bool) -> None:
    """List the savepoints of APP, oldest first."""
    entries = service_for(obj, broker).savepoints.listed(app)
    if as_json:
        print_json(entries)
        return
    if not entries:
        click.echo(f"app {app} has no savepoints")
        return
    print_table(
        ["NAME", "TAKEN", "STATE", "PARTITIONS", "KEYS", "PATH"],
        [[e.name, iso_time(e.taken_ms), e.state, e.partitions, e.keys, e.path] for e in entries],
    )


@app_group.command(
    "restore",
    epilog="\b\nExamples:\n  pspf app restore order-totals --from /backups/pspf/before-v2 --dry-run\n"
    "  pspf app restore order-totals --from /backups/pspf/before-v2 --as order-totals-v2 --yes\n"
    "  pspf app restore order-totals --resume",
)
@click.argument("app")
@click.option("--from", "source", metavar="PATH", help="The savepoint (the path `app savepoint` printed).")
@click.option("--as", "as_app", metavar="NEW_APP", help="Restore a fork under this new name instead.")
@click.option("--partitions", type=click.IntRange(1, 1024), help="The partition count the topics must have.")
@click.option("--resume", is_flag=True, help="Finish a restore a crash interrupted.")
@click.option("--dry-run", is_flag=True, help="Say what would change; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def app_restore(
    obj: CliState,
    app: str,
    source: str | None,
    as_app: str | None,
    partitions: int | None,
    resume: bool,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Put APP (or a fork of it, --as NEW_APP) at the savepoint PATH; the app must be stopped.

    Its groups go to the saved positions and its state backups become the saved state; stores in
    workers' state dirs restore from them when they start. A fork takes no outbox rows: its
    outputs are what its code emits for the entries after the cut. When the topics were
    repartitioned since, the state is split or merged by key.
    """
    service = service_for(obj, broker)
    restore = service.savepoints.restore
    if dry_run or not yes:  # the dry run reads the whole savepoint: only when it is shown
        result = restore(app, source, as_app, partitions, dry_run=True, resume=resume)
        if dry_run:
            return _show_restored(app, result, as_json)
        what = f"fork {result.target} of {app}" if result.fork else f"app {app}"
        confirm(f"Put {what} at savepoint {result.source} (its state and positions replaced)?")
    _show_restored(app, restore(app, source, as_app, partitions, resume=resume), as_json)


def _show_restored(app: str, result: SavepointRestored, as_json: bool) -> None:
    dry_run = result.dry_run
    if as_json:
        print_json(result)
        return
    verb = "would restore" if dry_run else "restored"
    what = f"fork {result.target} of app {app}" if result.fork else f"app {app}"
    if result.resumed:
        click.echo(f"{'would finish' if dry_run else 'finished'} the restore of {what} from {result.source}")
        return
    split = (
        f", split from {result.partitions_saved} into {result.partitions} partitions"
        if result.mode == "split"
        else ""
    )
    click.echo(
        f"{verb} {what} from {result.source}: {counted(result.keys, 'key')}, "
        f"{counted(result.partitions, 'partition')}{split}; "
        f"{counted(result.entries_to_handle, 'entry')} to handle after the cut"
    )
