"""The admin API's savepoint routes: list, take and delete an app's savepoints, and restore from one.

``pspf app savepoints|savepoint|restore`` over HTTP (``pspf.service.savepoints``). The list is a
read; the others change data, so they need the bearer token and are audited, as the routes in
``writes`` are. ``create_app`` registers them beside those.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.types import ControllerRouterHandler

from pspf.admin_api.errors import responses, service_of
from pspf.admin_api.security import AUDIT_OPTION, BEARER, audit, remember_params
from pspf.savepoint.manifest import SavepointEntry
from pspf.service import SavepointRestored, SavepointTaken

# -- bodies ---------------------------------------------------------------------------------------


class SavepointRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf app savepoint`` takes: where to write it, under which name."""

    to: Annotated[
        str | None,
        msgspec.Meta(
            description="a directory, or s3://bucket/prefix (the files extra); the savepoint is written "
            "into its folder NAME (required unless resume)"
        ),
    ] = None
    name: Annotated[
        str | None, msgspec.Meta(description="the savepoint's name (default: the UTC time it is taken)")
    ] = None
    resume: Annotated[bool, msgspec.Meta(description="take again the savepoint a crash interrupted")] = False
    stop: Annotated[bool, msgspec.Meta(description="stop the app's workers first, each after its batch")] = (
        False
    )
    timeout_s: Annotated[
        float, msgspec.Meta(ge=0, le=600, description="how long stop waits for the workers, in seconds")
    ] = 60.0


class RestoreRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What ``pspf app restore`` takes: the savepoint, and the fork to restore it as."""

    source: Annotated[
        str | None,
        msgspec.Meta(
            description="the savepoint's path, as taking it answered (required unless resume)",
        ),
    ] = msgspec.field(default=None, name="from")
    as_app: Annotated[
        str | None, msgspec.Meta(description="restore a fork under this new app name instead of the app")
    ] = msgspec.field(default=None, name="as")
    partitions: (
        Annotated[int, msgspec.Meta(ge=1, le=1024, description="the partition count the topics must have")]
        | None
    ) = None
    dry_run: Annotated[bool, msgspec.Meta(description="say what would change; change nothing")] = False
    resume: Annotated[bool, msgspec.Meta(description="finish a restore a crash interrupted")] = False


class SavepointDeleteParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the audit line of a savepoint's deletion says of its query."""

    dry_run: bool


# -- routes ---------------------------------------------------------------------------------------


@get(
    "/apps/{app:str}/savepoints",
    sync_to_thread=True,
    responses=responses(),
    summary="The savepoints of an app the server knows of, oldest first",
)
def savepoints_list(state: State, app: FromPath[str]) -> list[SavepointEntry]:
    return service_of(state).savepoints.listed(app)


@post(
    "/apps/{app:str}/savepoints",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.savepoint"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Write a savepoint of an app, running or stopped: its state and positions at one cut",
)
def savepoint_take(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[SavepointRequest]
) -> SavepointTaken:
    remember_params(request, data)
    result = service_of(state).savepoints.take(
        app, data.to, data.name, resume=data.resume, stop=data.stop, timeout_s=data.timeout_s
    )
    audit(request, 200, "ok", result)
    return result


@delete(
    "/apps/{app:str}/savepoints/{name:str}",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.savepoint.delete"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Delete a savepoint of an app: its files and the server's entry",
)
def savepoint_delete(
    request: Request[Any, Any, Any],
    state: State,
    app: FromPath[str],
    name: FromPath[str],
    dry_run: Annotated[bool, QueryParameter(description="say what would be deleted; change nothing")] = False,
) -> SavepointEntry:
    remember_params(request, SavepointDeleteParams(dry_run=dry_run))
    result = service_of(state).savepoints.delete(app, name, dry_run=dry_run)
    audit(request, 200, "ok", result)
    return result


@post(
    "/apps/{app:str}/restore",
    sync_to_thread=True,
    status_code=200,
    opt={AUDIT_OPTION: "app.restore"},
    security=BEARER,
    responses=responses(401, 403, 404, 409),
    summary="Put a stopped app, or a fork of it under a new name, at a savepoint",
)
def app_restore(
    request: Request[Any, Any, Any], state: State, app: FromPath[str], data: JSONBody[RestoreRequest]
) -> SavepointRestored:
    remember_params(request, data)
    result = service_of(state).savepoints.restore(
        app, data.source, data.as_app, data.partitions, dry_run=data.dry_run, resume=data.resume
    )
    audit(request, 200, "ok", result)
    return result


READ_ROUTES: list[ControllerRouterHandler] = [savepoints_list]
WRITE_ROUTES: list[ControllerRouterHandler] = [savepoint_delete, app_restore]
#: On the path of the list (``create_app`` registers them before the reads).
WRITES_BESIDE_READS: list[ControllerRouterHandler] = [savepoint_take]
#: The request bodies, which the OpenAPI document says refuse unknown fields.
BODIES = (SavepointRequest, RestoreRequest)
