"""Repartitioning a topic (``pspf.repartition.run``): planned, run, resumed or aborted, or shown as a dry run.

A run claims its topics before it reads anything (``pspf.repartition.claim``): a second command
is refused while the first runs, and an interrupted one is taken up by ``--resume`` or undone by
``--abort``.
"""

from __future__ import annotations

import time

from pspf.errors import BrokerOutOfMemory, ConfigError, NotFound, ParameterError
from pspf.repartition import claim as repartition_claim
from pspf.repartition import run as repartition
from pspf.service.base import Family, ServiceBase
from pspf.service.outbox import OutboxRows
from pspf.service.records import RepartitionResult

_NOTHING = repartition.Summary({}, {}, 0)


class Repartitioning(Family):
    """Change a topic's partition count, with every app's state.

    Holds the outbox family too: apps whose outbox holds rows are refused (they do not move).
    """

    def __init__(self, base: ServiceBase, outbox: OutboxRows) -> None:
        super().__init__(base)
        self.outbox = outbox

    def repartition_topic(
        self,
        topic: str,
        partitions: int | None = None,
        dry_run: bool = False,
        resume: bool = False,
        abort: bool = False,
    ) -> RepartitionResult:
        """Move ``topic`` (and the topics read with it) to ``partitions``; the apps must be stopped.

        ``resume`` finishes a repartition a crash interrupted (``partitions`` may be left out);
        ``abort`` undoes one that has not begun its switch (its staged copies are deleted).

        Raises:
            NotFound: no such topic, or nothing to resume or abort.
            ConfigError: a bad count, or an abort of a repartition that began its switch.
            UnderWay: another command runs a repartition of the topics, or one is interrupted
                (without ``resume`` or ``abort``).
            AppRunning: a worker of an app of the topics is alive.
            BrokerOutOfMemory: the server filled up; the message says how to resume or abort.
        """
        started = time.perf_counter()
        ttl_ms = self.settings.consumer.lease_ttl_ms
        if abort:
            if resume:
                raise ParameterError("give {resume} or {abort}, not both")
            plan = (
                self._to_abort(topic, ttl_ms)
                if dry_run
                else repartition_claim.abort(self.broker, topic, ttl_ms)
            )
            return _result(topic, plan, _NOTHING, started, dry_run, aborted=True)
        if dry_run:
            plan = self._planned(topic, partitions, resume, ttl_ms)
            shown = repartition.dry_run(self.broker, plan) if plan.step == "planned" else _NOTHING
            return _result(topic, plan, shown, started, dry_run, resumed=plan.step if resume else None)
        if resume:
            claim = repartition_claim.take_recorded(self.broker, topic, ttl_ms)
        elif partitions is None:
            raise ConfigError("give the new partition count (--partitions N)")
        else:
            claim = repartition_claim.take_new(self.broker, topic, partitions, ttl_ms)
        with claim:
            plan = claim.plan
            resumed = plan.step if resume else None
            if resume:
                _check_count(topic, plan, partitions)
                repartition.check_stopped(self.broker, plan)
            else:
                self._refuse_outbox_rows(plan.apps)
            run = repartition.Repartition(self.broker, plan, claim.checked(repartition.crash_point()))
            try:
                run.run()
            except BrokerOutOfMemory as exc:
                raise BrokerOutOfMemory(
                    f"{exc}; the repartition of {topic!r} stopped at its {plan.step} step: free memory "
                    f"(raise maxmemory) and run `pspf topic repartition {topic} --resume`, or undo it "
                    f"with `pspf topic repartition {topic} --abort`"
                ) from exc
        return _result(topic, plan, run.summary or _NOTHING, started, dry_run, resumed=resumed)

    def _planned(self, topic: str, partitions: int | None, resume: bool, ttl_ms: int) -> repartition.Plan:
        """The plan a dry run shows: the one under way (``resume``), or a new one (not recorded)."""
        if resume:
            plan = repartition.recorded(self.broker, topic)
            if plan is None:
                raise NotFound(f"no repartition of topic {topic!r} to resume")
            _check_count(topic, plan, partitions)
            repartition.check_stopped(self.broker, plan)
            return plan
        refused = repartition_claim.under_way(self.broker, topic, ttl_ms)
        if refused is not None:
            raise refused
        if partitions is None:
            raise ConfigError("give the new partition count (--partitions N)")
        plan = repartition.make_plan(self.broker, topic, partitions)
        self._refuse_outbox_rows(plan.apps)
        return plan

    def _to_abort(self, topic: str, ttl_ms: int) -> repartition.Plan:
        """The plan an abort would undo (a dry run changes nothing)."""
        plan = repartition.recorded(self.broker, topic) or repartition_claim.aborting_plan(self.broker, topic)
        if plan is None:
            raise NotFound(f"no repartition of topic {topic!r} to abort")
        return plan

    def _refuse_outbox_rows(self, apps: list[str]) -> None:
        """Refuse apps whose outbox holds rows: they are numbered per partition and do not move."""
        for app in apps:
            try:
                states = [
                    state
                    for state in ("pending", "claimed", "dead")
                    if self.outbox.outbox_list(app, state, limit=1)
                ]
            except NotFound:
                continue  # no outbox
            if states:
                raise ConfigError(
                    f"app {app!r} has outbox rows not published ({', '.join(states)}): run it until "
                    f"idle so its relay publishes them (dead rows: pspf outbox replay {app} --dead "
                    "while it runs), then repartition"
                )


def _check_count(topic: str, plan: repartition.Plan, partitions: int | None) -> None:
    if partitions is not None and partitions != plan.new:
        raise ConfigError(
            f"the repartition under way moves {topic!r} to {plan.new} partitions, not {partitions}"
        )


def _result(
    topic: str,
    plan: repartition.Plan,
    summary: repartition.Summary,
    started: float,
    dry_run: bool,
    resumed: str | None = None,
    aborted: bool = False,
) -> RepartitionResult:
    return RepartitionResult(
        topic=topic,
        topics=plan.topics,
        apps=plan.apps,
        partitions_before=plan.old,
        partitions_after=plan.new,
        entries=summary.entries,
        to_handle=summary.to_handle,
        state_keys=summary.state_keys,
        resumed=resumed,
        dry_run=dry_run,
        seconds=round(time.perf_counter() - started, 3),
        aborted=aborted,
    )
