"""Fixtures that bundle what many integration tests repeat (registered in ``tests/conftest.py``).

``app_on_topic``: create a fresh topic, produce entries into it, and build an app of a fresh name
that reads it, in one call. It is built on the shared ``make_topic``, ``produce`` and ``names``
fixtures, so it needs the test server as they do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pspf import App

if TYPE_CHECKING:
    from tests.conftest import Names

#: (key, value) pairs as the ``produce`` fixture sends them
Records = Sequence[tuple[str | None, Any]]


@dataclass
class AppOnTopic:
    """A fresh topic, an app of a fresh name for it, and what was produced into the topic."""

    topic: str
    partitions: int
    app: App
    #: entries produced by ``app_on_topic`` itself
    produced: int
    _produce: Callable[..., int]

    def produce(self, records: Records) -> int:
        """Produce more (key, value) records into the topic; the number sent."""
        return self._produce(self.topic, list(records))


#: ``build(app name, topic)``: an app of the test's own (its handlers registered)
BuildApp = Callable[[str, str], App]
MakeAppOnTopic = Callable[..., AppOnTopic]


@pytest.fixture
def app_on_topic(
    make_topic: Callable[[int], str], produce: Callable[..., int], names: Names
) -> MakeAppOnTopic:
    """Create a topic of ``partitions``, produce ``records`` into it, and make its app.

    The app is ``build(name, topic)`` when given, else ``App(name, **app_options)`` for the test to
    register its handler on (``@case.app.handler(case.topic)``).
    """

    def make(
        partitions: int = 1,
        records: Records = (),
        build: BuildApp | None = None,
        **app_options: Any,
    ) -> AppOnTopic:
        if build is not None and app_options:
            raise TypeError("app options go to build's App, not to app_on_topic")
        topic = make_topic(partitions)
        produced = produce(topic, list(records)) if records else 0
        name = names.app()
        app = build(name, topic) if build is not None else App(name, **app_options)
        return AppOnTopic(topic, partitions, app, produced, produce)

    return make
