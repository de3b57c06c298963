from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest

from pspf.contracts.compat import check_change, problems

STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
NUM: dict[str, Any] = {"type": "number"}
NULLABLE_STR: dict[str, Any] = {"anyOf": [STR, {"type": "null"}], "default": None}


def obj(props: dict[str, Any], required: tuple[str, ...] = (), extra: bool | None = None) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object", "properties": props, "required": list(required)}
    if extra is not None:
        node["additionalProperties"] = extra
    return node


def arr(items: Any = None, **limits: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "array", **limits}
    if items is not None:
        node["items"] = items
    return node


def with_defs(root: dict[str, Any], **defs: Any) -> dict[str, Any]:
    return {**root, "$defs": defs}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


def assert_problems(found: list[str], expected: list[tuple[str, str]]) -> None:
    """Each expected (path, gist) matches one problem, in order, and nothing else is reported."""
    assert len(found) == len(expected), found
    for message, (path, gist) in zip(found, expected, strict=True):
        assert message.startswith(f"{path}: "), message
        assert gist in message, message


# (id, reader, writer, expected problems as (path, gist)); [] means the reader accepts the writer
CASES: list[tuple[str, Any, Any, list[tuple[str, str]]]] = [
    # anything
    ("reader true", True, STR, []),
    ("reader empty with annotations", {"title": "x", "description": "y", "format": "email"}, STR, []),
    ("writer false", STR, False, []),
    ("reader false", False, STR, [("$", "accepts no value")]),
    # 1. types
    ("same type", STR, STR, []),
    ("integer within number", NUM, INT, []),
    ("number not within integer", INT, NUM, [("$", "the writer allows number, the reader only integer")]),
    ("type list widened", {"type": ["string", "null"]}, STR, []),
    (
        "type list narrowed",
        STR,
        {"type": ["string", "null"]},
        [("$", "writer allows null, the reader only string")],
    ),
    (
        "writer untyped",
        STR,
        {},
        [("$", "the writer allows any type, the reader only string (a narrowed type)")],
    ),
    ("reader untyped", {}, {"type": ["string", "object"]}, []),
    # 2. objects: required
    ("same required", obj({"a": STR}, ("a",)), obj({"a": STR}, ("a",)), []),
    ("required dropped", obj({"a": STR}), obj({"a": STR}, ("a",)), []),
    (
        "new required field",
        obj({"a": STR}, ("a",)),
        obj({"a": STR}),
        [("$.a", "the reader requires it, the writer")],
    ),
    (
        "new required field with a default",
        obj({"a": {**STR, "default": "x"}}, ("a",), extra=False),
        obj({}, extra=False),
        [("$.a", "a new required field")],
    ),
    # 2. objects: properties in both recurse
    ("nested property narrowed", obj({"a": INT}), obj({"a": NUM}), [("$.a", "a narrowed type")]),
    (
        "deep path",
        obj({"address": obj({"city": {"type": "string", "maxLength": 5}})}),
        obj({"address": obj({"city": STR})}),
        [("$.address.city", "maxLength 5 in the reader, none in the writer")],
    ),
    ("odd property name", obj({"a-b": INT}), obj({"a-b": NUM}), [('$["a-b"]', "a narrowed type")]),
    # 2. objects: writer-only properties
    ("writer-only property, reader open", obj({}), obj({"x": STR}), []),
    (
        "writer-only property, reader closed",
        obj({}, extra=False),
        obj({"note": STR}, extra=False),
        [("$.note", "removed in the reader while it forbids other properties")],
    ),
    # 2. objects: reader-only properties
    ("reader-only property, writer closed", obj({"note": STR}, extra=False), obj({}, extra=False), []),
    # the writer's producers write only the fields it names: a reader-only property is a new field
    ("reader-only typed property, writer open", obj({"note": STR}), obj({}), []),
    ("reader-only untyped property, writer open", obj({"note": {"description": "free"}}), obj({}), []),
    # 2. objects: additionalProperties
    (
        "reader closes an open writer",
        obj({"a": STR}, extra=False),
        obj({"a": STR}),
        [("$", "the reader forbids properties the writer allows (additionalProperties false)")],
    ),
    ("reader opens a closed writer", obj({"a": STR}), obj({"a": STR}, extra=False), []),
    ("object rules skipped for other types", obj({"a": STR}, ("a",)), STR, [("$", "a narrowed type")]),
    # 3. arrays
    ("items same", arr(STR), arr(STR), []),
    ("items widened", arr(NUM), arr(INT), []),
    ("items narrowed", arr(INT), arr(NUM), [("$[]", "the writer allows number, the reader only integer")]),
    ("writer items absent", arr(STR), arr(), [("$[]", "the writer allows any type")]),
    ("reader items absent", arr(), arr(STR), []),
    ("minItems loosened", arr(minItems=1), arr(minItems=2), []),
    (
        "minItems tightened",
        arr(minItems=2),
        arr(minItems=1),
        [("$", "minItems 2 in the reader, 1 in the writer")],
    ),
    ("minItems new", arr(minItems=1), arr(), [("$", "minItems 1 in the reader, none in the writer")]),
    ("maxItems loosened", arr(maxItems=5), arr(maxItems=3), []),
    (
        "maxItems tightened",
        arr(maxItems=3),
        arr(maxItems=5),
        [("$", "maxItems 3 in the reader, 5 in the writer")],
    ),
    ("maxItems new", arr(maxItems=3), arr(), [("$", "maxItems 3 in the reader, none in the writer")]),
    ("empty writer arrays skip items", arr(INT), arr(NUM, maxItems=0), []),
    (
        "nested arrays of objects",
        obj({"lines": arr(obj({"qty": INT}, ("qty",)))}),
        obj({"lines": arr(obj({"qty": INT}))}),
        [("$.lines[].qty", "a new required field")],
    ),
    # 4. numbers
    ("minimum loosened", {**NUM, "minimum": 0}, {**NUM, "minimum": 1}, []),
    (
        "minimum tightened",
        {**NUM, "minimum": 1},
        {**NUM, "minimum": 0},
        [("$", "minimum 1 in the reader, minimum 0")],
    ),
    (
        "minimum new",
        {**NUM, "minimum": 0},
        NUM,
        [("$", "minimum 0 in the reader, no lower bound in the writer")],
    ),
    ("maximum loosened", {**NUM, "maximum": 10}, {**NUM, "maximum": 5}, []),
    (
        "maximum tightened",
        {**NUM, "maximum": 5},
        {**NUM, "maximum": 10},
        [("$", "maximum 5 in the reader, maximum 10")],
    ),
    (
        "maximum new",
        {**NUM, "maximum": 5},
        NUM,
        [("$", "maximum 5 in the reader, no upper bound in the writer")],
    ),
    ("exclusive within inclusive", {**NUM, "minimum": 0}, {**NUM, "exclusiveMinimum": 0}, []),
    (
        "inclusive not within exclusive",
        {**NUM, "exclusiveMinimum": 0},
        {**NUM, "minimum": 0},
        [("$", "exclusiveMinimum 0 in the reader, minimum 0 in the writer")],
    ),
    (
        "exclusive maximum tightened",
        {**NUM, "exclusiveMaximum": 10},
        {**NUM, "maximum": 10},
        [("$", "exclusiveMaximum 10 in the reader, maximum 10 in the writer (a tightened limit)")],
    ),
    ("integers: > 0 is >= 1", {**INT, "minimum": 1}, {**INT, "exclusiveMinimum": 0}, []),
    ("integers: < 10 is <= 9", {**INT, "maximum": 9}, {**INT, "exclusiveMaximum": 10}, []),
    (
        "numbers: > 0 is not >= 1",
        {**NUM, "minimum": 1},
        {**NUM, "exclusiveMinimum": 0},
        [("$", "minimum 1 in the reader, exclusiveMinimum 0 in the writer")],
    ),
    (
        "tighter of two writer bounds counts",
        {**NUM, "minimum": 3},
        {**NUM, "minimum": 1, "exclusiveMinimum": 3},
        [],
    ),
    ("bounds skipped for strings", {"type": ["string", "number"], "minimum": 1}, STR, []),
    # 5. strings
    ("minLength loosened", {**STR, "minLength": 1}, {**STR, "minLength": 2}, []),
    (
        "minLength tightened",
        {**STR, "minLength": 3},
        STR,
        [("$", "minLength 3 in the reader, none in the writer")],
    ),
    ("maxLength loosened", {**STR, "maxLength": 20}, {**STR, "maxLength": 10}, []),
    (
        "maxLength tightened",
        {**STR, "maxLength": 10},
        {**STR, "maxLength": 20},
        [("$", "maxLength 10 in the reader, 20 in the writer (a tightened limit)")],
    ),
    ("same pattern", {**STR, "pattern": "^[a-z]+$"}, {**STR, "pattern": "^[a-z]+$"}, []),
    ("reader drops pattern", STR, {**STR, "pattern": "^[a-z]+$"}, []),
    (
        "new pattern",
        {**STR, "pattern": "^[a-z]+$"},
        STR,
        [("$", "cannot prove the writer's strings match the reader's pattern")],
    ),
    (
        "changed pattern",
        {**STR, "pattern": "^[a-z]*$"},
        {**STR, "pattern": "^[a-z]+$"},
        [("$", "cannot prove the writer's strings match")],
    ),
    # 6. enum and const
    ("enum grown", {"enum": ["a", "b", "c"]}, {"enum": ["a", "b"]}, []),
    (
        "enum shrunk",
        {"enum": ["a", "b"]},
        {"enum": ["a", "c"]},
        [("$", "the writer allows 'c', not in the reader's enum")],
    ),
    ("writer enum within reader type", STR, {"enum": ["a", "b"]}, []),
    ("writer enum within reader bounds", {**INT, "maximum": 3}, {"enum": [1, 2, 3]}, []),
    (
        "writer enum outside reader bounds",
        {**INT, "maximum": 2},
        {"enum": [1, 3]},
        [("$", "allows 3, which the reader rejects")],
    ),
    (
        "writer enum against reader pattern",
        {**STR, "pattern": "^a"},
        {"enum": ["ab", "b"]},
        [("$", "allows 'b'")],
    ),
    ("writer const within reader enum", {"enum": ["a", "b"]}, {"const": "a"}, []),
    (
        "writer const outside reader const",
        {"const": "a"},
        {"const": "b"},
        [("$", "not the reader's const 'a'")],
    ),
    ("true is not 1", {"enum": [1]}, {"const": True}, [("$", "the writer allows true")]),
    ("1.0 is an integer", INT, {"const": 1.0}, []),
    ("enum values the writer itself rejects", {"enum": ["a"]}, {"type": "string", "enum": ["a", 7]}, []),
    ("booleans listed", {"enum": [True, False, None]}, {"type": ["boolean", "null"]}, []),
    ("booleans not listed", {"const": True}, {"type": "boolean"}, [("$", "the writer allows false")]),
    ("open writer, reader enum", {"enum": ["a"]}, STR, [("$", "the reader only accepts its enum")]),
    ("open writer, reader const", {"const": 1}, INT, [("$", "the reader only accepts its const")]),
    # 7. anyOf
    ("writer anyOf, each branch accepted", {"type": ["string", "null"]}, NULLABLE_STR, []),
    (
        "writer anyOf, a branch refused",
        STR,
        NULLABLE_STR,
        [("$", "the writer allows null, the reader only string")],
    ),
    ("reader anyOf accepts writer", NULLABLE_STR, STR, []),
    ("nullable to nullable", NULLABLE_STR, NULLABLE_STR, []),
    ("reader anyOf, writer type list split", NULLABLE_STR, {"type": ["string", "null"]}, []),
    (
        "reader anyOf, no branch fits",
        NULLABLE_STR,
        {"type": ["string", "integer"]},
        [("$", "no branch of the reader's anyOf accepts the writer's integer")],
    ),
    (
        "made nullable field non-nullable",
        obj({"note": STR}),
        obj({"note": NULLABLE_STR}),
        [("$.note", "the writer allows null, the reader only string")],
    ),
    ("made field nullable", obj({"note": NULLABLE_STR}), obj({"note": STR}), []),
    (
        "reader anyOf with branch limits",
        {"anyOf": [{**STR, "maxLength": 5}, INT]},
        {**STR, "maxLength": 9},
        [
            (
                "$",
                "no branch of the reader's anyOf accepts the writer's string (closest branch: $: maxLength 5",
            )
        ],
    ),
    ("writer anyOf siblings merged", {**STR, "maxLength": 5}, {"maxLength": 5, "anyOf": [STR]}, []),
    ("writer anyOf enum branch", {"enum": ["a", "b"]}, {"anyOf": [{"const": "a"}, {"const": "b"}]}, []),
    ("empty writer anyOf accepts nothing", STR, {"anyOf": []}, []),
]

