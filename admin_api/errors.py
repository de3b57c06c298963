"""How the admin API answers a failure: one JSON shape, the status each PSPF error maps to.

Every error response is ``ErrorBody`` (one line), never a traceback; ``responses`` lists in the
OpenAPI document the statuses a route may answer, with what each means.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.datastructures import State
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec

from pspf.admin_api.security import audit
from pspf.errors import (
    AppRunning,
    AuthenticationFailed,
    BrokerError,
    BrokerUnavailable,
    ConfigError,
    NotFound,
    ParameterError,
    PSPFError,
    SchemaError,
    StateOutOfReach,
    StoreLocked,
)
from pspf.service import Service

logger = logging.getLogger("pspf.admin")


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error response: one line saying what went wrong."""

    error: str


#: PSPF errors to HTTP statuses, most specific first.
_STATUS: list[tuple[type[PSPFError], int]] = [
    (NotFound, 404),
    (ConfigError, 422),
    (SchemaError, 422),
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
    404: "unknown topic, app, DLQ id, key, table, row or savepoint",
    409: "the app is running or the operation under way, its store is in use, or its state is out of reach",
    422: "invalid request: parameters, body or a selection the operation refuses",
    502: "Redis refused a command",
    503: "Redis is unreachable, or refuses the broker URL's login",
}


def responses(*statuses: int) -> dict[int, ResponseSpec]:
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


def on_error(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorBody]:
    """One JSON shape for every error; never a traceback in a response."""
    status, message, headers = _classify(exc)
    if status == 500:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    audit(request, status, "refused" if status in (401, 403) else "failed: " + message)
    return Response(ErrorBody(error=message), status_code=status, headers=headers)


def service_of(state: State) -> Service:
    """The one service the app was created over (kept in the app state, shared by every request)."""
    found: Service = state.service
    return found
