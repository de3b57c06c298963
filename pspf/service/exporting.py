"""What `pspf state export` writes of a partition's store, and what an import keeps besides.

A store holds the app's state, what its code wrote or declared: state values, open windows
(with the closed sessions' marks and a sliding window's kept entries), table rows, scheduled
callbacks, and the stream time and timer periods they run on (``APP_STATE``). Beside it the cycle
keeps its bookkeeping: outbox rows and their marks, the consumers the checkpoints account for,
retries, entries on their way to the DLQ, foreign and superseded entries, when keys expire,
table history, a repartition's marks. An export writes the app's state; with ``internal``
(``--all``) the bookkeeping too, and each partition's checkpoints line says which it holds.

An import of the app's state alone keeps the bookkeeping of the partition's backup
(``kept_bookkeeping``): the outbox's sequence numbers, unpublished rows and the rest go on
as they were. It must be the bookkeeping of the same position, so the backup must be at the
export's checkpoints; an app the server does not know has none, and imports its state alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

from pspf import codec, keys
from pspf.errors import ConfigError, StateValueError
from pspf.keys import StreamId
from pspf.service.records import ExportCheckpoints, ExportValue

#: The namespaces of the app's state: what an export writes without ``--all``.
APP_STATE = frozenset(
    {
        keys.STATE_NAMESPACE,
        keys.WINDOWS_NAMESPACE,
        keys.TABLES_NAMESPACE,
        keys.SCHEDULES_NAMESPACE,
        keys.TIME_NAMESPACE,
    }
)

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[ExportCheckpoints | ExportValue] = msgspec.json.Decoder(
    ExportCheckpoints | ExportValue
)


def shown_state(key: str, raw: bytes) -> dict[str, Any]:
    """A stored state value as JSON shows it; StateValueError when it cannot be decoded or shown.

    Such a value can predate the check when a handler writes it, or be written by hand.
    """
    try:
        value = codec.state_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise StateValueError(f"stored state of key {key!r} cannot be decoded: {exc}") from None
    try:
        shown: dict[str, Any] = msgspec.to_builtins(value, str_keys=True)
    except (TypeError, RecursionError) as exc:
        raise StateValueError(f"stored state of key {key!r} cannot be shown as JSON: {exc}") from None
    return shown


def export_lines(
    app: str,
    partition: int,
    checkpoints: dict[str, StreamId],
    rows: Iterable[tuple[str, str, bytes]],
    warn: Callable[[str], None] | None,
    internal: bool,
) -> Iterator[bytes]:
    """The export lines of one store snapshot (see ``State.state_export``)."""
    yield _encoder.encode(
        ExportCheckpoints(
            partition=partition,
            checkpoints={t: str(c) for t, c in checkpoints.items()},
            internal=internal,
        )
    )
    for namespace, key, value in rows:
        if namespace == keys.BACKUP_NAMESPACE:
            continue  # which backup this store matches: meaningless in another store
        if not internal and namespace not in APP_STATE:
            continue
        line = ExportValue(partition=partition, namespace=namespace, key=key, value=value)
        if namespace == keys.STATE_NAMESPACE:
            try:
                line = msgspec.structs.replace(line, state=shown_state(key, value))
            except StateValueError as exc:
                line = msgspec.structs.replace(line, error=str(exc))
                if warn is not None:
                    warn(f"app {app!r} partition {partition}: {exc}; exported exactly, with state null")
        yield _encoder.encode(line)


def parse_export_line(number: int, raw: bytes) -> ExportCheckpoints | ExportValue:
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"line {number}: not a `pspf state export` line: {exc}") from None


def kept_bookkeeping(
    app: str,
    line: ExportCheckpoints,
    backup: tuple[dict[str, StreamId], dict[tuple[str, str], bytes]] | None,
    known: bool,
) -> list[tuple[str, str, bytes]]:
    """The bookkeeping of a partition's ``backup`` that an import of its app state alone keeps.

    ``known``: the server knows the app (it ran). Then its backup must be at the export's
    checkpoints, else ConfigError: bookkeeping of another position would not match the state.
    """
    head = (
        f"app {app!r} partition {line.partition}: the export holds the app's state without its "
        "bookkeeping (outbox, consumers, retries), which an import keeps from the partition's backup"
    )
    if backup is None:
        if known:
            raise ConfigError(
                f"{head}, but it has none (the backup is off, or an import dropped it): import an export "
                "made with --all"
            )
        return []
    checkpoints, values = backup
    if {t: str(c) for t, c in checkpoints.items()} != line.checkpoints:
        raise ConfigError(
            f"{head}, and the app moved on since the export (other checkpoints): stop it and "
            "export again, or import an export made with --all"
        )
    return [
        (namespace, key, value)
        for (namespace, key), value in sorted(values.items())
        if namespace not in APP_STATE and namespace != keys.BACKUP_NAMESPACE
    ]
