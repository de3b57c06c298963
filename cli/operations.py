"""``pspf groups``, ``lag``, ``replay`` and ``admin serve``: thin calls into ``pspf.service``."""

from __future__ import annotations

from pathlib import Path

import click

from cli.commands import print_json, print_table
from cli.main import CliState, broker_option, cli, json_option, service_for, state_dir_option, store_option
from pspf.errors import ConfigError
from pspf.service import AppLag, parse_position


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


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
    found = service_for(obj, broker, state_dir, store).groups()
    if as_json:
        print_json(found)
        return
    print_table(
        ["APP", "TOPICS", "PARTITIONS", "LAG", "PENDING", "OLDEST PENDING", "DLQ", "MEMBERS", "OWNERS"],
        [
            [
                g.app,
                ",".join(g.topics),
                g.partitions,
                g.lag,
                g.pending,
                _age(g.oldest_pending_age_s),
                g.dead_letters,
                len(g.members),
                ",".join(g.owners) or None,
            ]
            for g in found
        ],
    )
    for g in found:
        if g.error:
            click.echo(f"warning: app {g.app}: {g.error}", err=True)


@cli.command(epilog="\b\nExample:\n  pspf lag order-totals --state-dir ./state")
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

    The checkpoint comes from the app's state directory when it is reachable from here.
    """
    found: AppLag = service_for(obj, broker, state_dir, store).lag(app)
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
                _age(d.oldest_pending_age_s),
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
    preview = service.replay(app, topics, position, keep_state, dry_run=True)
    if keep_state:
        click.echo(
            f"warning: --keep-state: the {preview.entries_to_replay} replayed entries will be applied "
            "again onto the current state, which already holds their effects",
            err=True,
        )
    if not dry_run:
        if not yes:
            what = "keep" if keep_state else "DELETE"
            click.confirm(
                f"Replay {preview.entries_to_replay} entries of {', '.join(preview.topics)} to app {app} "
                f"from {preview.position} and {what} its state?",
                abort=True,
                err=True,
            )
        result = service.replay(app, topics, position, keep_state)
    else:
        result = preview
    if as_json:
        print_json(result)
        return
    verb = "would move" if dry_run else "moved"
    click.echo(
        f"{verb} app {result.app} to {result.position} in {', '.join(result.topics)} "
        f"({result.partitions} partition(s)): {result.entries_to_replay} entries to replay"
    )
    if result.superseded:
        click.echo(
            f"{result.superseded} of them were redriven from the DLQ later: they are skipped and "
            "their last redriven copies applied, as in the first run"
        )
    if result.state_reset:
        done = "would be" if dry_run else "were"
        click.echo(f"state and checkpoints {done} reset; run the app to rebuild the state")
    else:
        click.echo(f"checkpoints {'would be' if dry_run else 'were'} moved back; the state was kept")


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

        from admin_api import create_app
    except ImportError as exc:
        raise ConfigError(f"the admin API needs {exc.name}: pip install 'pspf[admin]'") from None
    service = service_for(obj, broker, state_dir, store)
    if not token:
        click.echo("admin API is read-only: no --token or PSPF_ADMIN_TOKEN, writes are refused", err=True)
    click.echo(f"admin API on http://{host}:{port} (OpenAPI: /schema, metrics: /metrics)", err=True)
    uvicorn.run(create_app(service, token=token or None), host=host, port=port, log_level="warning")
