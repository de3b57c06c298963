"""``pspf state adopt``: keep the stores of a machine as an app's state after Redis lost it."""

from __future__ import annotations

from pathlib import Path

import click
import msgspec

from pspf.cli.commands import state
from pspf.cli.main import CliState, broker_option, service_for, state_dir_option, store_option
from pspf.cli.render import json_option, print_json
from pspf.service.wording import counted


@state.command(
    "adopt",
    epilog="\b\nExample, after Redis restarted without its data:\n"
    "  pspf topic create orders --partitions 4\n"
    "  pspf state adopt order-totals     # on every machine with stores of the app, app stopped\n"
    "  pspf run examples.order_totals:main",
)
@click.argument("app")
@click.option(
    "--partition",
    "partitions",
    multiple=True,
    type=click.IntRange(min=0),
    help="Also adopt this partition without a store here: it starts anew (repeatable).",
)
@click.option(
    "--topic",
    "topics",
    multiple=True,
    help="A topic of the app, in the app's order (when the server no longer records them).",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Let a later store here replace adopted state that workers applied entries on top of.",
)
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def state_adopt(
    obj: CliState,
    app: str,
    partitions: tuple[int, ...],
    topics: tuple[str, ...],
    replace: bool,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """Keep APP's stores here as its state on a server that lost the app's data.

    When Redis lost an app's consumer groups and state backups (a restart without persistence,
    a flush, eviction), workers refuse to run. Run this on every machine that holds stores of
    the app, in any order, with the app stopped: of each partition, the latest store (by its
    checkpoints) becomes the state. A store is uploaded as the partition's backup and its
    consumer groups start at its checkpoint; the workers then apply the entries the server holds
    after it. A partition whose state the server has, as late as the store here or later, is
    left alone.
    """
    result = service_for(obj, broker, state_dir, store).state.state_adopt(app, partitions, topics, replace)
    if as_json:
        print_json(msgspec.to_builtins(result))
        return
    for partition, starts in sorted(result.adopted.items()):
        at = ", ".join(f"{topic} after {start}" for topic, start in sorted(starts.items()))
        click.echo(f"partition {partition}: adopted, its group starts {at}")
    if result.kept:
        click.echo(
            f"left alone (the server has their state, as late as the stores here or later): "
            f"partitions {result.kept}"
        )
    click.echo(f"adopted {counted(len(result.adopted), 'partition')} of app {app}", err=True)
