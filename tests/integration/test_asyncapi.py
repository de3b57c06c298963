"""``pspf docs --broker``: a topic's schema registered in Redis is its payload, over the app's value type."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from click.testing import CliRunner

from pspf import App, Context
from pspf.cli import cli
from pspf.service import Service

pytestmark = pytest.mark.integration

SCHEMA = Path(__file__).parent.parent / "support" / "asyncapi-3.0.0.json"

#: the topics of ``docs_app``, fresh per test (the server is shared)
TOPICS: dict[str, str] = {}


class Order(msgspec.Struct):
    user: str
    amount: int


def docs_app() -> App:
    app = App("docs-app")
    app.emits(TOPICS["out"], Order)

    @app.handler(TOPICS["in"])
    def on_order(order: Order, ctx: Context) -> None:
        ctx.emit(TOPICS["out"], order)

    return app


def test_a_registered_schema_wins_over_the_value_type(
    make_topic: Callable[[int], str], redis_url: str, service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(TOPICS, "in", make_topic(1))
    monkeypatch.setitem(TOPICS, "out", make_topic(1))
    registered: dict[str, Any] = {
        "type": "object",
        "properties": {"user": {"type": "string"}, "amount": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["user", "amount"],
    }
    service.schemas.set_schema(TOPICS["in"], registered)
    target = f"{__name__}:docs_app"
    shown = CliRunner().invoke(cli, ["docs", target, "--broker", redis_url])
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    assert [e.message for e in validator.iter_errors(document)] == []
    messages = document["components"]["messages"]
    assert messages[TOPICS["in"]]["payload"] == registered  # the registered one, with its "note"
    assert "registered" in messages[TOPICS["in"]]["description"]
    assert messages[TOPICS["out"]]["payload"] == {"$ref": "#/components/schemas/Order"}  # none registered
    offline = CliRunner().invoke(cli, ["docs", target])
    assert offline.exit_code == 0, offline.output
    payload = json.loads(offline.output)["components"]["messages"][TOPICS["in"]]["payload"]
    assert payload == {"$ref": "#/components/schemas/Order"}  # without --broker: the value type
