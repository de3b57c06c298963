"""The ``pspf`` command: the root group, shared options, error handling and ``pspf run``."""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from pspf.app import App
from pspf.errors import ConfigError, PSPFError
from pspf.service import Service
from pspf.settings import Settings
from pspf.worker import Worker

F = TypeVar("F", bound=Callable[..., Any])

EPILOG = """\b
Examples:
  pspf topic create orders --partitions 4
  pspf produce orders --key u1 '{"amount": 3}'
  pspf run examples.order_totals:main --until-idle
  pspf state get order-totals u1 --json
"""


class CliState:
    """What the root group hands its commands: verbosity and the settings overrides."""

    def __init__(self, verbose: int) -> None:
        self.verbose = verbose

    def settings(self, overrides: dict[str, Any]) -> Settings:
        return Settings.load(overrides)


class PSPFGroup(click.Group):
    """Turns a PSPFError into one line on stderr and its exit code (a traceback only with -v)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PSPFError as exc:
            verbose = isinstance(ctx.obj, CliState) and ctx.obj.verbose > 0
            if verbose:
                traceback.print_exc()
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exc.exit_code)


def broker_option(func: F) -> F:
    return click.option(
        "--broker",
        envvar="PSPF_BROKER",
        show_envvar=True,
        help="Redis/Valkey URL: redis://, rediss:// (TLS) or unix://  [default: redis://127.0.0.1:6379/0]",
    )(func)


def state_dir_option(func: F) -> F:
    return click.option(
        "--state-dir",
        envvar="PSPF_STATE_DIR",
        show_envvar=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Directory of the state stores  [default: ./state]",
    )(func)


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


@click.group(cls=PSPFGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging; tracebacks on errors.")
@click.version_option(package_name="pspf")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """PSPF: stateful stream processing on Redis and Valkey Streams."""
    ctx.obj = CliState(verbose)
    logging.basicConfig(
        level=logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@cli.command(epilog="\b\nExample:\n  pspf run examples.order_totals:main --state-dir ./state --until-idle")
@click.argument("target")
@broker_option
@state_dir_option
@click.option(
    "--durability",
    envvar="PSPF_DURABILITY",
    show_envvar=True,
    type=click.Choice(["normal", "fsync"]),
    help="normal survives a killed process; fsync also survives power loss  [default: normal]",
)
@click.option(
    "--batch-size",
    envvar="PSPF_BATCH_SIZE",
    show_envvar=True,
    type=int,
    help="Entries read per stream per cycle  [default: 1000]",
)
@click.option(
    "--block-ms",
    envvar="PSPF_BLOCK_MS",
    show_envvar=True,
    type=int,
    help="How long one read waits for new entries  [default: 1000]",
)
@click.option(
    "--consumer",
    envvar="PSPF_CONSUMER",
    show_envvar=True,
    help="This worker's consumer name in the group  [default: the host name]",
)
@click.option(
    "--start-from",
    envvar="PSPF_START_FROM",
    show_envvar=True,
    type=click.Choice(["earliest", "latest"]),
    help="Where a new consumer group starts reading  [default: earliest]",
)
@click.option(
    "--lease-ttl-ms",
    envvar="PSPF_LEASE_TTL_MS",
    show_envvar=True,
    type=int,
    help="Partition lease time to live; a dead worker's partitions move after it  [default: 10000]",
)
@click.option(
    "--retry-delay-ms",
    envvar="PSPF_RETRY_DELAY_MS",
    show_envvar=True,
    type=int,
    help="Wait before a failed entry is tried again  [default: 1000]",
)
@click.option(
    "--until-idle",
    envvar="PSPF_UNTIL_IDLE",
    show_envvar=True,
    is_flag=True,
    help="Stop once no partition of the app has anything left to read.",
)
@click.pass_obj
def run(obj: CliState, /, target: str, until_idle: bool, **options: Any) -> None:
    """Run the app TARGET (module:attribute) until SIGINT/SIGTERM.

    TARGET names an App, or a function without arguments that returns one.
    """
    settings = obj.settings(
        {
            "PSPF_BROKER": options["broker"],
            "PSPF_STATE_DIR": str(options["state_dir"]) if options["state_dir"] else None,
            "PSPF_DURABILITY": options["durability"],
            "PSPF_BATCH_SIZE": options["batch_size"],
            "PSPF_BLOCK_MS": options["block_ms"],
            "PSPF_CONSUMER": options["consumer"],
            "PSPF_START_FROM": options["start_from"],
            "PSPF_LEASE_TTL_MS": options["lease_ttl_ms"],
            "PSPF_RETRY_DELAY_MS": options["retry_delay_ms"],
        }
    )
    if obj.verbose == 0:
        logging.getLogger("pspf").setLevel(logging.INFO)
    app = load_app(target)
    worker = Worker(app, settings)
    with worker.signals_handled():
        summary = worker.run(until_idle=until_idle)
    click.echo(
        f"processed {summary.handled} entries ({summary.skipped} already done, {summary.failed} failures)",
        err=True,
    )


def load_app(target: str) -> App:
    """Import ``module:attribute`` (from the current directory too) and return its App."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"target {target!r} must look like MODULE:ATTRIBUTE, e.g. app:main")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"cannot import module {module_name!r}: no such module") from exc
        raise ConfigError(f"importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(found, App) and callable(found):
        found = _call_factory(target, found)
    if not isinstance(found, App):
        raise ConfigError(
            f"{target} is a {type(found).__name__}, not a pspf.App (or a function returning one)"
        )
    return found


def _call_factory(target: str, factory: Callable[..., Any]) -> Any:
    try:
        required = [
            p
            for p in inspect.signature(factory).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required:
        raise ConfigError(
            f"{target} takes arguments; point pspf run at an App or a function without arguments"
        )
    try:
        return factory()
    except PSPFError:
        raise
    except Exception as exc:
        raise ConfigError(f"calling {target} failed: {type(exc).__name__}: {exc}") from exc


def service_for(obj: CliState, broker: str | None, state_dir: Path | None = None) -> Service:
    return Service(
        obj.settings({"PSPF_BROKER": broker, "PSPF_STATE_DIR": str(state_dir) if state_dir else None})
    )
