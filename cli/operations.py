"""``pspf groups``, ``lag``, ``replay``, ``app``, ``outbox``, ``admin serve``: thin calls to the service.

Each command calls the service and prints its result through ``pspf.cli.render`` (tables, fields,
``--json``), so only the sentences a single command says are written here, beside it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from pspf.cli.main import (
    CliState,
    broker_option,
    cli,
    confirm,
    service_for,
    state_dir_option,
    store_option,
)
from pspf.cli.render import age_text, json_option, print_fields, print_json, print_table
from pspf.errors import ConfigError
from pspf.service import AppLag, ReplayResult, parse_position
from pspf.service.wording import counted

if TYPE_CHECKING:
    import uvicorn


@cli.command(epilog="\b\nExample:\n  pspf groups --json")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def groups(
    obj: CliState, broker: str | None, state_dir: Path | None, store: str | None, as_json: bool
) -> None:
    """List the apps (consumer groups) that have run here, with lag, pending and owners."""
    found = service_for(obj, broker, state_dir, store).apps.groups()
    if as_json:
        print_json(found)
        return
    print_table(
        [
            "APP",
            "TOPICS",
            "PARTITIONS",
            "LAG",
            "PENDING",
            "OLDEST PENDING",
            "DLQ",
            "MEMBERS",
            "CONSUMERS",
            "OWNERS",
        ],
        [
            [
                g.app,
                ",".join(g.topics),
                g.partitions,
                g.lag,
                g.pending,
                age_text(g.oldest_pending_age_s),
                g.dead_letters,
                len(g.members),
                g.consumers,
                ",".join(g.owners) or None,
            ]
            for g in found
        ],
    )
    for g in found:
        if g.error:
            click.echo(f"warning: app {g.app}: {g.error}", err=True)


@cli.command(epilog="\b\nExample:\n  pspf lag order-totals")
@click.argument("app")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def lag(
    obj: CliState, app: str, broker: str | None, state_dir: Path | None, store: str | None, as_json: bool
) -> None:
    """Show APP per topic partition (last id, checkpoint, lag, pending, owner), then its workers.

    The checkpoint comes from the app's state directory when it is reachable from here. For an
    app with global tables, last comes how many entries each worker is behind in each, as the
    worker counted them (every few seconds).
    """
    found: AppLag = service_for(obj, broker, state_dir, store).apps.lag(app)
    if as_json:
        print_json(found)
        return
    print_table(
        ["TOPIC", "PARTITION", "LAST ID", "CHECKPOINT", "LAG", "PENDING", "OLDEST PENDING", "DLQ", "OWNER"],
        [
            [
                d.topic,
                d.partition,
                d.last_id,
                d.checkpoint,
                d.lag,
                d.pending,
                age_text(d.oldest_pending_age_s),
                d.dead_letters,
                d.owner,
            ]
            for d in found.detail
        ],
    )
    click.echo()
    print_table(
        ["MEMBER", "HOST", "PID", "SINCE", "LAST HEARTBEAT", "PARTITIONS"],
        [
            [m.id, m.host, m.pid, m.since, m.last_heartbeat, ",".join(map(str, m.partitions)) or None]
            for m in found.members
        ],
    )
    behind = [[m.id, table, count] for m in found.members for table, count in sorted(m.global_tables.items())]
    if behind:
        click.echo()
        print_table(["MEMBER", "GLOBAL TABLE", "BEHIND"], behind)


@cli.command(
    epilog="\b\nExamples:\n  pspf replay order-totals --topic orders --from-start\n"
    "  pspf replay order-totals --topic orders --to-time 2026-11-21T10:00:00Z --yes"
)
@click.argument("app")
@click.option("--topic", "topics", multiple=True, required=True, help="A topic to replay (repeatable).")
@click.option("--from-start", is_flag=True, help="Replay every entry still in the streams.")
@click.option("--to-id", help="Replay the entries after this id.")
@click.option("--to-time", help="Replay the entries added from this time: ISO 8601 or unix ms.")
@click.option(
    "--keep-state",
    is_flag=True,
    help="Keep the app's state: replayed entries are applied AGAIN onto it (double counting).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be replayed; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def replay(
    obj: CliState,
    app: str,
    topics: tuple[str, ...],
    from_start: bool,
    to_id: str | None,
    to_time: str | None,
    keep_state: bool,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """Deliver entries of APP's topics again, from a position; APP must be stopped.

    The consumer group moves to the position and the app's state and checkpoints are reset with
    it, so running the app again rebuilds the state from the replayed entries. With --keep-state
    only the checkpoints move: every replayed entry is applied a second time onto the state.
    """
    position = parse_position(from_start, to_id, to_time)
    service = service_for(obj, broker, state_dir, store)
    preview = service.replay.replay(app, topics, position, keep_state, dry_run=True)
    if keep_state:
        click.echo(
            f"warning: --keep-state: the {counted(preview.entries_to_replay, 'replayed entry')} will "
            "be applied again onto the current state, which already holds the effects",
            err=True,
        )
    if not dry_run:
        if not yes:
            _confirm_replay(app, preview, keep_state)
        result = service.replay.replay(app, topics, position, keep_state)
    else:
        result = preview
    if as_json:
        print_json(result)
    else:
        _say_replayed(result, dry_run)


def _confirm_replay(app: str, preview: ReplayResult, keep_state: bool) -> None:
    what = "keep" if keep_state else "DELETE"
    entries = counted(preview.entries_to_replay, "entry")
    confirm(
        f"Replay {entries} of {', '.join(preview.topics)} to app {app} "
        f"from {preview.position} and {what} its state?"
    )


def _say_replayed(result: ReplayResult, dry_run: bool) -> None:
    verb = "would move" if dry_run else "moved"
    click.echo(
        f"{verb} app {result.app} to {result.position} in {', '.join(result.topics)} "
        f"({counted(result.partitions, 'partition')}): {counted(result.entries_to_replay, 'entry')} to replay"
    )
    if result.superseded:
        click.echo(
            f"{result.superseded} of them {'was' if result.superseded == 1 else 'were'} redriven from the "
            "DLQ later: skipped, and the last redriven copies applied, as in the first run"
        )
    if result.state_reset:
        done = "would be" if dry_run else "were"
        click.echo(f"state and checkpoints {done} reset; run the app to rebuild the state")
    else:
        click.echo(f"checkpoints {'would be' if dry_run else 'were'} moved back; the state was kept")


@cli.group()
def outbox() -> None:
    """Inspect and replay what apps emitted (ctx.emit): their outbox rows."""


@outbox.command("list", epilog="\b\nExample:\n  pspf outbox list enricher --state dead")
@click.argument("app")
@click.option("--state", "row_state", type=click.Choice(["pending", "claimed", "published", "dead"]))
@click.option("--partition", type=click.IntRange(min=0), help="Only rows of this source partition.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many rows.")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def outbox_list(
    obj: CliState,
    app: str,
    row_state: str | None,
    partition: int | None,
    limit: int | None,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """List APP's outbox rows (from its state backup, or --state-dir)."""
    found = service_for(obj, broker, state_dir, store).outbox.outbox_list(app, row_state, partition, limit)
    if as_json:
        print_json(found)
        return
    print_table(
        ["ROW", "STATE", "TARGET", "KEY", "SOURCE", "ATTEMPTS", "CREATED", "LAST ERROR"],
        [
            [
                r.row_id,
                r.state,
                f"{r.topic}:{r.partition}",
                r.key,
                r.source,
                r.attempts,
                r.created_at,
                r.last_error,
            ]
            for r in found
        ],
    )


