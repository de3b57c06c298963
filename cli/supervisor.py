"""``pspf run --workers N``: N worker processes of one app on this machine, kept running.

Each child is the same ``pspf run`` command line without ``--workers``, so every option and
variable applies to it as to a single worker, with a consumer name of its own (``NAME-i``) that it
gets back when it is restarted: the group's pending entries stay readable per child. The children
share the partitions with every other worker of the app through the leases and the membership, as
separate ``pspf run`` processes would; the supervisor only starts, restarts and stops them.

- A child that crashes (a signal, or an exit code other than 0 and 2) is started again with
  exponential backoff. Exit 2 is a bad argument or setting, the same for every child: restarting
  cannot help, so the supervisor stops all of them and exits 2. A child that exits 0 (it finished
  with ``--until-idle``, or someone stopped it) is not restarted.
- SIGTERM, SIGINT and SIGHUP are forwarded to the children as SIGTERM (each finishes its batch,
  commits, acknowledges, releases its partitions and exits 0); a child still running after the
  grace period is killed. A second signal kills the children at once (nothing committed is lost).
- The children run in process groups of their own, so a Ctrl-C in a terminal reaches them once,
  through the supervisor, instead of twice (a second signal would make them exit at once). So
  that a supervisor killed with SIGKILL leaves none running, each child watches its supervisor
  and stops (as on SIGTERM) when it is gone.
- Their output is passed through line by line: stderr with a ``[worker i pid P]`` prefix, stdout
  as it is.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any, TextIO

from pspf.errors import ConfigError

log = logging.getLogger("pspf.supervisor")

#: How often a child checks that its supervisor is still there.
_WATCH_S = 0.5

#: The exit code of a bad argument or setting (``ConfigError``, click's usage errors).
CONFIG_EXIT = 2
#: The signals that stop the supervisor gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_S = 0.1


@dataclass(frozen=True)
class Backoff:
    """Delays between restarts of a crashing child.

    Short at first, so a one-off crash costs little; growing, so a child that crashes at start
    does not spin.
    """

    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    #: A child that ran this long before it crashed starts over at ``first_s``.
    reset_after_s: float = 60.0

    def next(self, previous_s: float | None, ran_s: float) -> float:
        if previous_s is None or ran_s >= self.reset_after_s:
            return self.first_s
        return min(self.max_s, previous_s * self.factor)


def child_args(args: Sequence[str], consumer: str) -> list[str]:
    """The supervisor's own arguments for one child: without ``--workers``, with its consumer name.

    Any ``--consumer`` given is replaced by the child's own (``NAME-i``). Arguments after ``--``
    are positional and left alone.
    """
    end = list(args).index("--") if "--" in args else len(args)
    kept: list[str] = []
    i = 0
    while i < end:
        arg = args[i]
        if arg in ("--workers", "--consumer"):
            i += 2
            continue
        if not arg.startswith(("--workers=", "--consumer=")):
            kept.append(arg)
        i += 1
    return [*kept, "--consumer", consumer, *args[end:]]


def child_program(supervisor_pid: int) -> list[str]:
    """How a child is started: this interpreter and the ``pspf`` command.

    Independent of PATH and of how the supervisor itself was started (console script,
    ``python -c``, a test runner).
    """
    # The child imports the whole CLI itself: this module stays below it (no import circle).
    start = "from pspf.cli import cli; from pspf.cli.supervisor import child_main; "
    start += f"child_main({supervisor_pid}, cli)"
    return [sys.executable, "-c", start]


def child_main(supervisor_pid: int, cli: Callable[..., Any]) -> None:
    """Run ``cli`` (``pspf``) as a child that stops gracefully when its supervisor dies (even by SIGKILL)."""

    def watch() -> None:
        # Polled, not PR_SET_PDEATHSIG: that fires once per exiting thread of the supervisor, and
        # a second SIGTERM makes a worker exit at once instead of finishing its batch.
        while os.getppid() == supervisor_pid:
            time.sleep(_WATCH_S)
        # To the main thread, so that a blocking read there is interrupted at once.
        signal.pthread_kill(main, signal.SIGTERM)

    main = threading.get_ident()
    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
    cli(prog_name="pspf")


@dataclass
class Child:
    """One child slot: its index and consumer name stay, the process changes at each restart."""

    index: int
    consumer: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    backoff_s: float | None = None
    restart_at: float | None = None
    #: The last ``Error: ...`` line the current process printed (its reason for exit 2).
    last_error: str | None = None
    pumps: list[threading.Thread] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.proc is None and self.restart_at is None


class Supervisor:
    """Starts ``workers`` children, restarts those that crash, stops them all on a signal."""

    def __init__(
        self,
        args: Sequence[str],
        workers: int,
        consumer: str,
        *,
        grace_s: float = 30.0,
        backoff: Backoff | None = None,
        program: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.args = list(args)
        self.program = list(program or child_program(os.getpid()))
        self.grace_s = grace_s
        self.backoff = backoff or Backoff()
        env = dict(os.environ if environ is None else environ)
        env.pop("PSPF_WORKERS", None)  # a child is one worker
        self.env = env
        self.children = [Child(i, f"{consumer}-{i}") for i in range(1, workers + 1)]
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._write_lock = threading.Lock()
        self._signals: list[int] = []
        self._stop_deadline: float | None = None
        self._killed = False
        self._code = 0
        self._config_error: str | None = None

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Run until every child has exited; the exit code for the supervisor.

        Raises ConfigError (exit 2) when a child exited 2, after stopping the others.
        """
        previous = self._install_signals()
        try:
            for child in self.children:
                self._start(child)
            while not all(child.done for child in self.children):
                self._handle_signals()
                for child in self.children:
                    if child.proc is not None and child.proc.poll() is not None:
                        self._exited(child)
                    elif child.restart_at is not None and time.monotonic() >= child.restart_at:
                        self._start(child)
                self._enforce_grace()
                time.sleep(_POLL_S)
        finally:
            self._kill_all()  # only does something when the loop above failed
            for sig, handler in previous.items():
                if handler is not None:  # None: set outside Python, cannot be put back
                    signal.signal(sig, handler)
        if self._config_error is not None:
            raise ConfigError(self._config_error)
        if self._code == 0:
            log.info("all %s workers exited 0", len(self.children))
        return self._code

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.last_error = None
        try:
            proc = subprocess.Popen(
                [*self.program, *child_args(self.args, child.consumer)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                process_group=0,
            )
        except OSError as exc:
            log.error("worker %s could not be started: %s", child.index, exc)
            self._schedule_restart(child, ran_s=0.0)
            return
        child.proc, child.started = proc, time.monotonic()
        assert proc.stdout is not None and proc.stderr is not None
        prefix = f"[worker {child.index} pid {proc.pid}] ".encode()
        child.pumps = [
            self._pump(child, proc.stdout, self._stdout, b""),
            self._pump(child, proc.stderr, self._stderr, prefix),
        ]
        again = f" (restart {child.restarts})" if child.restarts else ""
        log.info("worker %s started pid=%s consumer=%s%s", child.index, proc.pid, child.consumer, again)

    def _exited(self, child: Child) -> None:
        proc = child.proc
        assert proc is not None and proc.returncode is not None
        code, ran_s = proc.returncode, time.monotonic() - child.started
        for pump in child.pumps:
            pump.join(timeout=2.0)  # its last lines (the error, the summary) first
        child.proc = None
        how = _exit_text(code)
        if self._stop_deadline is not None:
            # Stopping: a child killed by the forwarded SIGTERM had not set up its handlers yet,
            # so it held no batch: that is a clean stop too.
            clean = code == 0 or (code == -signal.SIGTERM and not self._killed)
            log.info("worker %s pid=%s %s after %.1fs", child.index, proc.pid, how, ran_s)
            if not clean and self._code == 0:
                self._code = 128 - code if code < 0 else code
        elif code == 0:
            log.info("worker %s pid=%s exited 0 after %.1fs; not restarted", child.index, proc.pid, ran_s)
        elif code == CONFIG_EXIT:
            reason = child.last_error or "bad arguments or settings"
            log.info("worker %s pid=%s exited 2: stopping every worker", child.index, proc.pid)
            self._config_error = f"worker {child.index} stopped on a configuration error: {reason}"
            self._begin_stop()
        else:
            self._schedule_restart(child, ran_s)
            log.warning(
                "worker %s pid=%s %s after %.1fs; restarting in %.1fs",
                child.index,
                proc.pid,
                how,
                ran_s,
                child.backoff_s,
            )

    def _schedule_restart(self, child: Child, ran_s: float) -> None:
        child.backoff_s = self.backoff.next(child.backoff_s, ran_s)
        child.restart_at = time.monotonic() + child.backoff_s
        child.restarts += 1

    # -- stopping -----------------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        for sig in STOP_SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: stay deaf to hangups, as the children are
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)  # acted on by the loop, never in the middle of a restart

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            name = _signal_name(signum)
            if self._stop_deadline is None:
                log.info("signal %s: stopping the workers (each finishes its batch in hand)", name)
                self._begin_stop()
            elif not self._killed:
                log.warning("signal %s again: killing the workers", name)
                self._code = 128 + signum
                self._kill_all()

    def _begin_stop(self) -> None:
        self._stop_deadline = time.monotonic() + self.grace_s
        for child in self.children:
            child.restart_at = None
            if child.proc is not None and child.proc.returncode is None:
                child.proc.send_signal(signal.SIGTERM)

    def _enforce_grace(self) -> None:
        if self._stop_deadline is None or self._killed or time.monotonic() < self._stop_deadline:
            return
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        if running:
            log.warning(
                "workers %s still running %.0fs after SIGTERM: killing them",
                ", ".join(str(c.index) for c in running),
                self.grace_s,
            )
            if self._code == 0:
                self._code = 1
            self._kill_all()

    def _kill_all(self) -> None:
        self._killed = True
        for child in self.children:
            child.restart_at = None
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
        for child in self.children:
            if child.proc is not None:
                code = child.proc.wait()
                log.info("worker %s pid=%s %s", child.index, child.proc.pid, _exit_text(code))
                for pump in child.pumps:
                    pump.join(timeout=2.0)
                child.proc = None

    # -- output -------------------------------------------------------------------------------

    def _pump(self, child: Child, pipe: IO[bytes], out: TextIO, prefix: bytes) -> threading.Thread:
        """Copy a child's output line by line.

        It keeps reading even when ``out`` fails, so a child never blocks on a full pipe.
        """

        def copy() -> None:
            with pipe:
                for line in iter(pipe.readline, b""):
                    if prefix and line.startswith(b"Error: "):
                        child.last_error = line[7:].decode(errors="replace").strip()
                    self._write(out, prefix + (line if line.endswith(b"\n") else line + b"\n"))

        thread = threading.Thread(target=copy, name=f"worker-{child.index}-output", daemon=True)
        thread.start()
        return thread

    def _write(self, out: TextIO, data: bytes) -> None:
        with self._write_lock:
            try:
                out.flush()
                buffer = getattr(out, "buffer", None)
                if buffer is not None:
                    buffer.write(data)
                    buffer.flush()
                else:
                    out.write(data.decode(errors="replace"))
                    out.flush()
            except (OSError, ValueError):
                pass  # our own output is gone (a closed pipe): the child must still be drained


def _exit_text(code: int) -> str:
    return f"was killed by {_signal_name(-code)}" if code < 0 else f"exited {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
