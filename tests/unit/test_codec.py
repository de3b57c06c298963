from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pspf import codec
from pspf.codec import ValueDecoder
from pspf.errors import DecodeError


class Order(msgspec.Struct):
    user: str
    amount: int


def test_json_value_untyped_and_typed() -> None:
    fields = codec.entry_fields(b'{"user": "u1", "amount": 3}', key="u1")
    assert fields[b"key"] == b"u1"
    assert ValueDecoder().decode(fields) == {"user": "u1", "amount": 3}
    assert ValueDecoder(Order).decode(fields) == Order("u1", 3)


def test_msgpack_value_when_the_entry_says_so() -> None:
    fields = {b"value": msgspec.msgpack.encode({"user": "u2", "amount": 5}), b"encoding": b"msgpack"}
    assert ValueDecoder(Order).decode(fields) == Order("u2", 5)


def test_flat_record_is_the_value_and_typed_fields_convert_from_text() -> None:
    fields = {b"user": b"u1", b"amount": b"3"}
    assert ValueDecoder().decode(fields) == {"user": "u1", "amount": "3"}
    assert ValueDecoder(Order).decode(fields) == Order("u1", 3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({b"value": b"{not json"}, "cannot decode value"),
        ({b"value": b'{"user": "u1"}'}, "missing required field `amount`"),
        ({b"value": b'{"user": "u1", "amount": "x"}'}, r"\$.amount"),
        ({b"user": b"u1", b"amount": b"three"}, "amount"),
        ({b"user": b"\xff\xfe"}, "cannot decode value"),
        ({}, "no fields"),
    ],
)
def test_undecodable_entries_raise_decode_error_with_reason(fields: dict[bytes, bytes], message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        ValueDecoder(Order).decode(fields)


def test_headers() -> None:
    assert codec.decode_headers(None) == {}
    assert codec.decode_headers(b'{"trace": "abc"}') == {"trace": "abc"}
    with pytest.raises(DecodeError, match="headers"):
        codec.decode_headers(b"[1, 2]")


def test_encode_value() -> None:
    assert codec.encode_value({"a": 1}) == b'{"a":1}'
    assert codec.encode_value(b'{"raw": true}') == b'{"raw": true}'
    with pytest.raises(Exception, match="cannot encode"):
        codec.encode_value(object())


def test_values_are_any_typed_by_default() -> None:
    assert ValueDecoder().value_type is Any


def test_a_field_name_given_more_than_once_is_marked_and_named() -> None:
    plain = codec.entry_fields_of([b"key", b"k", b"value", b"1", b"headers", b"{}"])
    assert type(plain) is dict and plain == {b"key": b"k", b"value": b"1", b"headers": b"{}"}
    repeated = codec.entry_fields_of([b"a", b"1", b"value", b"2", b"a", b"3", b"value", b"4", b"a", b"5"])
    assert isinstance(repeated, codec.RepeatedFields) and repeated == {b"a": b"5", b"value": b"4"}
    assert repeated.problem.startswith("the field 'a' appears 3 times in the entry")
