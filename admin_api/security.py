"""Bearer-token guard and the audit log of write requests.

Reads are open; every write passes ``bearer_guard``. The token is compared in constant time and
never logged or echoed: the audit line names the client, the action, its target and parameters,
and the outcome, so an operator can answer "who redrove what, and how much moved".
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import msgspec
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

#: One line per write request (refused ones too), at INFO when it succeeded, WARNING otherwise.
audit_logger = logging.getLogger("pspf.audit")

#: The route option naming a write action; routes that carry it are audited.
AUDIT_OPTION = "audit_action"
_PARAMS_STATE = "audit_params"

#: Write routes say in the OpenAPI document that they need the bearer token.
BEARER: list[dict[str, list[str]]] = [{"bearer": []}]

READ_ONLY = "the admin API is read-only: it was started without a token, so writes are refused"


def bearer_guard(token: str | None) -> Guard:
    """A guard that lets a request through only with ``Authorization: Bearer <token>``.

    Without a configured token every write is refused (403), so a forgotten token can never
    leave the API open. A missing or malformed header is 401 with ``WWW-Authenticate: Bearer``;
    a wrong token is 403.
    """
    expected = None if token is None else token.encode()

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        if expected is None:
            raise PermissionDeniedException(READ_ONLY)
        scheme, _sep, given = connection.headers.get("authorization", "").strip().partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            raise NotAuthorizedException(
                "this write needs the header Authorization: Bearer <token>",
                headers={"WWW-Authenticate": 'Bearer realm="pspf-admin"'},
            )
        # Header values arrive decoded as latin-1; encoding them back gives the bytes sent.
        if not hmac.compare_digest(given.encode("latin-1", "replace"), expected):
            raise PermissionDeniedException("the bearer token is not the one this API was started with")

    return guard


class AuditRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An audit line: JSON, so topic names or messages with newlines cannot forge a line."""

    client: str
    action: str
    target: dict[str, Any]
    params: Any = None
    status: int
    outcome: str
    result: Any = None


_audit_encoder = msgspec.json.Encoder()


def remember_params(request: Request[Any, Any, Any], params: msgspec.Struct) -> None:
    """Keep a write's parsed body for its audit line, also if the operation then fails."""
    request.state[_PARAMS_STATE] = params


def audit(request: Request[Any, Any, Any], status: int, outcome: str, result: Any = None) -> None:
    """Log one audit line for ``request`` if its route is a write; nothing otherwise."""
    handler = request.scope.get("route_handler")
    action = handler.opt.get(AUDIT_OPTION) if handler is not None else None
    if action is None:
        return
    record = AuditRecord(
        client=request.client.host if request.client else "unknown",
        action=action,
        target=dict(request.path_params),
        params=request.state.get(_PARAMS_STATE),
        status=status,
        outcome=outcome,
        result=result,
    )
    level = logging.INFO if status < 400 else logging.WARNING
    audit_logger.log(level, "%s", _audit_encoder.encode(record).decode())
