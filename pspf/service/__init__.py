"""Operations the CLI, the admin API and its web page share, written once, returning msgspec records.

The CLI and the admin API are thin faces over ``Service``; each operation lives here once. The
operations come in families, one module each, composed into one ``Service`` over the shared
``ServiceBase`` (settings, broker, shared checks); importers use ``Service``, the records and the
parsers re-exported here, never the families:

- ``topics``: create, list, describe, retention and trimming of topics; producing; health;
- ``topic_read``: reading and following a topic's entries, without a consumer group;
- ``dead_letters``: a topic's DLQ: list, show, redrive, purge, and counts per app;
- ``apps``: the apps that ran, their lag, owners and members;
- ``replay``: delivering a stopped app's entries again, rewinding its state to match, and
  resetting an app to the start or the end of its topics;
- ``repartition``: changing a topic's partition count, with every app's state;
- ``retire``: deleting an app from the server (its groups, leases, backups, record), or a topic;
- ``state``: an app's state: get, windows, keys, export, import, adopt;
- ``tables``: a row of an app's table or global table;
- ``outbox``: an app's outbox rows: list, show, replay.

The records they return live in ``records`` (one shape for the CLI's JSON and the admin API's
bodies), and ``wording`` words the counts in their messages (``1 entry``, ``3 entries``).
"""

from __future__ import annotations

from pspf.service.apps import Apps
from pspf.service.base import ServiceBase, parse_duration_ms
from pspf.service.dead_letters import DeadLetterCounts, DeadLetters, parse_dlq_id
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
from pspf.service.state import State
from pspf.service.tables import Tables
from pspf.service.topic_read import Positions, TopicReading, parse_read_start
from pspf.service.topics import Topics

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
    "OpenWindow",
    "OutboxReplay",
    "OutboxRowDetail",
    "OutboxRowInfo",
    "PartitionInfo",
    "PartitionLag",
    "Positions",
    "RepartitionResult",
    "ReplayResult",
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


class Service(
    Topics, TopicReading, DeadLetters, Apps, Replaying, Retiring, Repartitioning, State, Tables, OutboxRows
):
    """Topic, produce and state operations over one broker and one state directory."""
