"""Ingest: a batch of entries written to a topic over HTTP, each once per idempotency key.

The request's idempotency key names a producer (``http/LAYOUT/KEY``) and its entries are numbered
from 1 in the order given; ``pspf.source.appending`` appends them through the publishing script,
which records the last number per partition in the same call. A retry with the same key (a lost
answer, a client timeout) adds none of them twice and says how many were already there. Entries
without a key go to partition ``(number - 1) % P``, so a retry routes them the same way.

Each key leaves one field in the producers hash of each partition its entries reached, kept until
the topic is deleted (nothing trims producer records): keys are meant to be unique per request,
and a client sending millions of requests grows those hashes by that many fields. A key holds
within one partition layout: a retry after ``pspf topic repartition`` of the topic may add its
entries again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from pspf import codec, keys
from pspf.errors import ParameterError
from pspf.service.base import Family
from pspf.source.appending import Appender, Row

#: The most entries one request may carry (one round trip of publishing calls).
MAX_INGEST = 10_000
#: What an idempotency key may be: 1 to 200 printable ASCII characters, no spaces.
IDEMPOTENCY_KEY_PATTERN = r"^[!-~]{1,200}$"


class IngestEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry to write: its value (any JSON), its key (none: spread by its place), headers."""

    key: Annotated[str | None, msgspec.Meta(description="the partition and state key; null: none")] = None
    value: Annotated[Any, msgspec.Meta(description="the entry's value, any JSON")]
    headers: Annotated[dict[str, str] | None, msgspec.Meta(description="string headers")] = None


class IngestResult(msgspec.Struct, frozen=True, kw_only=True):
    """What an ingest request did: entries added now, and entries an earlier try had added."""

    topic: str
    idempotency_key: str
    added: int
    already: int


class Ingesting(Family):
    """Writing entries once per idempotency key (the admin API's ingest route)."""

    def ingest(self, topic: str, entries: Sequence[IngestEntry], idempotency_key: str) -> IngestResult:
        """Write ``entries`` to ``topic``; a repeat with the same ``idempotency_key`` adds none twice.

        Raises:
            ConfigError: a malformed topic name or idempotency key, too many entries, or a key
                or header that is not UTF-8 text.
            NotFound: the topic does not exist.
            BrokerError: Redis is unreachable or refused a write (some entries may be in: the
                same request again adds the others).
        """
        keys.check_name("topic", topic)
        if not (
            0 < len(idempotency_key) <= 200 and idempotency_key.isascii() and idempotency_key.isprintable()
        ):
            raise ParameterError.invalid("idempotency_key", "give 1 to 200 printable ASCII characters")
        if " " in idempotency_key:
            raise ParameterError.invalid("idempotency_key", "no spaces")
        if len(entries) > MAX_INGEST:
            raise ParameterError(
                "{entries}: {count} entries, at most {most} per request", count=len(entries), most=MAX_INGEST
            )
        rows = []
        for number, entry in enumerate(entries, start=1):
            fields = codec.entry_fields(codec.encode_value(entry.value), entry.key, entry.headers)
            rows.append(Row(number, fields.get(codec.KEY), fields))
        appender = Appender(self.broker, topic, producer=lambda layout: f"http/{layout}/{idempotency_key}")
        appender.append(rows)
        return IngestResult(
            topic=topic, idempotency_key=idempotency_key, added=appender.added, already=appender.already
        )
