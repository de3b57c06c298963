"""One operation at a time: leases an operator's command holds while it runs, renewed from a thread.

``app reset``, ``app delete`` and ``replay`` of an app each move its groups and rewind or delete
its backups in several steps; two of them at once could leave groups at one position and
checkpoints at another (entries skipped or applied twice). Each holds the app's operation lease
(``operation_key``, taken with SET NX) while it runs: a second one is refused
in one line naming the first (``UnderWay``, exit 6). ``pspf topic repartition`` holds its own
claim per topic (``pspf.repartition.claim``) with the same renewal (``Renewal``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ParamSpec, Protocol, TypeVar

from pspf import keys
from pspf.broker import Broker
from pspf.errors import BrokerError, UnderWay
from pspf.settings import Settings

log = logging.getLogger("pspf.operation_lease")

P = ParamSpec("P")
R = TypeVar("R")


def operation_key(app: str) -> str:
    """The lease of the operation running on ``app`` (the app's hash tag)."""
    return f"{keys.PREFIX}:operation:{{{app}}}"


def this_process() -> str:
    """The host and process id, as a lease names its holder."""
    return f"{socket.gethostname()} pid {os.getpid()}"


class Renewal:
    """Renews leases every third of their time to live until stopped; ``lost`` once one is gone."""

    def __init__(self, broker: Broker, leases: Sequence[tuple[str, str]], ttl_ms: int) -> None:
        self.broker = broker
        self.leases = list(leases)
        self.ttl_ms = ttl_ms
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                renewed = self.broker.leases.renew_leases(self.leases, self.ttl_ms)
            except BrokerError as exc:
                log.warning("renewing the leases %s failed: %s", [k for k, _ in self.leases], exc)
                continue
            if not all(renewed):
                self.lost = True
                return


@contextmanager
def exclusive(broker: Broker, app: str, what: str, ttl_ms: int) -> Iterator[None]:
    """Hold ``app``'s operation lease while the block runs; refuse (``UnderWay``) while another holds it."""
    key = operation_key(app)
    value = f"{what} by {this_process()}|{uuid.uuid4().hex[:12]}"
    if not broker.moving.set_if_absent(key, value, ttl_ms):
        holder = broker.leases.lease_holders([key])[0] or "another operation"
        raise UnderWay(
            f"{holder} is under way on app {app!r}: wait for it to end (if that process is gone, "
            f"its lease lapses {ttl_ms / 1000:g}s after it stopped)"
        )
    renewal = Renewal(broker, [(key, value)], ttl_ms)
    renewal.start()
    try:
        yield
    finally:
        renewal.stop()
        broker.leases.release_leases([(key, value)])


class _Operator(Protocol):
    broker: Broker
    settings: Settings


def one_at_a_time(what: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run a service method ``(self, app, ...)`` holding the app's operation lease (a dry run needs none)."""

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = signature.bind(*args, **kwargs).arguments
            service: Any = bound["self"]
            if bound.get("dry_run"):
                return method(*args, **kwargs)
            operator: _Operator = service
            app = keys.check_name("app", bound["app"])
            with exclusive(operator.broker, app, what, operator.settings.consumer.lease_ttl_ms):
                return method(*args, **kwargs)

        return run

    return decorate
