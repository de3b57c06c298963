"""``pspf topic repartition``: a topic's partition count changed, with every app's state."""

from __future__ import annotations

import click

from pspf.cli.commands import topic
from pspf.cli.main import CliState, broker_option, confirm, service_for
from pspf.cli.render import json_option, print_json
from pspf.service.records import RepartitionResult
from pspf.service.wording import counted


@topic.command(
    "repartition",
    epilog="\b\nExamples:\n  pspf topic repartition orders --partitions 8 --dry-run\n"
    "  pspf topic repartition orders --partitions 8 --yes\n  pspf topic repartition orders --resume\n"
    "  pspf topic repartition orders --abort",
)
@click.argument("name")
@click.option("--partitions", type=click.IntRange(1, 1024), help="The new partition count.")
@click.option("--resume", is_flag=True, help="Finish a repartition a crash interrupted.")
@click.option("--abort", is_flag=True, help="Undo a repartition that has not switched (frees its copies).")
@click.option("--dry-run", is_flag=True, help="Say what would move; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def topic_repartition(
    obj: CliState,
    name: str,
    partitions: int | None,
    resume: bool,
    abort: bool,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Change topic NAME's partition count, with every app's state; its apps must be stopped.

    Every entry moves to its key's new partition and each app's state with its keys, so each app
    then handles exactly the entries it had not handled. The topics read together with NAME (by
    a common app) move with it.
    """
    service = service_for(obj, broker)
    if not dry_run and not yes:
        preview = service.repartition.repartition_topic(
            name, partitions, dry_run=True, resume=resume, abort=abort
        )
        what = "Finish the repartition of" if preview.resumed else "Repartition"
        what = "Undo the repartition of" if abort else what
        moving = "" if preview.resumed or abort else f", moving {counted(preview.entries, 'entry')}"
        confirm(
            f"{what} {', '.join(preview.topics)} from {preview.partitions_before} to "
            f"{preview.partitions_after} partitions{moving}?"
        )
    result = service.repartition.repartition_topic(
        name, partitions, dry_run=dry_run, resume=resume, abort=abort
    )
    if as_json:
        print_json(result)
    else:
        _say(result)


def _say(result: RepartitionResult) -> None:
    if result.aborted:
        verb = "would undo" if result.dry_run else "undid"
        click.echo(
            f"{verb} the repartition of {', '.join(result.topics)} from {result.partitions_before} to "
            f"{result.partitions_after} partitions: they keep {result.partitions_before}"
        )
        return
    if result.resumed:
        resumes = "would resume" if result.dry_run else "resumed"
        click.echo(f"{resumes} the repartition of {result.topic} at its {result.resumed} step")
    verb = "would move" if result.dry_run else "moved"
    # a resumed switch copies nothing: the entries were counted when they were copied
    entries = "" if result.resumed == "switching" else f": {counted(result.entries, 'entry')}"
    click.echo(
        f"{verb} {', '.join(result.topics)} from {result.partitions_before} to {result.partitions_after} "
        f"partitions{entries} in {result.seconds:.1f}s"
    )
    for app, count in sorted(result.to_handle.items()):
        keys = result.state_keys.get(app, [])
        click.echo(f"  app {app}: {counted(count, 'entry')} to handle, state keys per partition {keys}")
