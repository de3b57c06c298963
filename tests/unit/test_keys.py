from __future__ import annotations

import zlib

import pytest

from pspf import keys
from pspf.errors import ConfigError
from pspf.keys import StreamId


@pytest.mark.parametrize(
    ("lower", "higher"),
    [("9-0", "10-0"), ("1-9", "1-10"), ("99-99", "100-0"), ("1700000000000-9", "1700000000000-10")],
)
def test_stream_ids_compare_as_integer_pairs_across_digit_boundaries(lower: str, higher: str) -> None:
    assert lower > higher  # as strings the order is wrong ...
    assert StreamId.parse(lower) < StreamId.parse(higher)  # ... as (ms, seq) it is right
    assert StreamId.parse(higher.encode()) > StreamId.parse(lower.encode())


def test_stream_id_round_trips_and_rejects_garbage() -> None:
    assert str(StreamId.parse(b"1700-3")) == "1700-3"
    assert StreamId.parse("42") == StreamId(42, 0)
    for bad in ("", "x-1", "1-y", "1-2-3", "-"):
        with pytest.raises(ConfigError, match="invalid stream id"):
            StreamId.parse(bad)


def test_partition_is_crc32_of_the_key_bytes_mod_p() -> None:
    for key in ("u1", "user-42", "ключ", ""):
        for partitions in (1, 4, 7):
            assert keys.partition_for(key.encode(), partitions) == zlib.crc32(key.encode()) % partitions
    # A fixed value other producers (Spark, other languages) can check against.
    # Fixed values (CRC-32/ISO-HDLC, as zlib and java.util.zip.CRC32) other producers can check.
    assert keys.partition_for(b"u1", 4) == 2
    assert keys.partition_for(b"order-42", 16) == 14


def test_every_partition_key_shares_one_hash_tag() -> None:
    stream = keys.stream_key("orders", 3)
    assert stream == "pspf:{orders:3}"
    for name in (keys.lease_key("orders", 3, "app"), keys.fence_key("orders", 3, "app")):
        assert name.startswith("pspf:{orders:3}:")


@pytest.mark.parametrize("bad", ["", "a b", "a{b", "a}b", "-lead", "x" * 201, "a:b"])
def test_names_that_would_break_keys_or_paths_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid topic name"):
        keys.check_name("topic", bad)


def test_valid_names_pass() -> None:
    for good in ("orders", "order-totals", "a.b_c-1", "9lives"):
        assert keys.check_name("app", good) == good


def test_importing_pspf_loads_no_optional_engine() -> None:
    import subprocess
    import sys

    code = "import sys, pspf, cli; print(sorted(m for m in ('rocksdict', 'pyspark') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_next_id_carries_into_the_millisecond_at_the_largest_sequence() -> None:
    """A regression test: ``next`` of ``ms-(2**64-1)`` was ``ms-2**64``, which Redis refuses."""
    from pspf.keys import MAX_SEQ

    assert StreamId(5, 1).next() == StreamId(5, 2)
    assert StreamId(5, MAX_SEQ).next() == StreamId(6, 0)


@pytest.mark.parametrize(
    "text", ["1_0-0", " 1-0", "+1-0", "1-0 ", "²-0", "1-²", "18446744073709551616-0", "1-"]
)
def test_stream_ids_that_int_would_take_but_redis_refuses_are_rejected(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid stream id"):
        StreamId.parse(text)


@pytest.mark.parametrize("text", ["²:1-0", "0:1_0-0", "x:1-0", "1-0", "0:"])
def test_malformed_dlq_ids_are_config_errors(text: str) -> None:
    """A regression test: ``²:1-0`` passed ``isdigit`` and raised a bare ValueError."""
    from pspf.service import parse_dlq_id

    with pytest.raises(ConfigError, match="invalid"):
        parse_dlq_id(text)


def test_dlq_ids_are_normalised() -> None:
    from pspf.service import parse_dlq_id

    assert parse_dlq_id("2:1700000000000") == (2, b"1700000000000-0")


def test_importing_the_state_stores_does_not_load_the_worker() -> None:
    """``state_stores`` uses ``pspf.errors``: that must not import the worker, which imports it."""
    import subprocess
    import sys

    code = (
        "import sys, state_stores; "
        "loaded = ('pspf.worker', 'pspf.worker.process', 'pspf.cycle.processor', 'redis'); "
        "print(sorted(m for m in loaded if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_stream_ids_print_as_redis_ids_also_inside_containers() -> None:
    sid = StreamId(1700000000000, 3)
    assert str(sid) == repr(sid) == f"{sid}" == "1700000000000-3"
    assert f"{ {'orders': sid} }" == "{'orders': 1700000000000-3}"
    assert str([sid, StreamId(1, 0)]) == "[1700000000000-3, 1-0]"