# 8. $ref, resolved against each side's own $defs
REF_CASES: list[tuple[str, Any, Any, list[tuple[str, str]]]] = [
    ("ref on both sides", with_defs(ref("A"), A=STR), with_defs(ref("B"), B=STR), []),
    ("ref on the reader", with_defs(ref("A"), A=NUM), INT, []),
    ("ref on the writer", INT, with_defs(ref("A"), A=NUM), [("$", "a narrowed type")]),
    (
        "same def name, different documents",
        with_defs(obj({"a": ref("T")}), T=INT),
        with_defs(obj({"a": ref("T")}), T=NUM),
        [("$.a", "the writer allows number, the reader only integer")],
    ),
    (
        "ref inside anyOf",
        with_defs(obj({"a": {"anyOf": [ref("T"), {"type": "null"}]}}), T=NUM),
        obj({"a": INT}),
        [],
    ),
    ("ref chain", with_defs(ref("A"), A=ref("B"), B=NUM), INT, []),
    ("ref siblings merged", with_defs({**ref("A"), "maxLength": 3}, A=STR), {**STR, "maxLength": 3}, []),
    (
        "ref siblings clash in the reader",
        with_defs({**ref("A"), "maxLength": 3}, A={**STR, "maxLength": 5}),
        {**STR, "maxLength": 3},
        [("$", "cannot combine $ref")],
    ),
    ("missing def", with_defs(ref("Nope"), A=STR), STR, [("$", "not found in $defs")]),
    ("unsupported ref", {"$ref": "other.json#/x"}, STR, [("$", "unsupported $ref")]),
    (
        "recursive ref",
        with_defs(ref("Node"), Node=obj({"next": ref("Node")})),
        with_defs(ref("Node"), Node=obj({"next": ref("Node")})),
        [("$.next", "recursive $ref not supported")],
    ),
    ("ref loop without nesting", with_defs(ref("A"), A=ref("B"), B=ref("A")), STR, [("$", "recursive $ref")]),
    (
        "repeated, not recursive",
        with_defs(obj({"a": ref("T"), "b": ref("T")}), T=STR),
        obj({"a": STR, "b": STR}),
        [],
    ),
    (
        "recursive ref in enum check stays finite",
        with_defs(ref("A"), A={"anyOf": [ref("A"), STR]}),
        {"const": "x"},
        [],
    ),
]


