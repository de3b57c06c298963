"""What every family of the service stands on: its settings, its broker, and the shared checks.

``ServiceBase`` holds the settings, whether state is read from the stores here instead of the
backups in Redis (``local_state``), and one ``Broker`` (connected on first use; one pool, shared by
the admin API's request threads). The checks more than one family makes live here: a topic's or
app's partition count, a partition's state backup keys, a value of a key's partition, refusing
while the app runs; so do the helpers several families use: reading a whole stream by pages,
parsing a duration or a time. ``Family`` is what each family is built on: it holds the base, and
the base's broker and settings, which its methods read.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import msgspec

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import AppRunning, NotFound, ParameterError
from pspf.keys import BACKUP_IDENTITY, StreamId
from pspf.partition.backup import field
from pspf.settings import Settings
from pspf.state_stores import open_store

#: Any JSON value (a produced line, an owner's reply to an outbox replay).
json_any = msgspec.json.Decoder()


class ServiceBase:
    """The service's state and the checks its families share; each family holds it."""

    def __init__(self, settings: Settings, local_state: bool = False) -> None:
        self.settings = settings
        #: Read state from the stores under the state directory, not from the backups in Redis.
        self.local_state = local_state
        # Connects on first use; one pool, shared by the admin API's request threads.
        self.broker = Broker(settings.redis)

    def close(self) -> None:
        self.broker.close()

    def topic_partitions(self, topic: str) -> int:
        """The partition count of a topic named by a user: a malformed name is their mistake."""
        return self.broker.topics.topic_partitions(keys.check_name("topic", topic))

    def app_partitions(self, app: str) -> int:
        """The app's partition count, 0 when it never ran against this broker."""
        try:
            return self.broker.apps.app_partitions(app)
        except NotFound:
            return 0

    def backup_keys(self, app: str, partition: int) -> keys.BackupKeys | None:
        """The keys of a partition's state backup, None when it has none (the backup is off)."""
        first = self.broker.apps.app_topic_list(app)[:1]
        if not first:
            return None
        backup = keys.backup_keys(first[0], partition, app)
        return backup if self.broker.acks.backup_meta(backup.meta).get(BACKUP_IDENTITY) else None

    def partition_value(self, app: str, key: str, namespace: str, name: str) -> bytes | None:
        """A value of the store of ``key``'s partition: from its backup in Redis (any machine).

        Without a backup (it is off), or when the service reads local state, from the partition's
        store here, read without locking it.
        """
        partition = keys.partition_for(codec.encode_text("key", key), self.broker.apps.app_partitions(app))
        backup = None if self.local_state else self.backup_keys(app, partition)
        if backup is not None:
            return self.broker.acks.backup_value(backup, field(namespace, name))
        state = self.settings.state
        with open_store(state.engine, state.dir, app, partition, readonly=True) as store:
            return store.get(namespace, name)

    def refuse_if_running(self, app: str, topics: list[str], partitions: int) -> None:
        """Refuse (``AppRunning``) while a worker holds a lease of one of the app's partitions."""
        leases = [keys.lease_key(t, p, app) for t in topics for p in range(partitions)]
        held = self.broker.leases.lease_holders(leases)
        owners = sorted({owner for owner in held if owner is not None})
        if owners:
            raise AppRunning(f"app {app!r} is running ({', '.join(owners)} holds leases): stop it first")


class Family:
    """A family of the service's operations: it holds the shared base, never the ``Service``.

    ``broker`` and ``settings`` are the base's, kept here too: the families' methods and
    ``one_at_a_time`` (the operation lease) read them on every call.
    """

    def __init__(self, base: ServiceBase) -> None:
        self.base = base
        self.broker = base.broker
        self.settings = base.settings


def stream_entries(
    broker: Broker, stream: str, after: StreamId | None = None, page_size: int = 500
) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of one stream (a DLQ, or a partition's), after ``after``, in id order.

    ``Requests.dlq_range`` is a plain XRANGE, read ``page_size`` entries at a time.
    """
    start = "-" if after is None or after == keys.ZERO_ID else str(after.next())
    while True:
        page = broker.requests.dlq_range(stream, start, "+", page_size)
        yield from page
        if len(page) < page_size:
            return
        start = str(StreamId.parse(page[-1][0]).next())


def parse_duration_ms(text: str, param: str) -> int:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"`` or ``"500ms"`` in milliseconds.

    ``param`` names the parameter that gave ``text``, for the error.
    """
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
    for unit in ("ms", "s", "m", "h", "d"):
        number = text[: -len(unit)]
        if text.endswith(unit) and number.isdigit():
            return int(number) * units[unit]
    problem = f"invalid duration {text!r}: use a number and ms, s, m, h or d (e.g. 7d)"
    raise ParameterError.invalid(param, problem)


def parse_time_ms(text: str, param: str) -> int:
    """A time given as ISO 8601 (UTC unless it names an offset) or unix milliseconds, in ms.

    ``param`` names the parameter that gave ``text``, for the error.
    """
    if text.isdigit() and text.isascii():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        problem = f"invalid time {text!r}: use ISO 8601 (2026-11-21T10:00:00Z) or unix milliseconds"
        raise ParameterError.invalid(param, problem) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    # Exact: timestamp() * 1000 is a float, and 00:00:01.003 would come out as 1002 ms.
    return (moment - _EPOCH) // timedelta(milliseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
