"""Versioned tables: each key's rows by event time, kept for a retention, looked up as of a time.

A versioned table (``App.table(topic, versioned=RETENTION)``) keeps, beside each key's latest row,
its versions: (event time, the id of the entry that wrote it, the row or None for a delete), in
namespace ``__table_versions`` under "table/key". A lookup as of a time (``ctx.table(name,
at=ms)``, ``Stream.join_asof``) sees the version with the latest event time at or before it (of
two with one time, the later written), among those written by entries before the looking entry
in id order: so a retry and a replay see the same.

A key keeps every version of the last ``RETENTION`` of event time (counted back from its newest)
and the newest one before that, which was current at the start of it; a lookup further back than
that finds what was current then, or nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pspf.keys import StreamId

#: (event ms, writer id ms, writer id seq, row or None: deleted)
Version = tuple[int, int, int, bytes | None]

_decode = msgspec.msgpack.Decoder(list[tuple[int, int, int, bytes | None]]).decode
_encode = msgspec.msgpack.Encoder().encode


def decode(raw: bytes | None) -> list[Version]:
    return [] if raw is None else _decode(raw)


def as_of(versions: Iterable[Version], at_ms: int, before: StreamId | None) -> bytes | None:
    """The row current at ``at_ms`` among the versions written before the entry ``before`` (None: all).

    None when there is none, or when it is a delete.
    """
    best: Version | None = None
    for version in versions:
        event_ms, ms, seq, _ = version
        if event_ms > at_ms or (before is not None and (ms, seq) > before):
            continue
        if best is None or (event_ms, ms, seq) > best[:3]:
            best = version
    return None if best is None else best[3]


def merged(stored: bytes | None, new: list[Version], retention_ms: int) -> bytes | None:
    """A key's versions with ``new`` added and those past the retention dropped (None: none left)."""
    versions = sorted([*decode(stored), *new], key=lambda v: v[:3])
    cutoff = versions[-1][0] - retention_ms
    older = [v for v in versions if v[0] < cutoff]
    kept = [v for v in versions if v[0] >= cutoff]
    if older and older[-1][3] is not None:
        kept.insert(0, older[-1])  # current at the cutoff
    return _encode(kept) if kept else None