@pytest.mark.parametrize(("reader", "writer", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rules(reader: Any, writer: Any, expected: list[tuple[str, str]]) -> None:
    assert_problems(problems(reader, writer), expected)


@pytest.mark.parametrize(
    ("reader", "writer", "expected"), [c[1:] for c in REF_CASES], ids=[c[0] for c in REF_CASES]
)
def test_refs(reader: Any, writer: Any, expected: list[tuple[str, str]]) -> None:
    assert_problems(problems(reader, writer), expected)


def test_identical_schemas_are_compatible_both_ways() -> None:
    schema = obj({"id": INT, "tags": arr(STR, maxItems=3), "note": NULLABLE_STR}, ("id",), extra=False)
    assert problems(schema, schema) == []


def test_problems_are_not_repeated() -> None:
    found = problems(STR, {"anyOf": [INT, {**INT, "minimum": 0}]})
    assert found == ["$: the writer allows integer, the reader only string (a narrowed type)"]


# --- a realistic evolution under every mode --------------------------------------------------------


def order(
    extra: bool | None, amount: Any = INT, note: Any = None, note_required: bool = False
) -> dict[str, Any]:
    props: dict[str, Any] = {"user": STR, "amount": amount}
    required = ["user", "amount"]
    if note is not None:
        props["note"] = note
        required += ["note"] if note_required else []
    return obj(props, tuple(required), extra)


def test_v2_adds_an_optional_field_to_a_closed_object() -> None:
    v1, v2 = order(False), order(False, note=STR)
    assert check_change(v1, v2, "backward") == []
    assert_problems(check_change(v1, v2, "forward"), [("$.note", "removed in the reader while it forbids")])


def test_v2_adds_an_optional_field_to_an_open_object() -> None:
    v1, v2 = order(None), order(None, note=STR)
    assert check_change(v1, v2, "forward") == []
    assert check_change(v1, v2, "backward") == []  # an added optional field, as Avro evolves
    assert check_change(v1, v2, "full") == []


@pytest.mark.parametrize("extra", [False, None])
def test_v3_makes_the_note_required(extra: bool | None) -> None:
    v2, v3 = order(extra, note=STR), order(extra, note=STR, note_required=True)
    assert_problems(check_change(v2, v3, "backward"), [("$.note", "a new required field")])
    assert check_change(v2, v3, "forward") == []
    assert check_change(v2, v3, "full") == [
        "backward: $.note: the reader requires it, the writer does not (a new required field)"
    ]


@pytest.mark.parametrize("extra", [False, None])
def test_v4_widens_amount_to_number(extra: bool | None) -> None:
    v3, v4 = order(extra, note=STR, note_required=True), order(extra, NUM, STR, note_required=True)
    assert check_change(v3, v4, "backward") == []
    assert_problems(
        check_change(v3, v4, "forward"), [("$.amount", "the writer allows number, the reader only integer")]
    )
    assert [p.split(":")[0] for p in check_change(v3, v4, "full")] == ["forward"]
    assert check_change(v3, v4, "none") == []


def test_v5_removes_user_from_a_closed_object() -> None:
    v4 = order(False, NUM, STR, note_required=True)
    v5 = obj({"amount": NUM, "note": STR}, ("amount", "note"), extra=False)
    assert_problems(check_change(v4, v5, "backward"), [("$.user", "removed in the reader while it forbids")])
    assert_problems(check_change(v4, v5, "forward"), [("$.user", "a new required field")])
    full = check_change(v4, v5, "full")
    assert len(full) == 2
    assert full[0].startswith("backward: $.user: ")
    assert full[1].startswith("forward: $.user: ")


def test_v5_removes_user_from_an_open_object() -> None:
    v4 = order(None, NUM, STR, note_required=True)
    v5 = obj({"amount": NUM, "note": STR}, ("amount", "note"))
    assert check_change(v4, v5, "backward") == []
    assert_problems(
        check_change(v4, v5, "forward"),
        [("$.user", "a new required field")],
    )


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="sideways"):
        check_change(STR, STR, "sideways")


# --- schemas msgspec emits (root $ref into $defs, anyOf for optional fields) -----------------------


class Address(msgspec.Struct):
    city: str


class OrderV1(msgspec.Struct):
    user: str
    amount: int
    address: Address | None = None


class AddressV2(msgspec.Struct):
    city: str
    zip: Annotated[str, msgspec.Meta(max_length=10)] = ""


class OrderV2(msgspec.Struct):
    user: str
    amount: float
    note: str | None = None
    address: AddressV2 | None = None


class ClosedV1(msgspec.Struct, forbid_unknown_fields=True):
    user: str
    amount: Annotated[int, msgspec.Meta(ge=0)]


class ClosedV2(msgspec.Struct, forbid_unknown_fields=True):
    user: str
    amount: Annotated[int, msgspec.Meta(ge=0)]
    note: str | None = None


class ClosedV3(msgspec.Struct, forbid_unknown_fields=True):
    user: str
    amount: Annotated[int, msgspec.Meta(gt=0)]
    note: str | None = None


def test_msgspec_open_structs() -> None:
    v1, v2 = msgspec.json.schema(OrderV1), msgspec.json.schema(OrderV2)
    assert v1["$ref"] == "#/$defs/OrderV1"  # the shape this module must resolve
    assert check_change(v1, v2, "backward") == []  # added optional fields, a widened amount
    assert_problems(check_change(v1, v2, "forward"), [("$.amount", "the writer allows number")])


def test_msgspec_closed_structs() -> None:
    v1, v2, v3 = (msgspec.json.schema(t) for t in (ClosedV1, ClosedV2, ClosedV3))
    assert check_change(v1, v2, "backward") == []
    assert_problems(check_change(v1, v2, "forward"), [("$.note", "removed in the reader")])
    assert check_change(v2, v3, "forward") == []
    assert_problems(
        check_change(v2, v3, "backward"),
        [("$.amount", "exclusiveMinimum 0 in the reader, minimum 0 in the writer")],
    )


def test_msgspec_struct_against_itself() -> None:
    schema = msgspec.json.schema(OrderV2)
    assert check_change(schema, schema, "full") == []
