"""The ``pspf`` command: the root group, shared options, error handling and ``pspf run``."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from pspf.cli.render import json_option, print_json
from pspf.cli.supervisor import Supervisor
from pspf.cli.targets import load_app
from pspf.errors import ConfigError, ParameterError, PSPFError
from pspf.service import Service
from pspf.service.wording import counted
from pspf.settings import Settings
from pspf.state_stores import file_engines
from pspf.worker import RunSummary, Worker, default_consumer_name

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

    def __init__(self, verbose: int = 0) -> None:
        self.verbose = verbose
        #: settings given by options that commands do not see themselves (the TLS files)
        self.options: dict[str, Any] = {}

    def settings(self, overrides: dict[str, Any]) -> Settings:
        return Settings.load({**self.options, **overrides}, spelled=given_flags())


def given_flags() -> dict[str, str]:
    """The settings the running command was given as flags: variable name -> flag.

    A setting's flag reads its variable too (click's ``envvar``), so only the parameter's
    source tells whether a bad value is to be named by the flag or by the variable.
    """
    spelled: dict[str, str] = {}
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        for param in ctx.command.params:
            if (
                isinstance(param, click.Option)
                and isinstance(param.envvar, str)
                and param.name is not None
                and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE
            ):
                spelled.setdefault(param.envvar, max(param.opts, key=len))
        ctx = ctx.parent
    return spelled


#: Where ``ctx.meta`` holds the arguments the command was given (after the program name).
ARGS_KEY = "pspf.args"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: int) -> None:
    """Log at WARNING, INFO with -v, DEBUG with -vv; the first call sets the format up.

    Where logging has handlers already (a test runner's), only -v changes the level.
    """
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format=LOG_FORMAT)
    elif verbose:
        root.setLevel(level)


def _count_verbose(ctx: click.Context, param: click.Parameter, value: int) -> None:
    if value:
        obj = ctx.ensure_object(CliState)
        obj.verbose += value
        configure_logging(obj.verbose)


def verbose_option() -> click.Option:
    """``-v``/``--verbose``, which every group and command takes, before or after its name.

    The counts add up over the command line: ``pspf -v run ... -v`` is ``-vv``.
    """
    return click.Option(
        ["-v", "--verbose"],
        count=True,
        expose_value=False,
        callback=_count_verbose,
        help="More logging (-vv: debug); tracebacks on errors.",
    )


def flag_of(command: click.Command, name: str) -> str:
    """How ``command`` spells the parameter the service names ``name``: its option or argument."""
    dashed = "--" + name.replace("_", "-")
    for param in command.params:
        if param.name == name or dashed in param.opts:
            if isinstance(param, click.Argument):
                return param.human_readable_name
            return max(param.opts, key=len)
    return dashed


class PSPFCommand(click.Command):
    """A subcommand: takes ``-v``, and names a ``ParameterError``'s parameters by its own flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(verbose_option())

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ParameterError as exc:
            raise ConfigError(exc.phrase(lambda name: flag_of(self, name))) from exc


class PSPFGroup(click.Group):
    """Turns a PSPFError into one line on stderr and its exit code (a traceback only with -v).

    A reader that closed the pipe (``pspf state export APP | head -5``) ends the command quietly
    with exit 0: it has what it wanted, and a ``set -o pipefail`` script goes on. Exit 0, not
    141 as for coreutils that SIGPIPE ends, because a large output written at once ends the same
    way without an error to see (CPython reports a short write, not the broken pipe).

    Its subcommands are ``PSPFCommand``s and its subgroups ``PSPFGroup``s, so each of them takes
    ``-v`` too and phrases parameter errors with its own flags.
    """

    command_class = PSPFCommand
    group_class = type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.params.append(verbose_option())

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Kept for ``pspf run --workers``, whose children run the same command line.
        ctx.meta.setdefault(ARGS_KEY, list(args))
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PSPFError as exc:
            verbose = isinstance(ctx.obj, CliState) and ctx.obj.verbose > 0
            if verbose:
                traceback.print_exc()
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except BrokenPipeError:
            _discard_stdout()
            ctx.exit(0)


def _discard_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the closed pipe goes nowhere.

    Without this the interpreter's flush at exit fails again and prints that it did.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout is no file (a test runner's buffer): nothing is flushed into a pipe