@outbox.command("show")
@click.argument("app")
@click.argument("row_id")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def outbox_show(
    obj: CliState,
    app: str,
    row_id: str,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """Show one outbox row of APP whole (ROW_ID as `pspf outbox list` prints it)."""
    detail = service_for(obj, broker, state_dir, store).outbox.outbox_show(app, row_id)
    if as_json:
        print_json(detail)
        return
    print_fields(detail)


@outbox.command(
    "replay",
    epilog="\b\nExamples:\n  pspf outbox replay enricher 0:17 2:5\n"
    "  pspf outbox replay enricher --dead --dry-run",
)
@click.argument("app")
@click.argument("ids", nargs=-1)
@click.option("--dead", is_flag=True, help="Every dead row.")
@click.option("--all", "all_rows", is_flag=True, help="Every dead and every published row.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many rows.")
@click.option("--dry-run", is_flag=True, help="Say what would be replayed; change nothing.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to wait for the partitions' owners to apply it.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def outbox_replay(
    obj: CliState,
    app: str,
    ids: tuple[str, ...],
    dead: bool,
    all_rows: bool,
    limit: int | None,
    dry_run: bool,
    wait_s: float,
    yes: bool,
    broker: str | None,
    as_json: bool,
) -> None:
    """Publish APP's dead or published outbox rows again, each once more.

    The app's workers apply the request (their stores hold the rows): a running worker of APP
    owning the rows' partitions does so within a few seconds. Exit code 7 when some partition's
    owner did not apply it within --wait: the request stays queued for the next owner.
    """
    service = service_for(obj, broker)
    preview = service.outbox.outbox_replay(app, ids, dead, all_rows, limit, dry_run=True)
    if not dry_run and preview.selected:
        if not yes:
            rows = counted(len(preview.selected), "outbox row")
            confirm(f"Replay {rows} of {app}?")
        result = service.outbox.outbox_replay(app, ids, dead, all_rows, limit, wait_s=wait_s)
    else:
        result = preview
    if as_json:
        print_json(result)
    elif dry_run:
        click.echo(f"would replay {counted(len(result.selected), 'row')} (dry run, nothing changed)")
    else:
        click.echo(f"replayed {len(result.replayed)} of {counted(len(result.selected), 'selected row')}")
    if result.waiting:
        _say_waiting(app, result.waiting, wait_s)
        sys.exit(7)


def _say_waiting(app: str, waiting: list[int], wait_s: float) -> None:
    partitions = ", ".join(map(str, waiting))
    click.echo(
        f"{'partition' if len(waiting) == 1 else 'partitions'} {partitions}: "
        f"no worker of {app} applied the request "
        f"within {wait_s:g}s; it stays queued until one owns them",
        err=True,
    )


@cli.group("app")
def app_group() -> None:
    """Reset or retire an app."""


@app_group.command(
    "delete",
    epilog="\b\nExamples:\n  pspf app delete old-totals --dry-run\n  pspf app delete old-totals --yes",
)
@click.argument("app")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--force", is_flag=True, help="Delete even while workers of the app are alive.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@json_option
@click.pass_obj
def app_delete(
    obj: CliState, app: str, dry_run: bool, force: bool, yes: bool, broker: str | None, as_json: bool
) -> None:
    """Remove everything of APP from the server; APP must be stopped.

    Its consumer group on every stream of its topics (a retired app's group holds retention for
    ever), its leases, members, state backups and their logs, outbox replay requests and record,
    and the re-keying topics its streams created (group_by) that no other app reads, and its list
    of savepoints. The stores under its workers' state dirs stay (delete those folders where they
    are), and so do its savepoints' files (`pspf app restore --from PATH` still takes them).
    """
    service = service_for(obj, broker, None, None)
    preview = service.retire.delete_app(app, force=force, dry_run=True)
    if not dry_run:
        if not yes:
            confirm(
                f"Delete app {app}: {counted(len(preview.groups), 'consumer group')} and "
                f"{counted(len(preview.keys), 'key')}?"
            )
        result = service.retire.delete_app(app, force=force)
    else:
        result = preview
    if as_json:
        print_json(result)
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} app {app} ({', '.join(result.topics)}, {counted(result.partitions, 'partition')}):")
    for stream in result.groups:
        click.echo(f"  group {app} of {stream}")
    for name in result.keys:
        click.echo(f"  key {name}")
    for topic in result.managed_topics:
        click.echo(f"  topic {topic} (its streams' re-keying topic)")


