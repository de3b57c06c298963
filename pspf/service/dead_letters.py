"""The DLQ: list, show, redrive and purge a topic's dead letters, and count them per app.

A DLQ id is ``PARTITION:ID`` (the DLQ stream's entry id), as ``pspf dlq list`` prints it. A
redrive moves each entry in one atomic call, so running it twice moves each entry once; the
entry gains headers naming its redrive count, its original id and the app that dead-lettered it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from pspf import codec, keys
from pspf.broker import Broker
from pspf.errors import ConfigError, DecodeError, NotFound, ParameterError
from pspf.failures import DeadLetter
from pspf.keys import ORIGINAL_ID_HEADER, REDRIVE_APP_HEADER, REDRIVE_COUNT_HEADER, StreamId
from pspf.service.base import Family, stream_entries
from pspf.service.records import DeadLetterDetail, DeadLetterInfo, DlqChange


class DeadLetters(Family):
    """DLQ operations over a topic's partitions."""

    def _dead_letters(self, topic: str) -> Iterator[tuple[int, bytes, DeadLetter]]:
        """Every DLQ entry of ``topic``, partition by partition, in id order."""
        for partition in range(self.base.topic_partitions(topic)):
            for entry_id, fields in stream_entries(self.broker, keys.dlq_key(topic, partition)):
                yield partition, entry_id, DeadLetter.from_fields(fields)

    def dlq_list(
        self, topic: str, app: str | None = None, error_type: str | None = None, limit: int | None = None
    ) -> list[DeadLetterInfo]:
        """DLQ entries of ``topic``, optionally of one app or error type, at most ``limit``."""
        found = []
        for partition, entry_id, record in self._dead_letters(topic):
            if (app and record.app != app) or (error_type and record.error_type != error_type):
                continue
            found.append(DeadLetterInfo.of(partition, entry_id, record))
            if limit is not None and len(found) >= limit:
                break
        return found

    def dlq_show(self, topic: str, dlq_id: str) -> DeadLetterDetail:
        partition, entry_id = parse_dlq_id(dlq_id)
        if partition >= self.base.topic_partitions(topic):
            raise NotFound(f"topic {topic!r} has no partition {partition}")
        page = self.broker.requests.dlq_range(
            keys.dlq_key(topic, partition), entry_id.decode(), entry_id.decode(), 1
        )
        if not page:
            raise NotFound(f"no DLQ entry {dlq_id} in topic {topic!r}")
        return DeadLetterDetail.of(dlq_id, DeadLetter.from_fields(page[0][1]))

    def _select(
        self,
        topic: str,
        ids: Sequence[str],
        all_entries: bool,
        error_type: str | None,
        app: str | None,
        older_than_ms: int | None,
        offered: Sequence[str],
    ) -> list[tuple[int, bytes, DeadLetter]]:
        """The DLQ entries ``ids`` name, or those of a selection; ``offered`` names its parameters."""
        if ids and (all_entries or error_type or older_than_ms is not None):
            raise ParameterError(f"give {{ids}} or a selection ({_alternatives(offered)}), not both")
        if not ids and not (all_entries or error_type or app or older_than_ms is not None):
            raise ParameterError(f"nothing selected: give {_alternatives(['ids', *offered])}")
        if ids:
            wanted = {parse_dlq_id(i) for i in ids}
            selected = [(p, e, r) for p, e, r in self._dead_letters(topic) if (p, e) in wanted]
            missing = wanted - {(p, e) for p, e, _ in selected}
            if missing:
                names = ", ".join(sorted(f"{p}:{e.decode()}" for p, e in missing))
                raise NotFound(f"no DLQ entry {names} in topic {topic!r}")
            return selected
        cutoff = None if older_than_ms is None else int(time.time() * 1000) - older_than_ms
        return [
            (p, e, r)
            for p, e, r in self._dead_letters(topic)
            if (not error_type or r.error_type == error_type)
            and (not app or r.app == app)
            and (cutoff is None or r.last_failed_ms < cutoff)
        ]

    def dlq_redrive(
        self,
        topic: str,
        ids: Sequence[str] = (),
        all_entries: bool = False,
        error_type: str | None = None,
        app: str | None = None,
        limit: int | None = None,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> DlqChange:
        """Put selected DLQ entries back into their source partitions (DEAD -> PENDING).

        Each entry moves in one atomic call (added to its partition, removed from the DLQ), so a
        redrive run twice, or killed and run again, moves each entry once. The entry keeps its
        key, value and headers and gains headers with its redrive count, its original id and the
        app that dead-lettered it (only that app runs it again).
        """
        offered = ["all", "error_type", "app"]
        selected = self._select(topic, ids, all_entries, error_type, app, None, offered)[:limit]
        moved = 0
        for partition, entry_id, record in selected:
            if not dry_run:
                fields = _redrive_fields(record)
                stream = keys.stream_key(topic, partition)
                if (
                    self.broker.requests.redrive(keys.dlq_key(topic, partition), stream, entry_id, fields)
                    is not None
                ):
                    moved += 1
            if progress is not None:
                progress(1)
        return DlqChange(selected=len(selected), changed=moved, dry_run=dry_run)

    def dlq_purge(
        self,
        topic: str,
        ids: Sequence[str] = (),
        all_entries: bool = False,
        older_than_ms: int | None = None,
        dry_run: bool = False,
    ) -> DlqChange:
        """Delete selected DLQ entries for good."""
        selected = self._select(topic, ids, all_entries, None, None, older_than_ms, ["all", "older_than"])
        deleted = 0
        if not dry_run:
            by_partition: dict[int, list[bytes]] = {}
            for partition, entry_id, _ in selected:
                by_partition.setdefault(partition, []).append(entry_id)
            for partition, entry_ids in by_partition.items():
                deleted += self.broker.requests.dlq_delete(keys.dlq_key(topic, partition), entry_ids)
        return DlqChange(selected=len(selected), changed=deleted, dry_run=dry_run)


class DeadLetterCounts:
    """DLQ entries per app of each topic partition, each DLQ read once (it is shared by apps)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._counts: dict[tuple[str, int], Counter[str]] = {}

    def of(self, topic: str, partition: int, app: str) -> int:
        counts = self._counts.get((topic, partition))
        if counts is None:
            counts = self._counts[(topic, partition)] = self._read(keys.dlq_key(topic, partition))
        return counts[app]

    def _read(self, dlq: str) -> Counter[str]:
        return Counter(fields.get(b"app", b"").decode() for _, fields in stream_entries(self.broker, dlq))


def parse_dlq_id(dlq_id: str) -> tuple[int, bytes]:
    """``"2:1700000000000-0"`` -> (partition 2, the DLQ stream's entry id)."""
    partition, sep, entry_id = dlq_id.partition(":")
    if not sep or not partition.isascii() or not partition.isdigit():
        raise ConfigError(f"invalid DLQ id {dlq_id!r}: expected PARTITION:ID as `pspf dlq list` prints it")
    return int(partition), str(StreamId.parse(entry_id)).encode()


def _alternatives(params: Sequence[str]) -> str:
    """``{a}, {b} or {c}``: a ``ParameterError`` template naming each of ``params``."""
    named = [f"{{{p}}}" for p in params]
    return f"{', '.join(named[:-1])} or {named[-1]}" if len(named) > 1 else "".join(named)


def _redrive_fields(record: DeadLetter) -> dict[bytes, bytes]:
    fields = dict(record.original)
    try:
        headers = codec.decode_headers(fields.get(codec.HEADERS))
    except DecodeError:
        headers = {}
    count = headers.get(REDRIVE_COUNT_HEADER, "0")
    headers[REDRIVE_COUNT_HEADER] = str((int(count) if count.isdigit() else 0) + 1)
    headers[ORIGINAL_ID_HEADER] = record.source_id
    headers[REDRIVE_APP_HEADER] = record.app
    fields[codec.HEADERS] = codec.json_encoder.encode(headers)
    return fields
