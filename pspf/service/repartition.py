"""Repartitioning a topic (``pspf.repartition``): planned, run or resumed, or shown as a dry run."""

from __future__ import annotations

import time

from pspf import repartition
from pspf.errors import ConfigError, NotFound
from pspf.records import RepartitionResult
from pspf.service.outbox import OutboxRows


class Repartitioning(OutboxRows):
    """Change a topic's partition count, with every app's state."""

    def repartition_topic(
        self, topic: str, partitions: int | None = None, dry_run: bool = False, resume: bool = False
    ) -> RepartitionResult:
        """Move ``topic`` (and the topics read with it) to ``partitions``; the apps must be stopped.

        ``resume`` finishes a repartition a crash interrupted (``partitions`` may be left out).

        Raises:
            NotFound: no such topic, or nothing to resume.
            ConfigError: a bad count, or one under way (without ``resume``).
            AppRunning: a worker of an app of the topics is alive.
        """
        started = time.perf_counter()
        under_way = repartition.recorded(self.broker, topic)
        if resume:
            if under_way is None:
                raise NotFound(f"no repartition of topic {topic!r} to resume")
            if partitions is not None and partitions != under_way.new:
                raise ConfigError(
                    f"the repartition under way moves {topic!r} to {under_way.new} partitions, "
                    f"not {partitions}"
                )
            plan = under_way
            repartition.check_stopped(self.broker, plan)
        elif under_way is not None:
            raise ConfigError(
                f"a repartition of {topic!r} to {under_way.new} partitions is under way ({under_way.step}): "
                f"finish it with `pspf topic repartition {topic} --resume`"
            )
        elif partitions is None:
            raise ConfigError("give the new partition count (--partitions N)")
        else:
            plan = repartition.make_plan(self.broker, topic, partitions)
            self._refuse_outbox_rows(plan.apps)
        to_handle, state_keys, entries = (
            repartition.dry_run(self.broker, plan) if plan.step == "planned" else ({}, {}, 0)
        )
        resumed = plan.step if resume else None
        if not dry_run:
            repartition.Repartition(self.broker, plan, repartition.crash_point()).run()
        return RepartitionResult(
            topic=topic,
            topics=plan.topics,
            apps=plan.apps,
            partitions_before=plan.old,
            partitions_after=plan.new,
            entries=entries,
            to_handle=to_handle,
            state_keys=state_keys,
            resumed=resumed,
            dry_run=dry_run,
            seconds=round(time.perf_counter() - started, 3),
        )

    def _refuse_outbox_rows(self, apps: list[str]) -> None:
        """Refuse apps whose outbox holds rows: they are numbered per partition and do not move."""
        for app in apps:
            try:
                states = [
                    state for state in ("pending", "claimed", "dead") if self.outbox_list(app, state, limit=1)
                ]
            except NotFound:
                continue  # no outbox
            if states:
                raise ConfigError(
                    f"app {app!r} has outbox rows not published ({', '.join(states)}): run it until "
                    f"idle so its relay publishes them (dead rows: pspf outbox replay {app} --dead "
                    "while it runs), then repartition"
                )
