"""Reading an object's rows one at a time: JSON Lines, CSV and Parquet, never the object whole.

JSON Lines are read line by line (a row's number is its line number; blank lines are no rows),
CSV through the ``csv`` module (its first line names the fields; a row's number counts the rows
after it, and every value is a string), Parquet a batch of rows at a time (numbered from 1 in
the file's order). A row that is not a JSON object, or a CSV row with more values than the
header names, is a ``RowProblem`` at its number.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import IO, Any, Literal

import msgspec

from pspf.errors import ConfigError

Format = Literal["jsonl", "parquet", "csv"]
#: The names an object of each format may end with.
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl", ".ndjson"),
    "csv": (".csv",),
    "parquet": (".parquet",),
}
#: Parquet rows decoded per batch.
PARQUET_BATCH = 1000

#: (row number, the row's JSON as read or None, the row)
Record = tuple[int, bytes | None, dict[str, Any]]

_json = msgspec.json.Decoder()


class RowProblem(ConfigError):
    """A row the source cannot add; ``number`` is its line (JSON Lines) or row number."""

    def __init__(self, number: int, problem: str) -> None:
        super().__init__(problem)
        self.number = number


def read_records(handle: IO[bytes], fmt: Format) -> Iterator[Record]:
    """The rows of an open object, in order."""
    if fmt == "jsonl":
        return _jsonl(handle)
    if fmt == "csv":
        return _csv(handle)
    return _parquet(handle)


def _jsonl(handle: IO[bytes]) -> Iterator[Record]:
    for number, line in enumerate(handle, start=1):
        raw = line.strip()
        if not raw:
            continue
        try:
            record = _json.decode(raw)
        except msgspec.DecodeError as exc:
            raise RowProblem(number, f"invalid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise RowProblem(number, f"invalid JSON: not valid UTF-8 ({exc.reason})") from None
        if not isinstance(record, dict):
            raise RowProblem(number, f"expected a JSON object, got {type(record).__name__}")
        yield number, raw, record


def _csv(handle: IO[bytes]) -> Iterator[Record]:
    text = io.TextIOWrapper(handle, encoding="utf-8-sig", newline="")
    reader = csv.DictReader(text)
    number = 0
    try:
        for number, row in enumerate(reader, start=1):  # the number of a bad row
            if None in row:
                raise RowProblem(
                    number, f"{len(reader.fieldnames or ())} fields in the header, more in the row"
                )
            yield number, None, row
    except UnicodeDecodeError as exc:
        raise RowProblem(number + 1, f"not valid UTF-8 ({exc.reason})") from None
    except csv.Error as exc:
        raise RowProblem(number + 1, f"invalid CSV: {exc}") from None
    finally:
        text.detach()  # the object's handle is its opener's to close


def _parquet(handle: IO[bytes]) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(handle).iter_batches(batch_size=PARQUET_BATCH)
    except pa.ArrowException as exc:
        raise RowProblem(1, f"not a Parquet file: {exc}") from None
    number = 0
    for batch in batches:
        for record in batch.to_pylist():
            number += 1
            yield number, None, record


def record_key(record: dict[str, Any], key_field: str | None) -> str | None:
    """The key of a row: its ``key_field`` as text (None without a key field)."""
    if key_field is None:
        return None
    if key_field not in record:
        raise ConfigError(f"no field {key_field!r}")
    value = record[key_field]
    if value is None or isinstance(value, (bool, dict, list)):
        shown = "null" if value is None else type(value).__name__
        raise ConfigError(f"field {key_field!r} is {shown}: a key must be text or a number")
    return str(value)
