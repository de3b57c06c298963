"""``pspf docs``: the AsyncAPI 3.0.0 document of an app, checked against the specification's own JSON schema.

The schema in tests/support/asyncapi-3.0.0.json is the AsyncAPI Initiative's (Apache-2.0), as
published in the ``@asyncapi/specs`` package: see tests/support/README.md.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from click.testing import CliRunner

from pspf import App, Context, windows
from pspf.cli import cli
from pspf.contracts.asyncapi import asyncapi_document, type_schema

SCHEMA = Path(__file__).parent.parent / "support" / "asyncapi-3.0.0.json"


class Item(msgspec.Struct):
    sku: str
    quantity: int = 1


class Order(msgspec.Struct):
    user: str
    amount: int
    items: list[Item] = []


class Customer(msgspec.Struct):
    name: str
    country: str


def shop_app() -> App:
    """A handler of a Struct, a declared emit, a table, a re-keying stream with .to(), a window."""
    app = App("shop")
    app.emits("receipts", Order)
    app.table("customers", Customer)

    @app.handler("orders")
    def on_order(order: Order, ctx: Context) -> None:
        ctx.emit("receipts", order)

    app.stream("clicks").group_by("user", topic="clicks-by-user").to("clicks-enriched")

    @app.window("payments", windows.tumbling(timedelta(minutes=1)), emit_to="payment-totals")
    def total(acc: int | None, value: dict[str, Any]) -> int:
        return (acc or 0) + value["amount"]

    return app


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    assert schema["$schema"].startswith("http://json-schema.org/draft-07/")  # the draft it declares
    assert "$id" not in schema  # the bundled file: every $ref points into its own definitions
    return jsonschema.Draft7Validator(schema)


def assert_valid(validator: jsonschema.Draft7Validator, document: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []
    for ref in refs(document):  # the schema does not follow references: each must lead somewhere
        assert resolve(document, ref) is not None, ref


def refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in refs(item)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [ref for value in node.values() for ref in refs(value)]


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for step in ref[2:].split("/"):
        node = node.get(step.replace("~1", "/").replace("~0", "~"))
        if node is None:
            return None
    return node


def test_the_document_validates_and_has_a_channel_per_topic_with_its_role(
    validator: jsonschema.Draft7Validator,
) -> None:
    document = asyncapi_document(shop_app())
    assert_valid(validator, document)
    assert document["asyncapi"] == "3.0.0"
    assert document["info"]["title"] == "shop"
    assert document["defaultContentType"] == "application/json"
    roles = {topic: channel["x-pspf-roles"] for topic, channel in document["channels"].items()}
    assert roles == {
        "orders": ["read"],
        "customers": ["table"],
        "clicks": ["read"],
        "clicks-by-user": ["re-keying"],
        "payments": ["read"],
        "receipts": ["emitted"],
        "clicks-enriched": ["emitted"],
        "payment-totals": ["emitted"],
    }
    for topic, channel in document["channels"].items():
        assert channel["address"] == topic
        assert channel["description"].startswith(roles[topic][0])
    assert "handler" in document["channels"]["orders"]["description"]
    assert "window total" in document["channels"]["payment-totals"]["description"]


def test_receive_for_what_it_reads_and_send_for_what_it_writes() -> None:
    document = asyncapi_document(shop_app())
    actions = {name: op["action"] for name, op in document["operations"].items()}
    assert actions == {
        "receive.orders": "receive",
        "receive.customers": "receive",
        "receive.clicks": "receive",
        "receive.clicks-by-user": "receive",
        "send.clicks-by-user": "send",  # a re-keying topic: written by group_by, read back
        "receive.payments": "receive",
        "send.receipts": "send",
        "send.clicks-enriched": "send",
        "send.payment-totals": "send",
    }
    operation = document["operations"]["send.receipts"]
    assert operation["channel"] == {"$ref": "#/channels/receipts"}
    assert operation["messages"] == [{"$ref": "#/channels/receipts/messages/receipts"}]


def test_payloads_come_from_the_value_types_with_their_definitions_in_components() -> None:
    document = asyncapi_document(shop_app())

    def payload(topic: str) -> Any:
        message = resolve(document, document["channels"][topic]["messages"][topic]["$ref"])
        return message["payload"]

    assert payload("orders") == {"$ref": "#/components/schemas/Order"}
    order = document["components"]["schemas"]["Order"]
    assert set(order["properties"]) == {"user", "amount", "items"}
    assert order["required"] == ["user", "amount"]
    assert order["properties"]["items"]["items"] == {"$ref": "#/components/schemas/Item"}
    assert "$defs" not in json.dumps(document)
    assert payload("receipts") == {"$ref": "#/components/schemas/Order"}  # app.emits
    assert payload("customers") == {"anyOf": [{"$ref": "#/components/schemas/Customer"}, {"type": "null"}]}
    assert payload("clicks") == {} and payload("clicks-enriched") == {}  # no type: any JSON
    totals = payload("payment-totals")
    assert set(totals["properties"]) == {"key", "start", "end", "value"}
    assert totals["properties"]["value"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}


def test_a_registered_schema_wins_and_a_clashing_definition_is_renamed(
    validator: jsonschema.Draft7Validator,
) -> None:
    registered = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": "#/$defs/Order",
        "$defs": {"Order": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}},
    }
    document = asyncapi_document(shop_app(), {"orders": registered})
    assert_valid(validator, document)
    messages, schemas = document["components"]["messages"], document["components"]["schemas"]
    assert messages["orders"]["payload"] == {"$ref": "#/components/schemas/Order"}
    assert "registered" in messages["orders"]["description"]
    assert set(schemas["Order"]["properties"]) == {"id"}
    # receipts' Order (the value type of app.emits) is another schema of the same name
    assert messages["receipts"]["payload"] == {"$ref": "#/components/schemas/Order2"}
    assert set(schemas["Order2"]["properties"]) == {"user", "amount", "items"}
    assert schemas["Order2"]["properties"]["items"]["items"] == {"$ref": "#/components/schemas/Item"}


def test_two_types_of_one_name_stay_apart() -> None:
    def other() -> Any:
        class Item(msgspec.Struct):
            code: int

        return Item

    components: dict[str, Any] = {}
    assert type_schema(Item, components) == {"$ref": "#/components/schemas/Item"}
    assert type_schema(Item, components) == {"$ref": "#/components/schemas/Item"}  # the same: shared
    assert type_schema(other(), components) == {"$ref": "#/components/schemas/Item2"}
    assert set(components["Item2"]["properties"]) == {"code"}


@pytest.mark.parametrize("target", ["examples.order_totals:main", "examples.spend_per_minute:main"])
def test_the_examples_validate(validator: jsonschema.Draft7Validator, target: str) -> None:
    shown = CliRunner().invoke(cli, ["docs", target])
    assert shown.exit_code == 0, shown.output
    assert_valid(validator, json.loads(shown.output))


def test_pspf_docs_writes_json_and_yaml(validator: jsonschema.Draft7Validator, tmp_path: Path) -> None:
    target = f"{__name__}:shop_app"
    written = tmp_path / "shop.json"
    runner = CliRunner()
    done = runner.invoke(cli, ["docs", target, "--output", str(written)])
    assert done.exit_code == 0, done.output
    assert f"to {written}" in done.output  # on stderr, which the runner mixes in
    document = json.loads(written.read_text())
    assert_valid(validator, document)
    assert document == asyncapi_document(shop_app())
    yaml = pytest.importorskip("yaml")
    as_yaml = runner.invoke(cli, ["docs", target, "--format", "yaml"])
    assert as_yaml.exit_code == 0, as_yaml.output
    assert as_yaml.output.startswith("asyncapi: 3.0.0\n")
    assert yaml.safe_load(as_yaml.output) == document


def test_yaml_without_pyyaml_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml fails as if it were not installed
    refused = CliRunner().invoke(cli, ["docs", f"{__name__}:shop_app", "--format", "yaml"])
    assert refused.exit_code == 2
    assert refused.output == "Error: --format yaml needs PyYAML (pip install pyyaml); json needs nothing\n"


@pytest.mark.parametrize(
    ("source", "target", "said"),
    [
        ("", "nowhere_at_all:main", "cannot import module 'nowhere_at_all'"),
        ("main = 1\n", "docs_target:main", "not a pspf.App"),
        ("from pspf import App\nmain = App('quiet')\n", "docs_target:main", "reads no topic"),
        ("from pspf import App\nmain = App('out')\nmain.emits('x')\n", "docs_target:main", "reads no topic"),
        ("", "docs_target.py:main", "names a file"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, target: str, said: str
) -> None:
    (tmp_path / "docs_target.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "docs_target", raising=False)
    refused = CliRunner().invoke(cli, ["docs", target])
    assert refused.exit_code == 2
    assert said in refused.output
    assert refused.output.count("\n") == 1 and "Traceback" not in refused.output
