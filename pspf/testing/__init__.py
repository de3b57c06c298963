"""Test an app without a server: ``TestApp`` runs it in-process, synchronously, on a clock you move.

Example:
    with TestApp(app, topics={"vip-customers": 1}) as t:
        t.send("orders", {"amount": 120}, key="u1")
        assert t.state("u1") == {"total": 120, "count": 1}
        assert t.emitted("vip-customers") == [{"user": "u1"}]

The room ``testapp`` holds ``TestApp`` and ``EmittedEntry``: it drives the worker's own parts
(the attempt loop of ``pspf.cycle``, the commit of ``pspf.partition``, windows and timers) with an
in-memory store per partition in place of Redis. For tests against a real server, the pytest
plugin (``pspf.pytest_plugin``) gives the ``pspf_server`` and ``pspf_settings`` fixtures. This
face is a public path: ``from pspf.testing import TestApp``.
"""

from __future__ import annotations

from pspf.testing.testapp import EmittedEntry, TestApp

__all__ = ["EmittedEntry", "TestApp"]
