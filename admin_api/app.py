"""The admin HTTP API: routes over ``pspf.service``, the error mapping and ``create_app``.

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
from typing import Annotated, Any, Literal

import msgspec
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, JSONBody, PathParameter, QueryParameter
from litestar.response import Redirect
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler
from prometheus_client import CollectorRegistry
from swagger_ui_bundle import swagger_ui_path

from pspf.admin_api import metrics
from pspf.admin_api.security import AUDIT_OPTION, audit, audit_logger, bearer_guard, remember_params
from pspf.errors import (
    AppRunning,
    AuthenticationFailed,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    NotFound,
    ParameterError,
    PSPFError,
    StateOutOfReach,
    StoreLocked,
)
from pspf.service import (
    AppLag,
    AppRemoval,
    AppReset,
    DeadLetterDetail,
    DeadLetterInfo,
    DlqChange,
    Health,
    OpenWindow,
    OutboxReplay,
    OutboxRowDetail,
    OutboxRowInfo,
    RepartitionResult,
    ReplayResult,
    Service,
    TopicDescription,
    TopicEntry,
    TopicInfo,
    TopicRemoval,
    parse_duration_ms,
    parse_position,
    parse_read_start,
)

logger = logging.getLogger("pspf.admin")

# -- bodies ---------------------------------------------------------------------------------------


#: A DLQ id as ``pspf dlq list`` prints it, ``PARTITION:MS-SEQ``, in ASCII digits. Checked here
#: too, at the HTTP edge, so the OpenAPI document says so and a number Redis cannot take as a
#: stream id (over 64 bits) is refused as a bad request instead of reaching Redis.
DLQ_ID_PATTERN = r"^[0-9]{1,9}:[0-9]{1,19}(-[0-9]{1,19})?$"
DlqId = Annotated[
    str, msgspec.Meta(pattern=DLQ_ID_PATTERN, description="PARTITION:ID as the DLQ list shows it")
]


ROW_ID_PATTERN = r"^[0-9]{1,9}:[0-9]{1,18}$"
RowId = Annotated[
    str, msgspec.Meta(pattern=ROW_ID_PATTERN, description="PARTITION:ROW as the outbox list shows it")
]


class OutboxReplayRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf outbox replay`` takes: row ids, or every dead (or dead and published) row."""

    ids: list[RowId] = []
    dead: Annotated[bool, msgspec.Meta(description="every dead row")] = False
    all: Annotated[bool, msgspec.Meta(description="every dead and every published row")] = False
    limit: Annotated[int, msgspec.Meta(ge=1)] | None = None
    dry_run: Annotated[bool, msgspec.Meta(description="say what would be replayed; change nothing")] = False


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error response: one line saying what went wrong."""

    error: str


class RedriveRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf dlq redrive`` takes: DLQ ids, or a selection; unknown fields are refused."""

    ids: list[DlqId] = []
    all: Annotated[bool, msgspec.Meta(description="every DLQ entry of the topic")] = False
    error_type: Annotated[str | None, msgspec.Meta(description="entries that failed with this type")] = None
    app: Annotated[str | None, msgspec.Meta(description="entries this app dead-lettered")] = None
    limit: Annotated[int, msgspec.Meta(ge=1)] | None = None
    dry_run: Annotated[bool, msgspec.Meta(description="say what would move; change nothing")] = False


class PurgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf dlq purge`` takes: DLQ ids, or a selection; unknown fields are refused."""

    ids: list[DlqId] = []
    all: Annotated[bool, msgspec.Meta(description="every DLQ entry of the topic")] = False
    older_than: Annotated[
        str | None, msgspec.Meta(description="entries that failed longer ago, e.g. 7d, 12h, 30m")
    ] = None
    dry_run: Annotated[bool, msgspec.Meta(description="say what would be deleted; change nothing")] = False


class ReplayRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf replay`` takes: the topics and exactly one of the three positions."""

    topics: Annotated[list[str], msgspec.Meta(min_length=1)]
    from_start: bool = False
    to_id: Annotated[str | None, msgspec.Meta(description="replay the entries after this id")] = None
    to_time: Annotated[
        str | None, msgspec.Meta(description="replay the entries added from this time: ISO 8601 or unix ms")
    ] = None
    keep_state: Annotated[
        bool, msgspec.Meta(description="keep the state: replayed entries are applied AGAIN onto it")
    ] = False
    dry_run: bool = False


class AppDeleteRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf app delete`` takes."""

    force: Annotated[bool, msgspec.Meta(description="delete even while workers of the app are alive")] = False
    dry_run: Annotated[bool, msgspec.Meta(description="say what would be removed; change nothing")] = False


class TopicDeleteRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf topic delete`` takes."""

    dry_run: Annotated[bool, msgspec.Meta(description="say what would be removed; change nothing")] = False


class RepartitionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf topic repartition`` takes."""

    partitions: Annotated[int, msgspec.Meta(ge=1, le=1024, description="the new partition count")] | None = (
        None
    )
    resume: Annotated[bool, msgspec.Meta(description="finish a repartition a crash interrupted")] = False
    abort: Annotated[bool, msgspec.Meta(description="undo a repartition that has not switched")] = False
    dry_run: Annotated[bool, msgspec.Meta(description="say what would move; change nothing")] = False


class AppResetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf app reset`` takes; ``to`` is required here, where no prompt confirms a reset."""

    to: Annotated[
        Literal["start", "end"],
        msgspec.Meta(description="start: every entry again; end: only entries produced from now on"),
    ]
    keep_state: Annotated[bool, msgspec.Meta(description="keep the state; move only the positions")] = False
    dry_run: Annotated[bool, msgspec.Meta(description="say what would change; change nothing")] = False


#: The most entries one read of a topic returns: a page to look at, not an export.
MAX_READ = 1000


# -- status mapping -------------------------------------------------------------------------------

#: PSPF errors to HTTP statuses, most specific first.
_STATUS: list[tuple[type[PSPFError], int]] = [
    (NotFound, 404),
    (ConfigError, 422),
    (AppRunning, 409),
    (StoreLocked, 409),
    (StateOutOfReach, 409),
    (BrokerUnavailable, 503),
    # Every request would fail the same until the URL changes: the broker is unusable, not
    # refusing one command.
    (AuthenticationFailed, 503),
    (BrokerError, 502),
]

_DESCRIPTIONS = {
    401: "no or malformed Authorization header",
    403: "wrong token, or the API is read-only",
    404: "unknown topic, app, DLQ id, key, table or row",
    409: "the app is running or the operation under way, its store is in use, or its state is out of reach",
    422: "invalid request: parameters, body or a selection the operation refuses",
    502: "Redis refused a command",
    503: "Redis is unreachable, or refuses the broker URL's login",
}


def _errors(*statuses: int) -> dict[int, ResponseSpec]:
    return {
        s: ResponseSpec(ErrorBody, description=_DESCRIPTIONS[s], generate_examples=False)
        for s in (*statuses, 422, 502, 503)
    }


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _validation_message(exc: ValidationException) -> str:
    problems = []
    for item in exc.extra if isinstance(exc.extra, list) else []:
        if not isinstance(item, dict):
            continue
        where = " ".join(str(getattr(item[k], "value", item[k])) for k in ("source", "key") if item.get(k))
        message = str(item.get("message", ""))
        # A missing field comes back as its name's repr (a KeyError's text).
        if message == repr(item.get("key")):
            message = "required"
        problems.append(f"{where}: {message}" if where else message)
    return _one_line("invalid request: " + ("; ".join(problems) or str(exc.detail)))


def _classify(exc: Exception) -> tuple[int, str, dict[str, str] | None]:
    if isinstance(exc, ValidationException):
        return 422, _validation_message(exc), None
    if isinstance(exc, HTTPException):
        # Litestar's other 400s are malformed requests too (e.g. a body that is not JSON).
        status = 422 if exc.status_code == 400 else exc.status_code
        return status, _one_line(exc.detail), exc.headers
    if isinstance(exc, ParameterError):
        # The service names parameters as the request fields and query parameters are named.
        return 422, _one_line(exc.phrase(repr)), None
    if isinstance(exc, PSPFError):
        status = next((s for kind, s in _STATUS if isinstance(exc, kind)), 500)
        return status, _one_line(exc) or type(exc).__name__, None
    return 500, "internal error; the server log has the details", None


def _on_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorBody]:
    """One JSON shape for every error; never a traceback in a response."""
    status, message, headers = _classify(exc)
    if status == 500:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    audit(request, status, "refused" if status in (401, 403) else "failed: " + message)
    return Response(ErrorBody(error=message), status_code=status, headers=headers)


# -- read routes ----------------------------------------------------------------------------------


def _service(state: State) -> Service:
    """The one service the app was created over (kept in the app state, shared by every request)."""
    found: Service = state.service
    return found


@get("/health", sync_to_thread=True, responses=_errors(), summary="Whether Redis answers, and how fast")
def health(state: State) -> Health:
    return _service(state).health()


@get("/topics", sync_to_thread=True, responses=_errors(), summary="Topics and their partition counts")
def list_topics(state: State) -> list[TopicInfo]:
    return _service(state).list_topics()


