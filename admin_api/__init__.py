"""The admin HTTP API: a thin face over ``pspf.service`` for operators.

``create_app(service, token)`` builds the Litestar application; ``pspf admin serve`` runs it.
"""

from pspf.admin_api.app import create_app

__all__ = ["create_app"]
