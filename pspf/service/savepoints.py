"""Savepoints (``pspf.savepoint``): take, list, delete, and restore an app or a fork from one.

Each operation holds the operation lease of the app it changes (``ownership.operation_lease``):
a savepoint and a restore of one app never run at once, nor with a replay or a reset of it.
"""

from __future__ import annotations

import time

import msgspec

from pspf import keys
from pspf.errors import AppRunning, ConfigError, NotFound, ParameterError
from pspf.ownership.operation_lease import exclusive, one_at_a_time, this_process
from pspf.repartition.run import refuse_running
from pspf.savepoint import restoring, taking
from pspf.savepoint.manifest import Location, SavepointEntry
from pspf.service.base import Family


class SavepointTaken(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf app savepoint`` wrote."""

    app: str
    name: str
    #: the savepoint's directory: what ``pspf app restore --from`` takes
    path: str
    partitions: int
    #: keys of ``ctx.state``, and values of every kind (windows, timers, outbox rows, ...)
    keys: int
    values: int
    bytes: int
    #: taken from a stopped app (nothing in flight)
    stopped: bool
    resumed: bool
    seconds: float


class SavepointRestored(msgspec.Struct, frozen=True, kw_only=True):
    """What ``pspf app restore`` did (or, with ``dry_run``, would do)."""

    #: the app the savepoint was taken of, and the app put at its cut (a fork when another)
    app: str
    target: str
    source: str
    fork: bool
    #: "same": restored as saved; "split": split or merged by key into another partition count
    mode: str
    partitions_saved: int
    partitions: int
    keys: int
    values: int
    #: entries the target will handle after the cut (counted up to a limit per partition)
    entries_to_handle: int
    dry_run: bool
    resumed: bool
    seconds: float


class Savepoints(Family):
    """Savepoints of apps, and restores from them."""

    @one_at_a_time("savepoint")
    def take(
        self,
        app: str,
        url: str | None = None,
        name: str | None = None,
        resume: bool = False,
        stop: bool = False,
        timeout_s: float = 60.0,
    ) -> SavepointTaken:
        """Write a savepoint of ``app`` under ``url``/``name`` (``name``: the time it was taken).

        The app may run: each partition's cut is its last batch its state backup holds. ``stop``
        asks its workers to stop first (each finishes its batch, as on SIGTERM) and waits up to
        ``timeout_s`` for them; workers started while the savepoint is taken stop at once, and
        the request is taken back when it is done. ``resume`` takes again the savepoint a crash
        interrupted (its name and place are the server's).

        Raises:
            NotFound: the app never ran here; nothing to resume.
            StateOutOfReach: a partition has no state backup, or the app is a sink.
            ConfigError: a savepoint of that name exists; a bad name or URL.
        """
        started = time.perf_counter()
        if not self.broker.apps.app_topic_list(app):
            raise NotFound(f"app {app!r} has never run against this server: there is nothing to save")
        directory = self._where(app, url, name, resume)
        if stop:
            self.broker.apps.request_stop(app, f"a savepoint by {this_process()}")
        try:
            stopped = self._stopped(app, timeout_s if stop else 0.0)
            manifest = taking.take(
                self.broker,
                app,
                directory,
                directory.url.rpartition("/")[2],
                stopped,
                taking.crash_point("PSPF_SAVEPOINT_CRASH_AT"),
            )
        finally:
            if stop:
                self.broker.apps.request_stop(app, None)
        return SavepointTaken(
            app=app,
            name=manifest.name,
            path=directory.url,
            partitions=manifest.partitions,
            keys=manifest.keys,
            values=sum(part.values for part in manifest.parts),
            bytes=sum(part.size for part in manifest.parts),
            stopped=stopped,
            resumed=resume,
            seconds=round(time.perf_counter() - started, 3),
        )

    def listed(self, app: str) -> list[SavepointEntry]:
        """The savepoints of ``app`` the server knows of, oldest first."""
        keys.check_name("app", app)
        return taking.listed(self.broker, app)

    @one_at_a_time("savepoint delete")
    def delete(self, app: str, name: str, dry_run: bool = False) -> SavepointEntry:
        """Delete the savepoint ``name`` of ``app``: its directory and the server's entry."""
        found = {entry.name: entry for entry in taking.listed(self.broker, app)}
        entry = found.get(name)
        if entry is None:
            raise NotFound(f"app {app!r} has no savepoint named {name!r} (pspf app savepoints {app})")
        if not dry_run:
            Location(entry.path).remove()
            taking.forget(self.broker, app, name)
        return entry

    def restore(
        self,
        app: str,
        source: str | None = None,
        as_app: str | None = None,
        partitions: int | None = None,
        dry_run: bool = False,
        resume: bool = False,
    ) -> SavepointRestored:
        """Put ``app`` (or the fork ``as_app``) at the savepoint in ``source``; it must be stopped.

        ``partitions``: the count the operator expects the topics to have now (refused otherwise).
        ``resume`` finishes a restore whose switch a crash interrupted.

        Raises:
            NotFound: no savepoint at ``source``; nothing to resume.
            AppRunning: a worker of the target runs.
            StateOutOfReach: the streams no longer hold the entries after the saved positions.
            ConfigError: the fork's name exists; the topics have another count than ``partitions``,
                or were repartitioned more than once since.
            UnderWay: another operation on the target runs, or a restore of it was interrupted.
        """
        started = time.perf_counter()
        target = keys.check_name("app", as_app or app)
        if dry_run:
            return self._restore(app, target, source, partitions, dry_run, resume, started)
        with exclusive(self.broker, target, "restore", self.settings.consumer.lease_ttl_ms):
            return self._restore(app, target, source, partitions, dry_run, resume, started)

    def _restore(
        self,
        app: str,
        target: str,
        source: str | None,
        partitions: int | None,
        dry_run: bool,
        resume: bool,
        started: float,
    ) -> SavepointRestored:
        crash_at = taking.crash_point("PSPF_RESTORE_CRASH_AT") if not dry_run else (lambda step: None)
        if resume:
            plan = restoring.recorded(self.broker, target)
            if plan is None:
                raise NotFound(f"no restore of app {target!r} to resume: run it again without --resume")
            if source is not None and Location(source).url != plan.source:
                raise ConfigError(f"the restore of {target!r} under way is from {plan.source}, not {source}")
            if partitions is not None and partitions != plan.partitions:
                raise ConfigError(
                    f"the restore of {target!r} under way restores {plan.partitions} partitions"
                )
            refuse_running(self.broker, target, plan.topics, plan.partitions)
            if not dry_run:
                restoring.switch(self.broker, plan, crash_at)
            return _restored(plan, "resumed", 0, 0, 0, dry_run, True, started)
        if source is None:
            raise ParameterError("give the savepoint to restore from ({from})")
        directory = Location(source)
        done = restoring.prepare(self.broker, directory, app, target, partitions, not dry_run, crash_at)
        if not dry_run:
            restoring.switch(self.broker, done.plan, crash_at)
        return _restored(
            done.plan, done.mode, done.keys, done.values, done.to_handle, dry_run, False, started
        )

    def _where(self, app: str, url: str | None, name: str | None, resume: bool) -> Location:
        """The savepoint's directory: a new one under ``url``, or the one a crash left unfinished."""
        entries = {entry.name: entry for entry in taking.listed(self.broker, app)}
        if resume:
            unfinished = [e for e in entries.values() if e.state == "taking" and name in (None, e.name)]
            if not unfinished:
                raise NotFound(f"no savepoint of app {app!r} to resume: take one without --resume")
            return Location(unfinished[-1].path)
        if url is None:
            raise ParameterError("give where to write the savepoint ({to})")
        name = keys.check_name("savepoint", name or taking.default_name(int(time.time() * 1000)))
        if name in entries:
            raise ConfigError(
                f"app {app!r} has a savepoint named {name!r} already ({entries[name].path}): choose "
                f"another name, or delete it first (pspf app savepoint {app} --delete {name})"
            )
        return Location(url).child(name)

    def _stopped(self, app: str, wait_s: float) -> bool:
        """Whether no worker of the app runs, waiting up to ``wait_s`` for them to stop.

        Raises:
            AppRunning: one still runs after a wait.
        """
        topics = self.broker.apps.app_topic_list(app)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                refuse_running(self.broker, app, topics, self.broker.apps.app_partitions(app))
                return True
            except AppRunning as exc:
                if wait_s <= 0:
                    return False
                if time.monotonic() > deadline:
                    raise AppRunning(
                        f"{exc.args[0].partition(':')[0]} {wait_s:g}s after it was asked to stop: "
                        "no savepoint was taken"
                    ) from None
            time.sleep(0.1)


def _restored(
    plan: restoring.RestorePlan,
    mode: str,
    state_keys: int,
    values: int,
    to_handle: int,
    dry_run: bool,
    resumed: bool,
    started: float,
) -> SavepointRestored:
    return SavepointRestored(
        app=plan.app,
        target=plan.target,
        source=plan.source,
        fork=plan.target != plan.app,
        mode=mode,
        partitions_saved=plan.saved_partitions,
        partitions=plan.partitions,
        keys=state_keys,
        values=values,
        entries_to_handle=to_handle,
        dry_run=dry_run,
        resumed=resumed,
        seconds=round(time.perf_counter() - started, 3),
    )
