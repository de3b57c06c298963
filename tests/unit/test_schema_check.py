"""The JSON Schema subset PSPF checks: refused keywords named with their place, values checked by msgspec."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pspf.contracts.schema import Checker, check_schema, schema_of_type
from pspf.errors import ConfigError, SchemaError


class Order(msgspec.Struct):
    user: str
    amount: int
    note: str | None = None


SHAPE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "user-name": {"type": "string", "minLength": 2, "pattern": "^u"},
        "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10},
        "price": {"type": ["number", "null"]},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["user-name"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (b'{"user-name":"u1","n":3,"price":null,"kind":"a","tags":["x"],"address":{"city":"Oslo"}}', None),
        (b'{"user-name":"u"}', "Expected `str` of length >= 2 - at `$.user-name`"),
        (b'{"user-name":"x1"}', "Expected `str` matching regex '^u' - at `$.user-name`"),
        (b'{"user-name":"u1","n":10}', "Expected `int` <= 9 - at `$.n`"),
        (b'{"user-name":"u1","n":"3"}', "Expected `int`, got `str` - at `$.n`"),
        (b'{"user-name":"u1","kind":"c"}', "Invalid enum value 'c' - at `$.kind`"),
        (b'{"user-name":"u1","tags":["a","b","c"]}', "Expected `array` of length <= 2 - at `$.tags`"),
        (b'{"user-name":"u1","address":{}}', "Object missing required field `city` - at `$.address`"),
        (b'{"user-name":"u1","other":1}', "Object contains unknown field `other`"),
        (b'{"n":1}', "Object missing required field `user-name`"),
        (b"[]", "Expected `object`, got `array`"),
    ],
)
def test_values_are_checked_with_the_field_and_the_rule(value: bytes, error: str | None) -> None:
    checker = Checker("orders", 3, check_schema(SHAPE))
    if error is None:
        checker.check(value)
        return
    with pytest.raises(SchemaError) as raised:
        checker.check(value)
    assert str(raised.value) == f"topic 'orders' schema v3: {error}"


def test_a_structs_schema_checks_what_the_struct_decodes() -> None:
    checker = Checker("orders", 1, check_schema(schema_of_type(f"{__name__}:Order")))
    checker.check(msgspec.json.encode(Order("u1", 3)))
    checker.check(b'{"user":"u1","amount":3,"note":null,"extra":true}')  # other fields allowed
    with pytest.raises(SchemaError, match=r"Expected `str \| null`, got `int` - at `\$.note`"):
        checker.check(b'{"user":"u1","amount":3,"note":5}')
    checker.check(msgspec.msgpack.encode({"user": "u1", "amount": 3}), msgpack=True)


def test_flat_records_are_checked_as_typed_handlers_convert_them() -> None:
    checker = Checker("orders", 1, check_schema(schema_of_type(f"{__name__}:Order")))
    checker.check_record({"user": "u1", "amount": "3"})
    with pytest.raises(SchemaError, match=r"at `\$.amount`"):
        checker.check_record({"user": "u1", "amount": "three"})


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"type": "object", "oneOf": []}, "$: 'oneOf' is not supported"),
        ({"properties": {"a": {"type": "string"}}}, "$: 'properties' needs \"type\": 'object' beside it"),
        ({"type": "string", "pattern": "("}, "$: pattern '(' is not a regular expression"),
        (
            {"type": "object", "additionalProperties": {"type": "string"}},
            "additionalProperties must be true or false",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}},
            "$.a: $ref '#/$defs/B' must name an entry",
        ),
        ({"enum": [True, False]}, "enum and const take strings, integers and null"),
        ({"type": "object", "anyOf": [{"type": "object"}]}, "anyOf beside other keywords is not supported"),
        (
            {
                "anyOf": [
                    {"type": "object", "properties": {"a": {"type": "string"}}},
                    {"type": "object", "properties": {"b": {"type": "string"}}},
                ]
            },
            "PSPF cannot check it",
        ),
        ([1], "a schema is a JSON object"),
    ],
)
def test_schemas_outside_the_subset_are_refused_naming_the_place(doc: Any, error: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_schema(doc)
    assert error in str(raised.value)


def test_a_type_spec_that_is_not_a_type_is_one_line() -> None:
    with pytest.raises(ConfigError, match="give MODULE:TYPE"):
        schema_of_type("Order")
    with pytest.raises(ConfigError, match="no_such_module"):
        schema_of_type("no_such_module:Order")