@get(
    "/topics/{topic:str}",
    sync_to_thread=True,
    responses=_errors(404),
    summary="Partitions, lengths and groups",
)
def describe_topic(state: State, topic: FromPath[str]) -> TopicDescription:
    return _service(state).describe_topic(topic)


@get("/topics/{topic:str}/dlq", sync_to_thread=True, responses=_errors(404), summary="DLQ entries of a topic")
def dlq_list(
    state: State,
    topic: FromPath[str],
    app: Annotated[str | None, QueryParameter(description="only entries this app dead-lettered")] = None,
    error_type: Annotated[str | None, QueryParameter(description="only entries that failed with it")] = None,
    limit: Annotated[int | None, QueryParameter(ge=1, description="at most this many entries")] = None,
) -> list[DeadLetterInfo]:
    return _service(state).dlq_list(topic, app, error_type, limit)


@get(
    "/topics/{topic:str}/dlq/{dlq_id:str}",
    sync_to_thread=True,
    responses=_errors(404),
    summary="One DLQ entry whole",
)
def dlq_show(
    state: State,
    topic: FromPath[str],
    dlq_id: Annotated[str, PathParameter(pattern=DLQ_ID_PATTERN, description="PARTITION:ID as listed")],
) -> DeadLetterDetail:
    return _service(state).dlq_show(topic, dlq_id)


@get(
    "/topics/{topic:str}/entries",
    sync_to_thread=True,
    responses=_errors(404),
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
    entries, _ = _service(state).read_topic(topic, partition, position, count)
    return entries


@get("/groups", sync_to_thread=True, responses=_errors(), summary="Every app that ran here, with its lag")
def groups(state: State) -> list[AppLag]:
    return _service(state).groups()


@get(
    "/apps/{app:str}/lag",
    sync_to_thread=True,
    responses=_errors(404),
    summary="An app's lag per topic partition",
)
def app_lag(state: State, app: FromPath[str]) -> AppLag:
    return _service(state).lag(app)


@get(
    "/apps/{app:str}/state/{key:str}",
    sync_to_thread=True,
    responses=_errors(404),
    summary="The state of one key (from its backup in Redis; with the backup off, the state directory)",
)
def state_get(state: State, app: FromPath[str], key: FromPath[str]) -> dict[str, Any]:
    return _service(state).state_get(app, key)


@get(
    "/apps/{app:str}/state/{key:str}/windows",
    sync_to_thread=True,
    responses=_errors(404),
    summary="The open windows of one key, oldest first, each with its window's name",
)
def state_windows(state: State, app: FromPath[str], key: FromPath[str]) -> list[OpenWindow]:
    return _service(state).state_windows(app, key)


@get(
    "/apps/{app:str}/tables/{table:str}/{key:str}",
    sync_to_thread=True,
    responses=_errors(404),
    summary="The row of one key in a table, from its state backup; a global table's from a worker's "
    "store under the state dir the API was started with",
)
def table_row(state: State, app: FromPath[str], table: FromPath[str], key: FromPath[str]) -> Any:
    return _service(state).table_row(app, table, key)


@get("/apps/{app:str}/outbox", sync_to_thread=True, responses=_errors(404), summary="An app's outbox rows")
def outbox_list(
    state: State,
    app: FromPath[str],
    row_state: Annotated[
        str | None, QueryParameter(name="state", description="pending, claimed, published or dead")
    ] = None,
    partition: Annotated[int | None, QueryParameter(ge=0, description="only this source partition")] = None,
    limit: Annotated[int | None, QueryParameter(ge=1, description="at most this many rows")] = None,
) -> list[OutboxRowInfo]:
    return _service(state).outbox_list(app, row_state, partition, limit)


@get(
    "/apps/{app:str}/outbox/{row_id:str}",
    sync_to_thread=True,
    responses=_errors(404),
    summary="One outbox row whole",
)
def outbox_show(
    state: State,
    app: FromPath[str],
    row_id: Annotated[str, PathParameter(pattern=ROW_ID_PATTERN, description="PARTITION:ROW as listed")],
) -> OutboxRowDetail:
    return _service(state).outbox_show(app, row_id)


@get(
    "/metrics",
    sync_to_thread=True,
    media_type=metrics.MEDIA_TYPE,
    summary="Broker-level Prometheus metrics, read from Redis at scrape time",
)
def prometheus_metrics(state: State) -> bytes:
    registry: CollectorRegistry = state.registry
    return metrics.render(registry)


# -- write routes ---------------------------------------------------------------------------------


#: Write routes say in the OpenAPI document that they need the bearer token.
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}]


