"""Apps (consumer groups): which have run, and where each stands: lag, pending, owners, members.

The figures come from the server (the groups, leases and live members) and, when the app's state
directory is reachable from here, the committed checkpoints of its stores (read without locking).
``groups`` lists every app, an app it cannot read with the error instead of failing for all.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pspf import keys
from pspf.errors import BrokerError, BrokerUnavailable, NotFound, StateError
from pspf.keys import StreamId
from pspf.ownership.membership import live_members
from pspf.service.base import Family
from pspf.service.dead_letters import DeadLetterCounts
from pspf.service.records import AppLag, AppMember, PartitionLag, text_or_none
from pspf.state_stores import open_store, stored_partitions


class Apps(Family):
    """Health, apps, lag and groups."""

    def apps(self) -> list[str]:
        """The apps that have run against this broker."""
        return self.broker.apps.list_apps()

    def asyncapi(self, app: str) -> dict[str, Any]:
        """The app's AsyncAPI document, as its last worker recorded it (``pspf docs`` makes it too).

        Raises:
            NotFound: no worker of the app recorded one.
        """
        keys.check_name("app", app)
        raw = self.broker.apps.app_asyncapi(app)
        if raw is None:
            raise NotFound(f"app {app!r} has no AsyncAPI document yet: its workers record it when they start")
        document: dict[str, Any] = msgspec.json.decode(raw)
        return document

    def lag(self, app: str, dead_letters: DeadLetterCounts | None = None) -> AppLag:
        """Per topic partition of ``app``: newest id, checkpoint, lag, pending, owner, DLQ entries.

        ``dead_letters`` shares the DLQ counts between the apps of one ``groups`` call.
        """
        keys.check_name("app", app)
        counts = dead_letters if dead_letters is not None else DeadLetterCounts(self.broker)
        partitions = self.broker.apps.app_partitions(app)
        topics = sorted(self.broker.apps.app_topics(app))
        checkpoints = self._checkpoints(app, partitions)
        owners = self.broker.leases.lease_holders(
            [keys.lease_key(t, p, app) for t in topics for p in range(partitions)]
        )
        now_ms = time.time() * 1000
        detail = []
        for index, (topic, partition) in enumerate((t, p) for t in topics for p in range(partitions)):
            position = self.broker.topics.group_position(keys.stream_key(topic, partition), app)
            oldest = position.oldest_pending_id
            checkpoint = checkpoints.get(partition, {}).get(topic)
            detail.append(
                PartitionLag(
                    topic=topic,
                    partition=partition,
                    last_id=text_or_none(position.last_id),
                    delivered_id=text_or_none(position.delivered_id),
                    checkpoint=None if checkpoint is None else str(checkpoint),
                    lag=position.lag,
                    pending=position.pending,
                    oldest_pending_age_s=None
                    if oldest is None
                    else max(0.0, (now_ms - StreamId.parse(oldest).ms) / 1000),
                    owner=owners[index],
                    consumers=position.consumers,
                    dead_letters=counts.of(topic, partition, app),
                )
            )
        ages = [d.oldest_pending_age_s for d in detail if d.oldest_pending_age_s is not None]
        return AppLag(
            app=app,
            topics=topics,
            partitions=partitions,
            lag=sum(d.lag for d in detail),
            pending=sum(d.pending for d in detail),
            oldest_pending_age_s=max(ages) if ages else None,
            owners=sorted({d.owner for d in detail if d.owner is not None}),
            dead_letters=sum(d.dead_letters for d in detail),
            detail=detail,
            consumers=max((d.consumers for d in detail), default=0),
            members=[
                AppMember.of(m, sorted({d.partition for d in detail if d.owner == m.id}))
                for m in sorted(live_members(self.broker.leases, app), key=lambda m: (m.joined_ms, m.id))
            ],
        )

    def groups(self) -> list[AppLag]:
        """Every app that has run against this broker, with its lag."""
        counts = DeadLetterCounts(self.broker)
        found = []
        for app in self.apps():
            try:
                found.append(self.lag(app, counts))
            except BrokerUnavailable:
                raise
            except (BrokerError, NotFound, StateError) as exc:
                found.append(AppLag.failed(app, sorted(self.broker.apps.app_topics(app)), str(exc)))
        return found

    def _checkpoints(self, app: str, partitions: int) -> dict[int, dict[str, StreamId]]:
        """The committed checkpoints of each partition store found here (read without locking)."""
        state = self.settings.state
        found: dict[int, dict[str, StreamId]] = {}
        for partition in stored_partitions(state.engine, state.dir, app):
            if partition < partitions:
                try:
                    store = open_store(state.engine, state.dir, app, partition, readonly=True)
                except NotFound:
                    continue  # its worker is creating it: nothing committed yet
                with store:
                    found[partition] = store.checkpoints()
        return found