@app_group.command(
    "reset",
    epilog="\b\nExamples:\n  pspf app reset order-totals --dry-run\n"
    "  pspf app reset order-totals --to-end --keep-state --yes",
)
@click.argument("app")
@click.option("--to-start", "to", flag_value="start", default=True, help="From the first entry (default).")
@click.option("--to-end", "to", flag_value="end", help="From the next entry produced: skip the backlog.")
@click.option("--keep-state", is_flag=True, help="Keep the app's state; move only its positions.")
@click.option("--dry-run", is_flag=True, help="Say what would change; change nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@broker_option
@state_dir_option
@store_option
@json_option
@click.pass_obj
def app_reset(
    obj: CliState,
    app: str,
    to: str,
    keep_state: bool,
    dry_run: bool,
    yes: bool,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    as_json: bool,
) -> None:
    """Start APP afresh from the start (or the end) of every topic it reads; APP must be stopped.

    Its consumer groups are re-created there and, unless --keep-state, its state is deleted:
    values, windows, timers, TTLs and table rows (a table is then read again from its first
    entry, also with --to-end). Stores in --state-dir are reset here; the others restore from
    the state backup when their worker starts.
    """
    service = service_for(obj, broker, state_dir, store)
    preview = service.replay.reset_app(app, to_end=to == "end", keep_state=keep_state, dry_run=True)
    if not dry_run:
        if not yes:
            what = "keep" if keep_state else "DELETE"
            confirm(f"Reset app {app} to the {to} of {', '.join(preview.topics)} and {what} its state?")
        result = service.replay.reset_app(app, to_end=to == "end", keep_state=keep_state)
    else:
        result = preview
    if as_json:
        print_json(result)
        return
    verb = "would reset" if dry_run else "reset"
    click.echo(
        f"{verb} app {app} to the {result.to} of {', '.join(result.topics)} "
        f"({counted(result.partitions, 'partition')}): {counted(result.entries_to_process, 'entry')} "
        f"to process, {counted(result.entries_skipped, 'unhandled entry')} skipped"
    )
    if result.tables_rebuilt:
        click.echo(f"tables read again from their first entry: {', '.join(result.tables_rebuilt)}")
    if result.superseded:
        click.echo(f"{result.superseded} redriven from the DLQ later: their last copies apply instead")
    done = "would be" if dry_run else "were"
    if result.state_reset:
        click.echo(f"state (values, windows, timers, TTLs, table rows) and checkpoints {done} reset")
    else:
        click.echo(f"checkpoints {done} moved; the state was kept")
    here = ", ".join(map(str, result.stores_here)) or "none"
    click.echo(f"stores in this state dir: partitions {here}; the others restore from the state backup")


@cli.group()
def admin() -> None:
    """The admin HTTP API."""


@admin.command(
    "serve",
    epilog="\b\nExample:\n  PSPF_ADMIN_TOKEN=$(openssl rand -hex 16) pspf admin serve --port 8080",
)
@broker_option
@state_dir_option
@store_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--token",
    envvar="PSPF_ADMIN_TOKEN",
    show_envvar=True,
    help="Bearer token that write endpoints require; without one the API is read-only.",
)
@click.pass_obj
def admin_serve(
    obj: CliState,
    broker: str | None,
    state_dir: Path | None,
    store: str | None,
    host: str,
    port: int,
    token: str | None,
) -> None:
    """Serve the admin HTTP API (OpenAPI at /schema) and broker metrics (/metrics)."""
    try:
        import uvicorn

        from pspf.admin_api import create_app
    except ImportError as exc:
        raise ConfigError(f"the admin API needs {exc.name}: pip install 'pspf[admin]'") from None
    service = service_for(obj, broker, state_dir, store)
    listening = _listen(host, port)
    if not token:
        click.echo("admin API is read-only: no --token or PSPF_ADMIN_TOKEN, writes are refused", err=True)
    bound = listening.getsockname()[1]
    where = f"http://{f'[{host}]' if ':' in host else host}:{bound}"
    click.echo(f"operator page: {where}/ui/", err=True)
    click.echo(f"admin API on {where} (OpenAPI: /schema, metrics: /metrics)", err=True)
    config = uvicorn.Config(create_app(service, token=token or None), log_level="warning")
    _clean_exit_server()(config).run(sockets=[listening])


def _clean_exit_server() -> type[uvicorn.Server]:
    import uvicorn

    class CleanExit(uvicorn.Server):
        """Stops on SIGINT/SIGTERM and returns: exit 0, where uvicorn dies by the signal again."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()  # the stop was asked for

    return CleanExit


def _listen(host: str, port: int) -> socket.socket:
    """The socket, bound before serving: --port 0 gets its real port printed, a taken port one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None