#: The TLS options that come with --broker: (flag, help). Their values go to CliState.options, not
#: to the command, so every command that reaches the broker takes them without naming them.
TLS_OPTIONS: list[tuple[str, str]] = [
    ("--tls-ca-file", "CA certificate(s), PEM, to verify a rediss:// server with  [default: the system's]"),
    ("--tls-cert-file", "Client certificate, PEM, for servers that ask for one (mutual TLS)"),
    ("--tls-key-file", "Private key, PEM, of --tls-cert-file when that file does not hold it"),
]


def _remember_setting(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is not None and isinstance(ctx.obj, CliState):
        ctx.obj.options[_env_name(param.opts[0])] = value


def broker_option(func: F) -> F:
    for flag, text in reversed(TLS_OPTIONS):
        func = click.option(
            flag,
            envvar=_env_name(flag),
            show_envvar=True,
            metavar="FILE",
            help=text,
            expose_value=False,
            callback=_remember_setting,
        )(func)
    return click.option(
        "--broker",
        envvar="PSPF_BROKER",
        show_envvar=True,
        help="Redis/Valkey URL: redis://, rediss:// (TLS), unix://, redis+cluster://HOST:PORT,... or "
        "redis+sentinel://HOST:PORT,.../MASTER  [default: redis://127.0.0.1:6379/0]",
    )(func)


def state_dir_option(func: F) -> F:
    return click.option(
        "--state-dir",
        envvar="PSPF_STATE_DIR",
        show_envvar=True,
        type=click.Path(file_okay=False, path_type=Path),
        help="Directory of the state stores  [default: the user's data directory, "
        "~/.local/share/pspf/state or $XDG_DATA_HOME/pspf/state on Linux]",
    )(func)


class EngineChoice(click.Choice[str]):
    """``--store``'s choices: the store engines registered when the CLI reads them."""

    def __init__(self) -> None:
        super().__init__(file_engines())

    @property  # type: ignore[override]
    def choices(self) -> list[str]:
        return file_engines()

    @choices.setter
    def choices(self, _given: Any) -> None:
        """Click sets its list at construction; the registry's list is read each time instead."""


def store_option(func: F) -> F:
    return click.option(
        "--store",
        envvar="PSPF_STORE",
        show_envvar=True,
        type=EngineChoice(),
        help="State store engine the app runs with  [default: sqlite]",
    )(func)


@click.group(cls=PSPFGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pspf")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """PSPF: stateful stream processing on Redis and Valkey Streams."""
    configure_logging(ctx.ensure_object(CliState).verbose)


#: The options of ``pspf run`` that map to a setting: (flag, type, help). Each flag's variable is
#: PSPF_ and its name in capitals, the same table ``Settings.load`` reads.
RUN_OPTIONS: list[tuple[str, Any, str]] = [
    (
        "--store",
        EngineChoice(),
        "State store engine; rocksdb needs pspf[rocksdb]  [default: sqlite]",
    ),
    (
        "--durability",
        click.Choice(["normal", "fsync"]),
        "normal survives a killed process; fsync also survives power loss  [default: normal]",
    ),
    ("--batch-size", int, "Entries read per stream per cycle  [default: 1000]"),
    ("--block-ms", int, "How long one read waits for new entries  [default: 1000]"),
    ("--linger-ms", int, "After a read that filled no batch, wait this long to read again  [default: 0]"),
    ("--consumer", str, "This worker's consumer name in the group  [default: the host name]"),
    (
        "--start-from",
        click.Choice(["earliest", "latest"]),
        "Where a new consumer group starts reading  [default: earliest]",
    ),
    (
        "--lease-ttl-ms",
        int,
        "Partition lease time to live; a dead worker's partitions move after it  [default: 10000]",
    ),
    ("--min-idle-ms", int, "Entries other consumers left idle this long are taken over  [default: 60000]"),
    ("--wait-replicas", int, "Replicas that must have each acknowledgement (WAIT)  [default: 0]"),
    ("--wait-timeout-ms", int, "How long an acknowledgement waits for them  [default: 1000]"),
    ("--max-retries", int, "Attempts of a failing entry before the DLQ  [default: 3]"),
    ("--retry-base-ms", int, "Backoff before the first retry  [default: 200]"),
    ("--retry-factor", float, "Backoff growth per attempt  [default: 2.0]"),
    ("--retry-max-ms", int, "Longest backoff  [default: 30000]"),
    (
        "--retry-mode",
        click.Choice(["ordered", "deferred"]),
        "ordered: the partition waits for the retry (per-key order kept); deferred: the entry is "
        "parked and the partition goes on (per-key order not kept)  [default: ordered]",
    ),
    (
        "--max-deliveries",
        int,
        "Deliveries after which an entry that never completes (it may crash the worker) goes to "
        "the DLQ  [default: 5]",
    ),
    ("--handler-timeout-ms", int, "A handler running longer fails that attempt  [default: none]"),
    (
        "--state-backup",
        click.Choice(["on", "off"]),
        "Keep each partition's state in Redis too, so it follows the partition to any machine; "
        "off: one machine with a lasting disk, and a missing or stale store is refused  [default: on]",
    ),
    (
        "--state-backup-buckets",
        int,
        "Hashes each partition's backup spreads its values over: about (keys per partition) / 100 "
        "keeps many small values compact in Redis; a change re-uploads each backup once  [default: 1]",
    ),
    (
        "--standby/--no-standby",
        bool,
        "Keep the stores of partitions other workers own following their backups, so a "
        "takeover needs no full restore (true/false in the variable)  [default: off]",
    ),
    (
        "--metrics-port",
        int,
        "Serve Prometheus metrics on /metrics and health on /healthz at this port (0: any free "
        "port)  [default: none, no server]",
    ),
    (
        "--metrics-host",
        str,
        "Interface of the metrics server; 0.0.0.0 lets Prometheus scrape from other machines  "
        "[default: 127.0.0.1]",
    ),
    (
        "--stuck-after-s",
        float,
        "/healthz reports stuck when an owned partition has lag and nothing was committed for "
        "it this long  [default: 60]",
    ),
]


def _env_name(flag: str) -> str:
    return "PSPF_" + flag.partition("/")[0].lstrip("-").replace("-", "_").upper()


def worker_options(leave_out: tuple[str, ...] = ()) -> Callable[[F], F]:
    """The options of ``RUN_OPTIONS`` but those whose flag starts with one of ``leave_out``."""

    def add(func: F) -> F:
        for flag, kind, text in reversed(RUN_OPTIONS):
            if not flag.startswith(leave_out):
                func = click.option(
                    flag, envvar=_env_name(flag), show_envvar=True, type=kind, help=text, default=None
                )(func)
        return func

    return add


run_options = worker_options()


@cli.command(epilog="\b\nExample:\n  pspf run examples.order_totals:main --until-idle")
@click.argument("target")
@broker_option
@state_dir_option
@run_options
@click.option(
    "--until-idle",
    envvar="PSPF_UNTIL_IDLE",
    show_envvar=True,
    is_flag=True,
    help="Stop once no partition of the app has anything left to read.",
)
@click.option(
    "--workers",
    envvar="PSPF_WORKERS",
    show_envvar=True,
    type=int,
    default=1,
    callback=lambda _ctx, _param, value: _at_least_one(value),
    help="Worker processes on this machine, under a supervisor that restarts those that crash; "
    "up to the partition count, more stand by  [default: 1]",
)
@click.pass_context
def run(ctx: click.Context, /, target: str, until_idle: bool, workers: int, **options: Any) -> None:
    """Run the app TARGET (module:attribute) until SIGINT/SIGTERM.

    TARGET names an App, or a function without arguments that returns one.
    """
    obj: CliState = ctx.obj
    settings = run_settings(obj, options)
    app = load_app(target)  # with --workers too: a bad target fails once, here, not in each child
    if workers > 1:
        consumer = settings.consumer.consumer_name or default_consumer_name()
        args = ctx.meta.get(ARGS_KEY, sys.argv[1:])
        ctx.exit(Supervisor(args, workers, consumer).run())
    worker = Worker(app, settings)
    click.echo(f"state dir: {os.path.abspath(settings.state.dir)}", err=True)
    with worker.signals_handled():
        summary = worker.run(until_idle=until_idle)
    click.echo(run_summary(summary), err=True)


@cli.command(epilog="\b\nExample:\n  pspf describe examples.dataflow:main")
@click.argument("target")
@json_option
def describe(target: str, as_json: bool) -> None:
    """Print the topology of the app TARGET (module:attribute): its topics, steps and outputs.

    Nothing connects to a server: this reads the app's declarations only.
    """
    app = load_app(target)
    app.compile()
    found = app.describe()
    if as_json:
        print_json(found)
        return
    click.echo(f"app {found['app']}: reads {', '.join(found['topics'])}")
    for topic, func in found["handlers"].items():
        click.echo(f"  handler {func} on {topic}")
    for name, window in found["windows"].items():
        click.echo(f"  window {name} on {window['topic']} ({window['kind']}) -> {window['emit_to']}")
    for kind in ("tables", "global_tables"):
        for topic in found[kind]:
            click.echo(f"  {kind[:-1].replace('_', ' ')} {topic}")
    for root in found["streams"]:
        managed = ", re-keying topic" if root["managed"] else ""
        click.echo(f"  stream {root['source']} ({root['value_type']}{managed})")
        _echo_steps(root["then"], "    ")
    if found["managed_topics"]:
        click.echo(f"re-keying topics: {', '.join(found['managed_topics'])}")
    if found["outputs"]:
        click.echo(f"outputs: {', '.join(found['outputs'])}")


def _echo_steps(steps: list[Any], indent: str) -> None:
    for step in steps:
        if isinstance(step, str):
            click.echo(f"{indent}{step}")
            continue
        aggregations = step.get("aggregations")
        shown = f" {', '.join(f'{k}={v}' for k, v in aggregations.items())}" if aggregations else ""
        click.echo(f"{indent}{step['step']}{shown}")
        _echo_steps(step["then"], indent + "  ")


def run_settings(obj: CliState, options: dict[str, Any]) -> Settings:
    """The settings of a worker from its ``worker_options``, ``--broker`` and ``--state-dir``; INFO logs."""
    overrides = {
        _env_name(flag): options.get(flag.partition("/")[0].lstrip("-").replace("-", "_"))
        for flag, _, _ in RUN_OPTIONS
    }
    overrides["PSPF_BROKER"] = options["broker"]
    overrides["PSPF_STATE_DIR"] = str(options["state_dir"]) if options.get("state_dir") else None
    if obj.verbose == 0:
        logging.getLogger("pspf").setLevel(logging.INFO)
    return obj.settings(overrides)


def run_summary(summary: RunSummary) -> str:
    """The last line of ``pspf run``: entries processed and dead-lettered, attempts retried.

    Entries and attempts are counted apart: an entry tried three times before the DLQ is one
    entry dead-lettered and two failed attempts retried (in order or parked). Entries late for
    a window (all their windows had closed) and dropped follow, by window, when there were any.
    """
    processed = counted(summary.handled, "entry")
    retried = counted(summary.retried + summary.parked, "failed attempt")
    line = (
        f"processed {processed} ({summary.skipped} already done), "
        f"{summary.dead_lettered} dead-lettered, {retried} retried"
    )
    if summary.late:
        by_window = ", ".join(f"{name} {late}" for name, late in sorted(summary.late_windows.items()))
        line += f"; {counted(summary.late, 'late entry', 'late entries')} dropped ({by_window})"
    return line


def _at_least_one(workers: int) -> int:
    if workers < 1:
        raise click.BadParameter(f"{workers}: give 1 or more (1 runs a single worker, no supervisor)")
    return workers


def service_for(
    obj: CliState, broker: str | None, state_dir: Path | None = None, store: str | None = None
) -> Service:
    settings = obj.settings(
        {"PSPF_BROKER": broker, "PSPF_STATE_DIR": str(state_dir) if state_dir else None, "PSPF_STORE": store}
    )
    # State is read from the backups in Redis unless a state directory is named.
    service = Service(settings, local_state=state_dir is not None)
    # Closed when the command ends, also when it fails: a failed command run in-process (a test,
    # a script calling the CLI) leaves no connection behind.
    click.get_current_context().call_on_close(service.close)
    return service


def confirm(question: str) -> None:
    """Ask on stderr; "no" aborts. Without a terminal nobody can answer, so the error names ``--yes``.

    Raises:
        ConfigError: stdin ended before an answer and is not a terminal (a script, a pipe, cron).
    """
    try:
        agreed = click.confirm(question, err=True)
    except click.Abort:  # end of input, or Ctrl-C at a terminal
        if sys.stdin is not None and not sys.stdin.isatty():
            click.echo(err=True)  # end the question's line
            raise ConfigError(f'cannot ask "{question}" without a terminal: pass --yes') from None
        raise
    if not agreed:
        raise click.Abort


def parse_headers(given: tuple[str, ...]) -> dict[str, str] | None:
    """``--header NAME=VALUE`` options as a dict (None when there are none)."""
    headers = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--header")
        headers[name] = value
    return headers or None
