"""The admin HTTP API: the read routes, the pages and ``create_app``.

The routes that change data are in ``writes`` (behind the bearer token), an app's savepoints in
``savepoints``, the error mapping in ``errors``.

Built on Litestar because it speaks msgspec natively: the handlers return the very msgspec
Structs ``pspf.service`` returns and ``pspf ... --json`` prints, so a response body is the CLI's
JSON, and the OpenAPI document (``/schema/openapi.json``) is generated from those same Structs
instead of a second set of models. Every operation is one call into the service;
nothing here talks to Redis or the state stores itself.

The service is synchronous (redis-py), so every handler runs in a worker thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

from litestar import Litestar, Router, get
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, PathParameter, QueryParameter
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler
from prometheus_client import CollectorRegistry
from swagger_ui_bundle import swagger_ui_path

from pspf.admin_api import metrics, savepoints
from pspf.admin_api.errors import on_error, responses, service_of
from pspf.admin_api.security import audit_logger, bearer_guard
from pspf.admin_api.writes import BODIES, DLQ_ID_PATTERN, ROW_ID_PATTERN, WRITE_ROUTES, WRITES_BESIDE_READS
from pspf.service import (
    AppLag,
    DeadLetterDetail,
    DeadLetterInfo,
    Health,
    OpenWindow,
    OutboxRowDetail,
    OutboxRowInfo,
    SchemaVersion,
    Service,
    TopicDescription,
    TopicEntry,
    TopicInfo,
    parse_read_start,
)

#: The most entries one read of a topic returns: a page to look at, not an export.
MAX_READ = 1000


# -- read routes ----------------------------------------------------------------------------------


def _service(state: State) -> Service:
    """The one service the app was created over (kept in the app state, shared by every request)."""
    found: Service = state.service
    return found


@get("/health", sync_to_thread=True, responses=responses(), summary="Whether Redis answers, and how fast")
def health(state: State) -> Health:
    return service_of(state).topics.health()


@get("/topics", sync_to_thread=True, responses=responses(), summary="Topics and their partition counts")
def list_topics(state: State) -> list[TopicInfo]:
    return service_of(state).topics.list_topics()


@get(
    "/topics/{topic:str}",
    sync_to_thread=True,
    responses=responses(404),
    summary="Partitions, lengths and groups",
)
def describe_topic(state: State, topic: FromPath[str]) -> TopicDescription:
    return service_of(state).topics.describe_topic(topic)


@get(
    "/topics/{topic:str}/dlq", sync_to_thread=True, responses=responses(404), summary="DLQ entries of a topic"
)
def dlq_list(
    state: State,
    topic: FromPath[str],
    app: Annotated[str | None, QueryParameter(description="only entries this app dead-lettered")] = None,
    error_type: Annotated[str | None, QueryParameter(description="only entries that failed with it")] = None,
    limit: Annotated[int | None, QueryParameter(ge=1, description="at most this many entries")] = None,
) -> list[DeadLetterInfo]:
    return service_of(state).dlq.dlq_list(topic, app, error_type, limit)


@get(
    "/topics/{topic:str}/dlq/{dlq_id:str}",
    sync_to_thread=True,
    responses=responses(404),
    summary="One DLQ entry whole",
)
def dlq_show(
    state: State,
    topic: FromPath[str],
    dlq_id: Annotated[str, PathParameter(pattern=DLQ_ID_PATTERN, description="PARTITION:ID as listed")],
) -> DeadLetterDetail:
    return service_of(state).dlq.dlq_show(topic, dlq_id)


@get(
    "/topics/{topic:str}/entries",
    sync_to_thread=True,
    responses=responses(404),
    summary="A topic's latest entries (or the first from a position), oldest first, values decoded",
)
def topic_entries(
    state: State,
    topic: FromPath[str],
    partition: Annotated[int | None, QueryParameter(ge=0, description="only this partition")] = None,
    start: Annotated[
        str | None,
        QueryParameter(
            name="from",
            description="the first entries at or after this entry id or time (ISO 8601 or unix ms); "
            "without it, the latest",
        ),
    ] = None,
    count: Annotated[int, QueryParameter(ge=1, le=MAX_READ, description="at most this many entries")] = 20,
) -> list[TopicEntry]:
    # Oldest first either way, as `pspf topic read` prints them: the latest entry is the last.
    position = None if start is None else parse_read_start(start)
    entries, _ = service_of(state).reading.read_topic(topic, partition, position, count)
    return entries


@get("/groups", sync_to_thread=True, responses=responses(), summary="Every app that ran here, with its lag")
def groups(state: State) -> list[AppLag]:
    return service_of(state).apps.groups()


@get(
    "/apps/{app:str}/lag",
    sync_to_thread=True,
    responses=responses(404),
    summary="An app's lag per topic partition",
)
def app_lag(state: State, app: FromPath[str]) -> AppLag:
    return service_of(state).apps.lag(app)


@get(
    "/apps/{app:str}/state/{key:str}",
    sync_to_thread=True,
    responses=responses(404),
    summary="The state of one key (from its backup in Redis; with the backup off, the state directory)",
)
def state_get(state: State, app: FromPath[str], key: FromPath[str]) -> dict[str, Any]:
    return service_of(state).state.state_get(app, key)


@get(
    "/apps/{app:str}/state/{key:str}/windows",
    sync_to_thread=True,
    responses=responses(404),
    summary="The open windows of one key, oldest first, each with its window's name",
)
def state_windows(state: State, app: FromPath[str], key: FromPath[str]) -> list[OpenWindow]:
    return service_of(state).state.state_windows(app, key)


@get(
    "/apps/{app:str}/tables/{table:str}/{key:str}",
    sync_to_thread=True,
    responses=responses(404),
    summary="The row of one key in a table, from its state backup; a global table's from a worker's "
    "store under the state dir the API was started with",
)
def table_row(state: State, app: FromPath[str], table: FromPath[str], key: FromPath[str]) -> Any:
    return service_of(state).tables.table_row(app, table, key)


@get("/apps/{app:str}/outbox", sync_to_thread=True, responses=responses(404), summary="An app's outbox rows")
def outbox_list(
    state: State,
    app: FromPath[str],
    row_state: Annotated[
        str | None, QueryParameter(name="state", description="pending, claimed, published or dead")
    ] = None,
    partition: Annotated[int | None, QueryParameter(ge=0, description="only this source partition")] = None,
    limit: Annotated[int | None, QueryParameter(ge=1, description="at most this many rows")] = None,
) -> list[OutboxRowInfo]:
    return service_of(state).outbox.outbox_list(app, row_state, partition, limit)


@get(
    "/apps/{app:str}/outbox/{row_id:str}",
    sync_to_thread=True,
    responses=responses(404),
    summary="One outbox row whole",
)
def outbox_show(
    state: State,
    app: FromPath[str],
    row_id: Annotated[str, PathParameter(pattern=ROW_ID_PATTERN, description="PARTITION:ROW as listed")],
) -> OutboxRowDetail:
    return service_of(state).outbox.outbox_show(app, row_id)


@get(
    "/metrics",
    sync_to_thread=True,
    media_type=metrics.MEDIA_TYPE,
    summary="Broker-level Prometheus metrics, read from Redis at scrape time",
)
def prometheus_metrics(state: State) -> bytes:
    registry: CollectorRegistry = state.registry
    return metrics.render(registry)


@get(
    "/topics/{topic:str}/schema",
    sync_to_thread=True,
    responses=responses(404),
    summary="A topic's current schema, or one version of it",
)
def schema_show(
    state: State,
    topic: FromPath[str],
    version: Annotated[
        int | None, QueryParameter(ge=1, description="this version (default: the current)")
    ] = None,
) -> SchemaVersion:
    return service_of(state).schemas.show(topic, version)


@get(
    "/topics/{topic:str}/schema/history",
    sync_to_thread=True,
    responses=responses(404),
    summary="Every version of a topic's schema, the first first",
)
def schema_history(state: State, topic: FromPath[str]) -> list[SchemaVersion]:
    return service_of(state).schemas.history(topic)


@get(
    "/apps/{app:str}/asyncapi",
    sync_to_thread=True,
    responses=responses(404),
    summary="The app's AsyncAPI 3.0.0 document, as its last worker recorded it",
)
def app_asyncapi(state: State, app: FromPath[str]) -> dict[str, Any]:
    return service_of(state).apps.asyncapi(app)


_READ_ROUTES: list[ControllerRouterHandler] = [
    health,
    list_topics,
    describe_topic,
    topic_entries,
    dlq_list,
    dlq_show,
    groups,
    app_lag,
    state_get,
    state_windows,
    table_row,
    outbox_list,
    outbox_show,
    schema_show,
    schema_history,
    app_asyncapi,
    prometheus_metrics,
]
# -- pages ----------------------------------------------------------------------------------------

#: The operator's page (``/ui/``): HTML, JS and CSS shipped in the package, calling the routes above.
WEB_DIR = Path(__file__).parent / "web"
#: Swagger UI's own files, from the swagger-ui-bundle wheel: ``/schema`` loads nothing from the internet.
SWAGGER_UI_ASSETS = "/schema-assets"


@get("/", include_in_schema=False, sync_to_thread=False)
def home() -> Redirect:
    return Redirect("/ui/")


def _swagger_ui() -> SwaggerRenderPlugin:
    return SwaggerRenderPlugin(
        js_url=f"{SWAGGER_UI_ASSETS}/swagger-ui-bundle.js",
        css_url=f"{SWAGGER_UI_ASSETS}/swagger-ui.css",
        standalone_preset_js_url=f"{SWAGGER_UI_ASSETS}/swagger-ui-standalone-preset.js",
        favicon=f"<link rel='icon' type='image/png' href='{SWAGGER_UI_ASSETS}/favicon-32x32.png'>",
    )


def _pages() -> list[ControllerRouterHandler]:
    """The operator's page, the way to it from ``/``, and Swagger UI's files (none in the schema)."""
    return [
        home,
        create_static_files_router("/ui", directories=[WEB_DIR], html_mode=True, name="ui"),
        create_static_files_router(SWAGGER_UI_ASSETS, directories=[Path(swagger_ui_path)], name="swagger-ui"),
    ]


def create_app(service: Service, token: str | None) -> Litestar:
    """The admin API over ``service``; without ``token`` it is read-only (writes get 403)."""
    if audit_logger.level == logging.NOTSET:
        audit_logger.setLevel(logging.INFO)  # audit lines must not vanish under a WARNING root
    registry = metrics.make_registry(service)
    # Registering copies the handlers, so each app (and token) gets its own guarded copies.
    guard = bearer_guard(token)
    writes = Router("/", route_handlers=[*WRITE_ROUTES, *savepoints.WRITE_ROUTES], guards=[guard])
    # Writes on a path a read route has too go before the reads: Litestar then gives the path one
    # OPTIONS handler (a second router's own would clash with the reads').
    beside = [*WRITES_BESIDE_READS, *savepoints.WRITES_BESIDE_READS]
    beside_reads = Router("/", route_handlers=beside, guards=[guard])
    app = Litestar(
        route_handlers=[beside_reads, *_READ_ROUTES, *savepoints.READ_ROUTES, writes, *_pages()],
        exception_handlers={Exception: on_error},
        openapi_config=OpenAPIConfig(
            title="PSPF admin API",
            version="1",
            description="Topics, lag, DLQ, replay and savepoints of a PSPF broker; writes need a bearer "
            "token.",
            path="/schema",
            render_plugins=[_swagger_ui()],
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        ),
        state=State({"service": service, "registry": registry}),
        logging_config=None,
    )
    _amend_openapi(app)
    return app


def _amend_openapi(app: Litestar) -> None:
    """Make the generated document say what the API does where Litestar's defaults differ.

    Validation failures are answered 422, not 400; request bodies refuse unknown fields.
    """
    openapi = app.openapi_schema
    for path_item in (openapi.paths or {}).values():
        for operation in (path_item.get, path_item.post, path_item.delete):
            if operation is not None and operation.responses:
                operation.responses.pop("400", None)
    schemas = openapi.components.schemas or {}
    for body in (*BODIES, *savepoints.BODIES):
        schemas[body.__name__].additional_properties = False
