"""Operations the CLI, the admin API and its web page share, written once, returning msgspec records.

The CLI and the admin API are thin faces over ``Service``; each operation lives here once. A
``Service`` holds the shared base (``service.base``, ``base``: settings, broker, the checks more
than one family makes) and one object per family of operations, each holding that base, as a
``Broker`` holds its connection and its families; importers use ``Service``, the records and the
parsers re-exported here:

- ``service.topics`` (``topics``): create, list, describe, retention and trimming of topics;
  producing; health;
- ``service.reading`` (``topic_read``): reading and following a topic's entries, without a
  consumer group;
- ``service.dlq`` (``dead_letters``): a topic's DLQ: list, show, redrive, purge, and counts per app;
- ``service.apps`` (``apps``): the apps that ran, their lag, owners and members;
- ``service.replay`` (``replay``): delivering a stopped app's entries again, rewinding its state to
  match, and resetting an app to the start or the end of its topics;
- ``service.repartition`` (``repartition``): changing a topic's partition count, with every app's
  state;
- ``service.retire`` (``retire``): deleting an app from the server (its groups, leases, backups,
  record), or a topic;
- ``service.state`` (``state``): an app's state: get, windows, keys, export, import, adopt;
- ``service.tables`` (``tables``): a row of an app's table or global table;
- ``service.outbox`` (``outbox``): an app's outbox rows: list, show, replay;
- ``service.ingest`` (``ingest``): writing a batch of entries once per idempotency key;
- ``service.schemas`` (``schemas``): a topic's schema versions: set (compatibility checked), show,
  history;
- ``service.savepoints`` (``savepoints``): an app's savepoints: take, list, delete, and restore the
  app or a fork from one.

``Service`` itself keeps the two calls the docs' tests and examples make, ``create_topic`` and
``state_get``, and ``close``. The records the families return live in ``records`` (one shape for
the CLI's JSON and the admin API's bodies), and ``wording`` words the counts in their messages
(``1 entry``, ``3 entries``).
"""

from __future__ import annotations

from typing import Any

from pspf.contracts.registry import SchemaVersion
from pspf.service.apps import Apps
from pspf.service.base import ServiceBase, parse_duration_ms
from pspf.service.dead_letters import DeadLetterCounts, DeadLetters, parse_dlq_id
from pspf.service.ingest import IngestEntry, Ingesting, IngestResult
from pspf.service.outbox import OutboxRows, parse_row_id
from pspf.service.records import (
    AdoptResult,
    AppLag,
    AppMember,
    AppRemoval,
    AppReset,
    DeadLetterDetail,
    DeadLetterInfo,
    DlqChange,
    ExportCheckpoints,
    ExportValue,
    GroupInfo,
    Health,
    ImportResult,
    OpenWindow,
    OutboxReplay,
    OutboxRowDetail,
    OutboxRowInfo,
    PartitionInfo,
    PartitionLag,
    RepartitionResult,
    ReplayResult,
    TopicDescription,
    TopicEntry,
    TopicInfo,
    TopicRemoval,
    TopicTrim,
)
from pspf.service.repartition import Repartitioning
from pspf.service.replay import Replaying, parse_position
from pspf.service.retire import Retiring
from pspf.service.savepoints import SavepointRestored, Savepoints, SavepointTaken
from pspf.service.schemas import Schemas
from pspf.service.state import State
from pspf.service.tables import Tables
from pspf.service.topic_read import Positions, TopicReading, parse_read_start
from pspf.service.topics import Topics
from pspf.settings import Settings

__all__ = [
    "AdoptResult",
    "AppLag",
    "AppMember",
    "AppRemoval",
    "AppReset",
    "DeadLetterCounts",
    "DeadLetterDetail",
    "DeadLetterInfo",
    "DlqChange",
    "ExportCheckpoints",
    "ExportValue",
    "GroupInfo",
    "Health",
    "ImportResult",
    "IngestEntry",
    "IngestResult",
    "OpenWindow",
    "OutboxReplay",
    "OutboxRowDetail",
    "OutboxRowInfo",
    "PartitionInfo",
    "PartitionLag",
    "Positions",
    "RepartitionResult",
    "ReplayResult",
    "SavepointRestored",
    "SavepointTaken",
    "Savepoints",
    "SchemaVersion",
    "Schemas",
    "Service",
    "ServiceBase",
    "TopicDescription",
    "TopicEntry",
    "TopicInfo",
    "TopicRemoval",
    "TopicTrim",
    "parse_dlq_id",
    "parse_duration_ms",
    "parse_position",
    "parse_read_start",
    "parse_row_id",
]


class Service:
    """Topic, produce and state operations over one broker and one state directory, by family.

    Composed, not inherited: each family holds the shared base and the service holds them all,
    so nothing refers back to the service. ``settings`` and ``broker`` are the base's, kept here
    too for those who produce or look at Redis beside it (tests, benchmarks).
    """

    def __init__(self, settings: Settings, local_state: bool = False) -> None:
        self.base = base = ServiceBase(settings, local_state)
        self.settings = settings
        self.broker = base.broker
        self.topics = Topics(base)
        self.reading = TopicReading(base)
        self.dlq = DeadLetters(base)
        self.apps = Apps(base)
        self.replay = Replaying(base)
        self.retire = Retiring(base)
        self.outbox = OutboxRows(base)
        self.repartition = Repartitioning(base, self.outbox)
        self.state = State(base)
        self.tables = Tables(base)
        self.ingest = Ingesting(base)
        self.schemas = Schemas(base)
        self.savepoints = Savepoints(base)

    def create_topic(self, name: str, partitions: int) -> tuple[TopicInfo, bool]:
        """``service.topics.create_topic``, kept here for the tests and examples the docs show."""
        return self.topics.create_topic(name, partitions)

    def state_get(self, app: str, key: str) -> dict[str, Any]:
        """``service.state.state_get``, kept here for the tests and examples the docs show."""
        return self.state.state_get(app, key)

    def close(self) -> None:
        self.base.close()
