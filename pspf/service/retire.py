"""Retiring apps and topics: remove everything of them from the server.

A stopped app keeps its consumer group on every stream of its topics, and a group holds
retention (``pspf topic trim`` never trims past an app's checkpoint); its leases, members, state
backups and their logs, outbox replay requests and registry record stay in the server's memory.
``delete_app`` removes them all, and the app's views (``App.view``); the stores under its
workers' state dirs are theirs to delete.
``delete_topic`` removes a topic no app reads any more: its streams, DLQs and records.
"""

from __future__ import annotations

from pspf import keys
from pspf.errors import AppRunning
from pspf.ownership.membership import live_members
from pspf.ownership.operation_lease import one_at_a_time
from pspf.service.base import Family
from pspf.service.records import AppRemoval, TopicRemoval


class Retiring(Family):
    """Delete an app, or a topic."""

    @one_at_a_time("app delete")
    def delete_app(self, app: str, force: bool = False, dry_run: bool = False) -> AppRemoval:
        """Remove ``app`` from the server: refused while a worker of it is alive, unless ``force``.

        Raises:
            NotFound: the app never ran against this server.
            AppRunning: a worker of the app is a member, or holds a partition's lease.
        """
        keys.check_name("app", app)
        partitions = self.broker.apps.app_partitions(app)
        topics = self.broker.apps.app_topic_list(app)
        if not force:
            self.base.refuse_if_running(app, topics, partitions)
            members = live_members(self.broker.leases, app)
            if members:
                who = ", ".join(sorted(m.consumer for m in members))
                raise AppRunning(f"app {app!r} has live workers ({who}): stop them first, or pass --force")
        streams = [keys.stream_key(t, p) for t in topics for p in range(partitions)]
        groups = [s for s in streams if app in self.broker.topics.stream_info(s).groups]
        per_partition = [
            name
            for topic in topics
            for partition in range(partitions)
            for name in (
                keys.lease_key(topic, partition, app),
                keys.fence_key(topic, partition, app),
                *self.broker.acks.backup_keys(keys.backup_keys(topic, partition, app)),
            )
        ]
        per_app = [
            keys.members_key(app),
            keys.joined_key(app),
            keys.member_info_key(app),
            keys.outbox_replay_key(app),
            keys.outbox_replayed_key(app),
            keys.app_key(app),
            keys.savepoints_key(app),  # the list: the savepoints' files stay where they were written
            *self.broker.apps.app_views(app),
        ]
        found = self.broker.topics.existing_keys([*per_partition, *per_app])
        managed = self._managed_alone(app)
        if not dry_run:
            self.broker.apps.delete_app(app, groups, found)
            for topic in managed:
                self.delete_topic(topic)
        return AppRemoval(
            app=app,
            topics=topics,
            partitions=partitions,
            groups=groups,
            keys=found,
            dry_run=dry_run,
            managed_topics=managed,
        )

    def _managed_alone(self, app: str) -> list[str]:
        """The re-keying topics ``app`` created that exist and no other app reads: they go with it."""
        others = [other for other in self.broker.apps.list_apps() if other != app]
        alone = []
        for topic in self.broker.apps.app_managed(app):
            if not self.broker.topics.existing_keys([keys.topic_key(topic)]):
                continue
            if not any(topic in self.broker.apps.app_topics(other) for other in others):
                alone.append(topic)
        return alone

    def delete_topic(self, topic: str, dry_run: bool = False) -> TopicRemoval:
        """Remove ``topic``: its streams (entries, groups), DLQs, producer records and record.

        Refused while an app that ran here reads it (delete the app first).

        Raises:
            NotFound: no such topic.
            AppRunning: an app reads it.
        """
        keys.check_name("topic", topic)
        partitions = self.broker.topics.topic_partitions(topic)
        readers = [app for app in self.broker.apps.list_apps() if topic in self.broker.apps.app_topics(app)]
        if readers:
            raise AppRunning(
                f"topic {topic!r} is read by app {', '.join(readers)}: retire it first "
                f"(pspf app delete {readers[0]})"
            )
        # a repartition leaves a layout guard (and retired partitions' producer records) on each
        # partition the topic ever had ("guards")
        guarded = max(
            partitions, int(self.broker.moving.hash_fields(keys.topic_key(topic)).get("guards", "0"))
        )
        names = [
            name
            for partition in range(guarded)
            for name in (
                keys.stream_key(topic, partition),
                keys.dlq_key(topic, partition),
                keys.producers_key(topic, partition),
                keys.layout_key(topic, partition),
            )
        ]
        found = self.broker.topics.existing_keys([*names, keys.topic_key(topic), keys.schemas_key(topic)])
        if not dry_run:
            self.broker.topics.delete_topic(topic, found)
        return TopicRemoval(topic=topic, partitions=partitions, keys=found, dry_run=dry_run)