@post(
    "/topics/{topic:str}/dlq/redrive",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "dlq.redrive"},
    security=_BEARER,
    responses=_errors(401, 403, 404),
    summary="Put DLQ entries back into their partitions, each exactly once",
)
def dlq_redrive(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[RedriveRequest]
) -> DlqChange:
    remember_params(request, data)
    change = _service(state).dlq_redrive(
        topic, data.ids, data.all, data.error_type, data.app, data.limit, dry_run=data.dry_run
    )
    audit(request, 200, "ok", change)
    return change


@post(
    "/topics/{topic:str}/dlq/purge",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "dlq.purge"},
    security=_BEARER,
    responses=_errors(401, 403, 404),
    summary="Delete DLQ entries for good",
)
def dlq_purge(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[PurgeRequest]
) -> DlqChange:
    remember_params(request, data)
    older_than_ms = None if data.older_than is None else parse_duration_ms(data.older_than, "older_than")
    change = _service(state).dlq_purge(topic, data.ids, data.all, older_than_ms, dry_run=data.dry_run)
    audit(request, 200, "ok", change)
    return change


@post(
    "/apps/{app:str}/replay",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.replay"},
    security=_BEARER,
    responses=_errors(401, 403, 404, 409),
    summary="Deliver entries again from a position; the app must be stopped",
)
def replay(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[ReplayRequest]
) -> ReplayResult:
    remember_params(request, data)
    position = parse_position(data.from_start, data.to_id, data.to_time)
    result = _service(state).replay(app, data.topics, position, data.keep_state, dry_run=data.dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/outbox/replay",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "outbox.replay"},
    security=_BEARER,
    responses=_errors(401, 403, 404),
    summary="Publish dead or published outbox rows again, each once more (queued for the owners)",
)
def outbox_replay(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[OutboxReplayRequest]
) -> OutboxReplay:
    remember_params(request, data)
    # No waiting in a request: the answer lists the partitions whose owners have yet to apply it.
    result = _service(state).outbox_replay(
        app, data.ids, data.dead, data.all, data.limit, dry_run=data.dry_run, wait_s=0
    )
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/delete",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.delete"},
    security=_BEARER,
    responses=_errors(401, 403, 404, 409),
    summary="Remove a retired app from the server (groups, leases, backups, record); it must be stopped",
)
def app_delete(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[AppDeleteRequest]
) -> AppRemoval:
    remember_params(request, data)
    result = _service(state).delete_app(app, force=data.force, dry_run=data.dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/delete",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.delete"},
    security=_BEARER,
    responses=_errors(401, 403, 404, 409),
    summary="Remove a topic no app reads any more: its streams, DLQs and records",
)
def topic_delete(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[TopicDeleteRequest]
) -> TopicRemoval:
    remember_params(request, data)
    result = _service(state).delete_topic(topic, dry_run=data.dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/repartition",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.repartition"},
    security=_BEARER,
    responses=_errors(401, 403, 404, 409),
    summary="Change a topic's partition count (and the topics read with it), with every app's state",
)
def topic_repartition(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[RepartitionRequest]
) -> RepartitionResult:
    remember_params(request, data)
    result = _service(state).repartition_topic(topic, **msgspec.structs.asdict(data))
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/reset",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.reset"},
    security=_BEARER,
    responses=_errors(401, 403, 404, 409),
    summary="Start a stopped app afresh at the start or the end of its topics, with or without its state",
)
def app_reset(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[AppResetRequest]
) -> AppReset:
    remember_params(request, data)
    result = _service(state).reset_app(
        app, to_end=data.to == "end", keep_state=data.keep_state, dry_run=data.dry_run
    )
    audit(request, 200, "ok", result)
    return result


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
    prometheus_metrics,
]
_WRITE_ROUTES: list[ControllerRouterHandler] = [
    dlq_redrive,
    dlq_purge,
    replay,
    outbox_replay,
    app_reset,
    app_delete,
    topic_delete,
    topic_repartition,
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
    writes = Router("/", route_handlers=_WRITE_ROUTES, guards=[bearer_guard(token)])
    app = Litestar(
        route_handlers=[*_READ_ROUTES, writes, *_pages()],
        exception_handlers={Exception: _on_error},
        openapi_config=OpenAPIConfig(
            title="PSPF admin API",
            version="1",
            description="Topics, lag, DLQ and replay of a PSPF broker; writes need a bearer token.",
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
        for operation in (path_item.get, path_item.post):
            if operation is not None and operation.responses:
                operation.responses.pop("400", None)
    schemas = openapi.components.schemas or {}
    for body in (
        RedriveRequest,
        PurgeRequest,
        ReplayRequest,
        OutboxReplayRequest,
        AppDeleteRequest,
        AppResetRequest,
        TopicDeleteRequest,
        RepartitionRequest,
    ):
        schemas[body.__name__].additional_properties = False
