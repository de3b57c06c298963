"""Who runs a repartition: each topic of a plan claimed atomically before anything is read.

A plan is recorded under every topic it moves (``plan_key``), and the command running it holds
a lease beside it (``runner_key``), renewed from a thread every third of its time to live. Both
are written by one script (``lua/repartition_claim.lua``), so of two commands started together
one records its plan and the other is refused (``UnderWay``) before it reads an entry; a
``--resume`` takes up the recorded plan only once no runner holds it (a killed runner's lease
lapses). Topics are claimed in name order; one already claimed undoes the claims taken.

An abort (``abort``) undoes a plan that has not begun its switch: it turns the plan into an
abort mark (``lua/repartition_abort.lua``, with commands a server at its ``maxmemory`` still
runs), deletes the staged keys, unseals the topics and forgets the plan. A claim is refused while
the mark is there, and an interrupted abort is taken up again by the next ``--abort``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from types import TracebackType

import msgspec

from pspf import keys
from pspf.broker import Broker
from pspf.errors import BrokerError, BrokerOutOfMemory, ConfigError, NotFound, UnderWay
from pspf.ownership.operation_lease import Renewal
from pspf.repartition.run import STAGED, Plan, make_plan, plan_key, recorded, unseal


def runner_key(topic: str) -> str:
    """The lease of the command running the repartition of ``topic`` (the plan's slot)."""
    return plan_key(topic) + ":runner"


def abort_key(topic: str) -> str:
    """The plan of ``topic`` while an abort undoes it (the plan's slot)."""
    return plan_key(topic) + ":abort"


def claim_keys(topic: str) -> list[str]:
    return [plan_key(topic), runner_key(topic), abort_key(topic)]


def refusal(topic: str, plan: Plan | None, runner: str, ttl_ms: int) -> UnderWay:
    """The one line that refuses a command while a repartition of ``topic`` is under way."""
    command = f"pspf topic repartition {topic}"
    if plan is None:
        return UnderWay(f"a repartition of {topic!r} is being set up by {_who(runner)}: wait for it")
    what = f"a repartition of {topic!r} to {plan.new} partitions"
    if runner:
        since = datetime.fromtimestamp(plan.started_ms / 1000).strftime("%H:%M:%S")
        return UnderWay(
            f"{what} is being run by {_who(runner)} (since {since}, at its {plan.step} step): wait "
            f"for it to end; if that process is gone, `{command} --resume` takes it up once its "
            f"claim lapses ({ttl_ms / 1000:g}s after it stopped)"
        )
    return UnderWay(
        f"{what} was interrupted at its {plan.step} step: finish it with `{command} --resume`, "
        f"or undo it with `{command} --abort`"
    )


def under_way(broker: Broker, topic: str, ttl_ms: int) -> UnderWay | None:
    """The refusal while a repartition of ``topic`` is recorded or being aborted, else None."""
    if broker.moving.hash_fields(abort_key(topic)):
        return _aborting(topic)
    plan = recorded(broker, topic)
    if plan is None:
        return None
    return refusal(topic, plan, broker.leases.lease_values([runner_key(topic)])[0] or "", ttl_ms)


def _aborting(topic: str) -> UnderWay:
    return UnderWay(
        f"an abort of the repartition of {topic!r} is under way: let it end, or run "
        f"`pspf topic repartition {topic} --abort` to finish it"
    )


def _who(runner: str) -> str:
    """The host and process a runner's lease names (``host/pid/nonce``)."""
    host, _, rest = runner.partition("/")
    return f"{host} pid {rest.partition('/')[0]}"


class Claim:
    """A process's claim on every topic of a plan: renewed in a thread while held, then given up.

    Entering starts the renewals; leaving gives the leases up, and forgets a new plan that never
    sealed its topics (a refusal, an error before anything moved). ``check`` raises once a
    renewal found the claim gone (this process stalled past the lease's time to live).
    """

    def __init__(self, broker: Broker, plan: Plan, runner: str, ttl_ms: int, new: bool) -> None:
        self.broker = broker
        self.plan = plan
        self.runner = runner
        self.ttl_ms = ttl_ms
        self.new = new
        self._renewal = Renewal(broker, [(runner_key(t), runner) for t in plan.topics], ttl_ms)

    def check(self) -> None:
        """Raise when the claim lapsed: another command may run the plan now."""
        if self._renewal.lost:
            raise BrokerError(
                f"the claim on the repartition of {self.plan.topic!r} lapsed (this process did not "
                f"renew it within {self.ttl_ms / 1000:g}s): stopped before its next step; another "
                "command may have taken it up"
            )

    def checked(self, crash_at: Callable[[str], None]) -> Callable[[str], None]:
        """``crash_at`` that checks the claim first: every step starts only while it is held."""

        def at(step: str) -> None:
            self.check()
            crash_at(step)

        return at

    def __enter__(self) -> Claim:
        self._renewal.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.give_up(failed=exc is not None)

    def give_up(self, failed: bool) -> None:
        """Stop renewing and give the leases up; a new plan that failed before its seal is forgotten."""
        self._renewal.stop()
        sealed = any(self.broker.topics.topic_layout(t)[2] for t in self.plan.topics)
        release(self.broker, self.plan.topics, self.runner, forget=failed and self.new and not sealed)


def release(broker: Broker, topics: list[str], runner: str, forget: bool) -> None:
    """Give up this runner's leases on ``topics``; with ``forget``, the plan it recorded under them too."""
    if forget:
        mine = broker.leases.lease_values([runner_key(t) for t in topics])
        broker.moving.delete_keys(
            [plan_key(t) for t, value in zip(topics, mine, strict=True) if value == runner]
        )
    broker.leases.release_leases([(runner_key(t), runner) for t in topics])


def runner_name() -> str:
    """The name of the running process in its lease: ``host/pid/nonce``."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def take_new(broker: Broker, topic: str, partitions: int, ttl_ms: int) -> Claim:
    """Record a new plan under each of its topics, or refuse (``UnderWay``) before reading entries."""
    refused = under_way(broker, topic, ttl_ms)
    if refused is not None:
        raise refused
    plan = make_plan(broker, topic, partitions)
    runner = runner_name()
    encoded = msgspec.json.encode(plan).decode()
    taken: list[str] = []
    for name in plan.topics:
        status, *rest = broker.moving.claim_repartition(claim_keys(name), encoded, runner, ttl_ms)
        if status != "taken":
            release(broker, taken, runner, forget=True)
            raise _held(name, status, rest, ttl_ms)
        taken.append(name)
    claim = Claim(broker, plan, runner, ttl_ms, new=True)
    try:  # a repartition that ended between the plan and the claim changed what the plan read
        again = make_plan(broker, topic, partitions)
        if (again.topics, again.apps, again.old, again.layouts) != (
            plan.topics,
            plan.apps,
            plan.old,
            plan.layouts,
        ):
            raise UnderWay(
                f"the topics read with {topic!r} changed while the repartition was planned (another "
                "repartition ended, or an app started reading one): run the command again"
            )
    except BaseException:
        claim.give_up(failed=True)
        raise
    return claim


def _held(topic: str, status: str, rest: list[str], ttl_ms: int) -> UnderWay:
    if status == "aborting":
        return _aborting(topic)
    plan = msgspec.json.decode(rest[0], type=Plan) if rest and rest[0] else None
    return refusal(topic, plan, rest[1] if len(rest) > 1 else "", ttl_ms)


def take_recorded(broker: Broker, topic: str, ttl_ms: int) -> Claim:
    """Take up the plan recorded for ``topic`` (``--resume``): once no live runner holds it.

    A runner's lease outlives a killed runner by its time to live: this waits that long, then
    refuses (``UnderWay``) a runner still renewing it.
    """
    plan = recorded(broker, topic)
    if plan is None:
        if broker.moving.hash_fields(abort_key(topic)):
            raise _aborting(topic)
        raise NotFound(f"no repartition of topic {topic!r} to resume")
    runner = runner_name()
    taken: list[str] = []
    deadline = time.monotonic() + ttl_ms / 1000 + 1.0
    for name in plan.topics:
        while True:
            status, *rest = broker.moving.claim_repartition(claim_keys(name), "", runner, ttl_ms)
            if status == "taken" or status != "held" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if status != "taken":
            release(broker, taken, runner, forget=False)
            if status == "none":
                raise NotFound(f"no repartition of topic {topic!r} to resume (it ended meanwhile)")
            raise _held(name, status, rest, ttl_ms)
        taken.append(name)
    return Claim(broker, msgspec.json.decode(rest[0], type=Plan), runner, ttl_ms, new=False)


def abort(broker: Broker, topic: str, ttl_ms: int) -> Plan:
    """Undo the repartition of ``topic`` that has not begun its switch: staged keys deleted, unsealed.

    Raises:
        NotFound: no repartition of ``topic`` is under way.
        UnderWay: a live command runs it (after waiting for a killed one's lease to lapse).
        ConfigError: it began its switch: only ``--resume`` can end it.
    """
    found = recorded(broker, topic)
    plan = found if found is not None else aborting_plan(broker, topic)
    if plan is None:
        raise NotFound(f"no repartition of topic {topic!r} to abort")
    deadline = time.monotonic() + ttl_ms / 1000 + 1.0
    for name in plan.topics:
        while True:
            status, *rest = broker.moving.claim_abort(claim_keys(name))
            if status != "held" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if status == "held":
            raise refusal(topic, plan, rest[0], ttl_ms)
        if status == "switched":
            raise ConfigError(
                f"the repartition of {topic!r} to {plan.new} partitions has begun its switch and "
                f"cannot be undone: finish it with `pspf topic repartition {topic} --resume` (if the "
                "server is out of memory, raise its maxmemory first)"
            )
    delete_staged(broker, plan)
    _once_memory_is_freed(lambda: unseal(broker, plan), topic)
    broker.moving.delete_keys([abort_key(t) for t in plan.topics])
    return plan


def _once_memory_is_freed(write: Callable[[], None], topic: str, seconds: float = 30.0) -> None:
    """Run ``write``, again while the server stays over its maxmemory for up to ``seconds``.

    A server may free what a DEL dropped in the background (lazyfree, Valkey's default), so the
    abort's first writes after its deletes can still meet the limit for a moment.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            write()
            return
        except BrokerOutOfMemory as exc:
            if time.monotonic() >= deadline:
                raise BrokerOutOfMemory(
                    f"{exc}; the abort deleted the staged copies but the server stayed full for "
                    f"{seconds:.0f}s: free memory and run `pspf topic repartition {topic} --abort` again"
                ) from exc
            time.sleep(0.2)


def aborting_plan(broker: Broker, topic: str) -> Plan | None:
    """The plan an abort of ``topic``'s repartition was undoing when it was interrupted, if any."""
    raw = broker.moving.hash_fields(abort_key(topic)).get("plan")
    return None if raw is None else msgspec.json.decode(raw, type=Plan)


def delete_staged(broker: Broker, plan: Plan) -> None:
    """Delete every staged key of ``plan``: the new streams, DLQs and state backups copied so far."""
    staged = [
        live + STAGED
        for t in plan.topics
        for q in range(plan.new)
        for live in (keys.stream_key(t, q), keys.dlq_key(t, q))
    ]
    for app in plan.apps:
        first = broker.apps.app_topic_list(app)[0]
        for q in range(plan.new):
            backup = keys.backup_keys(first, q, app)
            staged += [backup.values + STAGED, backup.meta + STAGED]
    broker.moving.delete_keys(staged)
