"""Schemathesis against the admin API's own OpenAPI document, with the token, on throwaway data.

Every operation gets generated requests, valid and invalid, some aimed at a real topic with
DLQ entries and at a real app (so redrive, purge, replay, reset, savepoints and restores really
run). No response may be a 5xx (Redis is up here), and each must match what the document
promises: a documented status, its media type and its schema.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pspf import App, Context, NonRetryableError, Settings, Worker, windows
from pspf.admin_api import create_app
from pspf.service import Service
from tests.conftest import Names

pytestmark = pytest.mark.integration

TOKEN = "fuzz-token-3b9e"
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(strategy: st.SearchStrategy[schemathesis.Case[Any]]) -> set[int]:
    """Send up to EXAMPLES generated requests with the token; the statuses seen."""
    seen: set[int] = set()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def exercise(case: schemathesis.Case[Any]) -> None:
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
        seen.add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    exercise()
    return seen


def test_no_operation_answers_a_server_error(
    make_settings: Callable[..., Settings],
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    names: Names,
    tmp_path: Path,
) -> None:
    topic, outputs, app_name = make_topic(2), make_topic(1), names.app()
    clicks, customers = make_topic(2), make_topic(2)
    spares = {
        "POST /topics/{topic}/delete": make_topic(1),
        "POST /topics/{topic}/repartition": make_topic(2),
    }
    # a schema on the topic the others use would refuse their entries: the schema routes get their own
    spares["POST /topics/{topic}/schema"] = spares["GET /topics/{topic}/schema"] = make_topic(1)
    spares["GET /topics/{topic}/schema/history"] = spares["POST /topics/{topic}/schema"]
    produce(topic, [(f"k{n % 7}", {"n": n, "bad": n % 3 == 0}) for n in range(60)])
    produce(clicks, [("k1", {"n": n}) for n in range(3)])
    produce(customers, [("k1", {"tier": "gold"})])  # k1 has a row: the table route has one
    app = App(app_name)
    app.table(customers)

    @app.handler(topic)
    def count(value: dict[str, Any], ctx: Context) -> None:
        if value["bad"]:
            raise NonRetryableError(f"entry {value['n']} is bad")
        ctx.state["count"] = ctx.state.get("count", 0) + 1
        ctx.emit(outputs, value)

    @app.window(clicks, windows.tumbling(timedelta(days=1)), emit_to=outputs)
    def clicked(total: int | None, value: Any) -> int:  # k1's window stays open: the route has one
        return (total or 0) + 1

    config = make_settings()
    assert Worker(app, config).run(until_idle=True).dead_lettered == 20
    service = Service(config)
    dlq_ids = [d.dlq_id for d in service.dlq.dlq_list(topic)]
    service.schemas.set_schema(spares["GET /topics/{topic}/schema"], {"type": "object"})
    row_ids = [r.row_id for r in service.outbox.outbox_list(app_name)]
    saved = service.savepoints.take(app_name, str(tmp_path / "savepoints"), "kept").path
    # The savepoint the deletion gets: of an app of its own, which the app's deletion leaves alone.
    keeper = App(names.app())
    keeper.handler(clicks)(lambda value, ctx: None)
    Worker(keeper, config).run(until_idle=True)
    service.savepoints.take(keeper.name, str(tmp_path / "savepoints"), "doomed")
    real = {
        "topic": topic,
        "app": app_name,
        "dlq_id": dlq_ids[0],
        "key": "k1",
        "row_id": row_ids[0],
        "table": customers,
    }
    # A savepoint is written where the body says: generated bodies go to apps that never ran here
    # (refused before anything is written), and only the realistic ones below reach the real app.
    unpinned = {"POST /apps/{app}/savepoints"}

    # Bodies an operator would send, so the writes also succeed, not only fail validation.
    realistic: dict[str, list[Any]] = {
        "POST /topics/{topic}/dlq/redrive": [
            {"all": True, "dry_run": True},
            {"ids": dlq_ids[:3]},
            {"error_type": "NonRetryableError", "limit": 2},
            {"app": app_name, "dry_run": True},
        ],
        "POST /topics/{topic}/dlq/purge": [
            {"ids": dlq_ids[-2:]},
            {"older_than": "1h"},
            {"all": True, "dry_run": True},
        ],
        "POST /apps/{app}/outbox/replay": [
            {"all": True, "dry_run": True},
            {"ids": row_ids[:2]},
        ],
        "POST /apps/{app}/reset": [
            {"to": "start", "dry_run": True},
            {"to": "end", "keep_state": True},
        ],
        "POST /apps/{app}/delete": [{"dry_run": True}],
        "POST /topics/{topic}/delete": [{"dry_run": True}],
        "POST /topics/{topic}/repartition": [{"partitions": 3, "dry_run": True}],
        "POST /topics/{topic}/schema": [
            {"schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            {"schema": {"type": "object"}, "compat": "none"},
        ],
        "POST /topics/{topic}/entries": [
            [{"key": "k1", "value": {"n": 1}}, {"value": 2, "headers": {"h": "v"}}]
        ],
        "POST /apps/{app}/replay": [
            {"topics": [topic], "from_start": True, "dry_run": True},
            {"topics": [topic], "to_time": "2020-01-01T00:00:00Z"},
            {"topics": [topic], "to_id": "0-1", "keep_state": True},
        ],
        "POST /apps/{app}/savepoints": [
            {"to": str(tmp_path / "taken")},
            {"to": str(tmp_path / "taken"), "name": "named"},
            {"resume": True},
        ],
        "POST /apps/{app}/restore": [
            {"from": saved, "dry_run": True},
            {"from": saved, "as": f"{app_name}-fork"},
            {"from": saved, "partitions": 2, "dry_run": True},
            {"from": str(tmp_path / "nowhere")},
        ],
    }

    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", create_app(service, token=TOKEN))
    started = time.monotonic()
    statuses: dict[str, set[int]] = {}
    results = list(schema.get_all_operations())
    assert not [r.err() for r in results if isinstance(r, Err)]  # the document itself is valid
    operations = [r.ok() for r in results if not isinstance(r, Err)]
    assert len(operations) == 31
    for operation in operations:
        names_in_path = {p.name for p in operation.path_parameters}
        pinned = {name: value for name, value in real.items() if name in names_in_path}
        if operation.label in spares:
            pinned = {"topic": spares[operation.label]}  # a topic of its own: the others' data stays
        if operation.label == "DELETE /apps/{app}/savepoints/{name}":
            pinned = {"app": keeper.name, "name": "doomed"}
        strategies = [operation.as_strategy(mode) for mode in GenerationMode]
        if pinned and operation.label not in unpinned:
            strategies += [operation.as_strategy(mode, path_parameters=pinned) for mode in GenerationMode]
        bodies = realistic.get(operation.label, [])
        strategies += [operation.as_strategy(path_parameters=pinned, body=body) for body in bodies]
        statuses[operation.label] = fuzz(st.one_of(strategies))
    elapsed = time.monotonic() - started

    assert all(statuses.values()), statuses
    assert all(s < 500 for codes in statuses.values() for s in codes), statuses
    # Aimed at real data, reads and writes did succeed (their bodies matched the schema too).
    assert all(200 in codes for codes in statuses.values()), statuses
    assert len(service.dlq.dlq_list(topic)) < len(dlq_ids)
    assert elapsed < 60, f"fuzzing took {elapsed:.0f}s"
    service.close()
