"""Renewals of the membership from two threads (the lease round and the lease keeper).

A renewal that finds the membership gone says loudly that PSPF keys vanished, but only when it
was sent after a renewal's reply came back: two calls in flight at once may be served in the
other order, so the later-sent one can find the worker not yet joined without anything lost.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import msgspec
import pytest

from pspf.broker import Leasing
from pspf.ownership.membership import MemberInfo, Membership

ROW = ("m1", 0, 10_000, msgspec.json.encode(MemberInfo("c", "h", 1, 10_000)))


class Server:
    """``member_heartbeat`` answers given per call, each call waiting for its go when told to."""

    def __init__(self, answers: list[tuple[bool, threading.Event | None, threading.Event | None]]) -> None:
        self.answers = answers
        self.calls = 0
        self.lock = threading.Lock()

    def member_heartbeat(self, *args: Any, **kwargs: Any) -> tuple[int, bool, list[Any]]:
        with self.lock:
            present, entered, go = self.answers[self.calls]
            self.calls += 1
        if entered is not None:
            entered.set()
        if go is not None:
            assert go.wait(5)
        return 1_000, present, [ROW]


def vanished(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "vanished" in r.getMessage()]


def test_two_first_renewals_served_in_the_other_order_say_nothing_vanished(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pspf")
    first_in, second_served, first_applied = threading.Event(), threading.Event(), threading.Event()
    # The first call is served second (it finds the member joined by the second); the second is
    # served first (not yet a member) and its reply is applied last.
    server = Server([(True, first_in, second_served), (False, second_served, first_applied)])
    member = Membership(cast(Leasing, server), "app", "m1", "c", 10_000)
    first = threading.Thread(target=member.heartbeat)
    first.start()
    assert first_in.wait(5)
    second = threading.Thread(target=member.heartbeat)
    second.start()
    first.join(5)
    first_applied.set()
    second.join(5)
    assert server.calls == 2
    assert vanished(caplog) == []


def test_a_renewal_sent_after_a_reply_that_finds_the_membership_gone_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pspf")
    server = Server([(False, None, None), (True, None, None), (False, None, None)])
    member = Membership(cast(Leasing, server), "app", "m1", "c", 10_000)
    member.heartbeat()  # joins
    member.heartbeat()
    assert vanished(caplog) == []
    member.heartbeat()  # gone well before its TTL: deleted or evicted
    assert len(vanished(caplog)) == 1
