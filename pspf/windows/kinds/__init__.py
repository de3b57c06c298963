"""The window kinds, registered in one place: what ``windows.tumbling(...)`` and its siblings make.

A kind is one module here: a ``WindowKind`` subclass (``base``: the protocol, ``WindowSpec`` and
the registry) and the function that checks its sizes and makes its ``WindowSpec``. To add one,
write its module and register its class below (or, outside PSPF, call ``register`` once before
declaring windows of it); ``docs/how-to/time.md`` says what each method answers, and
``tests/conformance/test_window_kinds.py`` checks every registered kind.
"""

from __future__ import annotations

from pspf.windows.kinds.base import (
    KINDS,
    NO_REMOVES,
    Change,
    Folding,
    Kind,
    LatePolicy,
    WindowId,
    WindowKind,
    WindowSpec,
    kind_of,
    ms,
    register,
)
from pspf.windows.kinds.counted import Counted, hopping_count, tumbling_count
from pspf.windows.kinds.hopping import Hopping, hopping
from pspf.windows.kinds.session import Session, session
from pspf.windows.kinds.sliding import Sliding, sliding
from pspf.windows.kinds.tumbling import Tumbling, tumbling

register(Tumbling)
register(Hopping)
register(Sliding)
register(Session)
register(Counted)

__all__ = [
    "KINDS",
    "NO_REMOVES",
    "Change",
    "Counted",
    "Folding",
    "Hopping",
    "Kind",
    "LatePolicy",
    "Session",
    "Sliding",
    "Tumbling",
    "WindowId",
    "WindowKind",
    "WindowSpec",
    "hopping",
    "hopping_count",
    "kind_of",
    "ms",
    "register",
    "session",
    "sliding",
    "tumbling",
    "tumbling_count",
]
