"""The admin API's routes that change data: each needs the bearer token and is audited.

Their request bodies refuse unknown fields, and each route is one call into ``pspf.service``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, post
from litestar.datastructures import State
from litestar.params import FromPath, HeaderParameter, JSONBody
from litestar.types import ControllerRouterHandler

from pspf.admin_api.errors import responses, service_of
from pspf.admin_api.security import AUDIT_OPTION, BEARER, audit, remember_params
from pspf.service import (
    AppRemoval,
    AppReset,
    DlqChange,
    IngestEntry,
    IngestResult,
    OutboxReplay,
    RepartitionResult,
    ReplayResult,
    SchemaVersion,
    TopicRemoval,
    parse_duration_ms,
    parse_position,
)
from pspf.service.ingest import IDEMPOTENCY_KEY_PATTERN

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


class SchemaSetRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf topic schema set`` takes: the schema itself, and what it must keep of the current one."""

    schema: Annotated[
        dict[str, Any], msgspec.Meta(description="a JSON Schema (2020-12, the subset PSPF checks)")
    ]
    compat: Annotated[
        Literal["backward", "forward", "full", "none"],
        msgspec.Meta(description="the compatibility checked against the current version"),
    ] = "backward"


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


class IngestAudit(msgspec.Struct, frozen=True, kw_only=True):
    """What the audit line of an ingest request says of it: not the entries, their number."""

    entries: int
    idempotency_key: str


# -- write routes ---------------------------------------------------------------------------------


@post(
    "/topics/{topic:str}/dlq/redrive",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "dlq.redrive"},
    security=BEARER,
    responses=responses(401, 403, 404),
    summary="Put DLQ entries back into their partitions, each exactly once",
)
def dlq_redrive(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[RedriveRequest]
) -> DlqChange:
    remember_params(request, data)
    change = service_of(state).dlq.dlq_redrive(
        topic, data.ids, data.all, data.error_type, data.app, data.limit, dry_run=data.dry_run
    )
    audit(request, 200, "ok", change)
    return change


@post(
    "/topics/{topic:str}/dlq/purge",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "dlq.purge"},
    security=BEARER,
    responses=responses(401, 403, 404),
    summary="Delete DLQ entries for good",
)
def dlq_purge(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[PurgeRequest]
) -> DlqChange:
    remember_params(request, data)
    older_than_ms = None if data.older_than is None else parse_duration_ms(data.older_than, "older_than")
    change = service_of(state).dlq.dlq_purge(topic, data.ids, data.all, older_than_ms, dry_run=data.dry_run)
    audit(request, 200, "ok", change)
    return change


@post(
    "/apps/{app:str}/replay",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.replay"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Deliver entries again from a position; the app must be stopped",
)
def replay(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[ReplayRequest]
) -> ReplayResult:
    remember_params(request, data)
    position = parse_position(data.from_start, data.to_id, data.to_time)
    result = service_of(state).replay.replay(
        app, data.topics, position, data.keep_state, dry_run=data.dry_run
    )
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/outbox/replay",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "outbox.replay"},
    security=BEARER,
    responses=responses(401, 403, 404),
    summary="Publish dead or published outbox rows again, each once more (queued for the owners)",
)
def outbox_replay(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[OutboxReplayRequest]
) -> OutboxReplay:
    remember_params(request, data)
    # No waiting in a request: the answer lists the partitions whose owners have yet to apply it.
    result = service_of(state).outbox.outbox_replay(
        app, data.ids, data.dead, data.all, data.limit, dry_run=data.dry_run, wait_s=0
    )
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/delete",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.delete"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Remove a retired app from the server (groups, leases, backups, record); it must be stopped",
)
def app_delete(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[AppDeleteRequest]
) -> AppRemoval:
    remember_params(request, data)
    result = service_of(state).retire.delete_app(app, force=data.force, dry_run=data.dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/delete",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.delete"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Remove a topic no app reads any more: its streams, DLQs and records",
)
def topic_delete(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[TopicDeleteRequest]
) -> TopicRemoval:
    remember_params(request, data)
    result = service_of(state).retire.delete_topic(topic, dry_run=data.dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/repartition",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.repartition"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Change a topic's partition count (and the topics read with it), with every app's state",
)
def topic_repartition(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[RepartitionRequest]
) -> RepartitionResult:
    remember_params(request, data)
    result = service_of(state).repartition.repartition_topic(topic, **msgspec.structs.asdict(data))
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/reset",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.reset"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Start a stopped app afresh at the start or the end of its topics, with or without its state",
)
def app_reset(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[AppResetRequest]
) -> AppReset:
    remember_params(request, data)
    result = service_of(state).replay.reset_app(
        app, to_end=data.to == "end", keep_state=data.keep_state, dry_run=data.dry_run
    )
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/entries",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.ingest"},
    security=BEARER,
    responses=responses(401, 403, 404),
    summary="Write entries to a topic; a retry with the same Idempotency-Key adds none of them twice",
)
def ingest(
    request: Request[Any, Any, Any],
    state: State,
    topic: FromPath[str],
    data: JSONBody[list[IngestEntry]],
    idempotency_key: Annotated[
        str,
        HeaderParameter(
            name="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="names the request: a retry with the same key adds nothing twice (required)",
        ),
    ],
) -> IngestResult:
    remember_params(request, IngestAudit(entries=len(data), idempotency_key=idempotency_key))
    result = service_of(state).ingest.ingest(topic, data, idempotency_key)
    audit(request, 200, "ok", result)
    return result


@post(
    "/topics/{topic:str}/schema",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "topic.schema.set"},
    security=BEARER,
    responses=responses(401, 403, 404),
    summary="Set a topic's schema: its next version, once compatible with the current one",
)
def schema_set(
    request: Request[Any, Any, Any], state: State, topic: FromPath[str], data: JSONBody[SchemaSetRequest]
) -> SchemaVersion:
    remember_params(request, data)
    result = service_of(state).schemas.set_schema(topic, data.schema, data.compat)
    audit(request, 200, "ok", result)
    return result


WRITE_ROUTES: list[ControllerRouterHandler] = [
    dlq_redrive,
    dlq_purge,
    replay,
    outbox_replay,
    app_reset,
    app_delete,
    topic_delete,
    topic_repartition,
]
#: Write routes on a path that a read route has too (``create_app`` registers them before the reads).
WRITES_BESIDE_READS: list[ControllerRouterHandler] = [ingest, schema_set]


#: The request bodies, which the OpenAPI document says refuse unknown fields.
BODIES = (
    RedriveRequest,
    PurgeRequest,
    ReplayRequest,
    OutboxReplayRequest,
    AppDeleteRequest,
    AppResetRequest,
    TopicDeleteRequest,
    RepartitionRequest,
    IngestEntry,
    SchemaSetRequest,
)
