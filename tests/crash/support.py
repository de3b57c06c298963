"""Helpers of the crash tests: worker subprocesses, and reading Redis and the stores from outside."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from pspf import codec
from pspf.errors import NotFound, StateError
from pspf.keys import (
    BACKUP_BUCKETS,
    BACKUP_IDENTITY,
    BACKUP_LAYOUT_MARK,
    BACKUP_NAMESPACE,
    STATE_NAMESPACE,
    StreamId,
    backup_keys,
    backup_meta_key,
    bucket_keys,
    lease_key,
    stream_key,
)
from pspf.partition.batch import iter_state
from pspf.state_stores import open_store
from tests.conftest import pspf_command

APP_TARGET = "tests.crash.apps:main"
#: The file engines the crash tests run with (``pspf run --store``).
ENGINES = ["sqlite", "rocksdb"]
SUMMARY = re.compile(
    rb"processed (\d+) entr(?:y|ies) \((\d+) already done\), "
    rb"(\d+) dead-lettered, (\d+) failed attempts? retried"
)

Records = list[tuple[str | None, Any]]


# -- input and expected result ---------------------------------------------------------------------


def order_records(n: int, keys: int, seed: int) -> Records:
    rng = random.Random(seed)
    return [(f"k{rng.randrange(keys)}", {"amount": rng.randrange(1, 1000)}) for _ in range(n)]


def expected_state(records: Records) -> dict[str, tuple[int, int]]:
    """Per key (count, total) after applying every record exactly once."""
    counts: dict[str, int] = defaultdict(int)
    totals: dict[str, int] = defaultdict(int)
    for key, value in records:
        assert key is not None
        counts[key] += 1
        totals[key] += value["amount"]
    return {k: (counts[k], totals[k]) for k in counts}


# -- worker subprocesses ------------------------------------------------------------------------


class WorkerProcess:
    """One ``pspf run`` subprocess of ``target`` (the crash app unless told); its stdout and stderr
    go to a log file."""

    def __init__(
        self,
        log: Path,
        args: list[str],
        env: dict[str, str],
        cwd: Path,
        target: str = APP_TARGET,
        command: tuple[str, ...] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``command``: another ``pspf`` command than ``run target`` (``args`` follow it);
        ``prefix`` runs it through another command (``ip netns exec NS``)."""
        self.log = log
        self.started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*prefix, *pspf_command(*(command or ("run", target)), *args)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.log.stem} still running after {timeout}s\n{self.tail()}"
            ) from None

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return f"--- last lines of {self.log.name} ---\n" + "\n".join(text[-lines:])

    def summary(self) -> tuple[int, int, int]:
        """(handled, already done, failures) from the final line of a run that returned.

        failures: entries dead-lettered plus failed attempts retried (0: nothing failed).
        """
        found = SUMMARY.findall(self.log.read_bytes())
        assert found, f"no summary line in the log\n{self.tail()}"
        handled, skipped, dead, retried = found[-1]
        return int(handled), int(skipped), int(dead) + int(retried)


# -- leases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    consumer: str
    pid: int
    token: int


def leases(client: redis.Redis, topic: str, app: str, partitions: int) -> dict[int, Lease | None]:
    """Who holds each partition's lease: the value is ``consumer/pid/random|token``."""
    found: dict[int, Lease | None] = {}
    for p in range(partitions):
        raw = client.get(lease_key(topic, p, app))
        if raw is None:
            found[p] = None
            continue
        owner, _, token = raw.decode().rpartition("|")
        consumer, pid, _ = owner.rsplit("/", 2)
        found[p] = Lease(consumer, int(pid), int(token))
    return found


def held_by(client: redis.Redis, topic: str, app: str, partitions: int, pid: int) -> bool:
    return all(
        lease is not None and lease.pid == pid for lease in leases(client, topic, app, partitions).values()
    )


def no_leases(client: redis.Redis, topic: str, app: str, partitions: int) -> bool:
    return all(lease is None for lease in leases(client, topic, app, partitions).values())


# -- what Redis and the stores say about one partition --------------------------------------------


def _sid(raw: bytes | str | None) -> StreamId | None:
    return None if raw is None else StreamId.parse(raw)


@dataclass
class PartitionView:
    partition: int
    checkpoint: StreamId | None
    last_id: StreamId | None
    last_delivered: StreamId | None
    pending: dict[StreamId, str]  # pending id -> consumer
    #: delivered entries above the checkpoint that are not pending: acknowledged before commit
    acked_uncommitted: list[StreamId] = field(default_factory=list)
    applied: int = 0  # sum of the state counts in the store

    @property
    def pending_done(self) -> int:
        """Pending entries at or below the checkpoint: committed, not yet acknowledged."""
        cp = self.checkpoint
        return sum(1 for i in self.pending if cp is not None and i <= cp)

    @property
    def pending_todo(self) -> int:
        return len(self.pending) - self.pending_done


def read_store(
    state_dir: Path, app: str, partition: int, engine: str = "sqlite"
) -> tuple[dict[str, StreamId], dict[str, dict[str, Any]]]:
    """Checkpoints and state of one partition's store, read-only (works while a worker runs).

    ``engine`` is the store the worker runs with (``--store``). A worker creates the file before
    its tables: a store caught in between reads as empty.
    """
    for attempt in range(50):
        try:
            with open_store(engine, state_dir, app, partition, readonly=True) as store:
                return store.checkpoints(), dict(iter_state(store))
        except NotFound:
            return {}, {}
        except StateError:
            if attempt == 49:
                raise
            time.sleep(0.02)
    raise AssertionError("unreachable")


def view_partition(
    client: redis.Redis, state_dir: Path, topic: str, app: str, partition: int, engine: str = "sqlite"
) -> PartitionView:
    """One partition seen from outside; safe while a worker runs.

    Redis is read before the store: an entry found acknowledged was committed before that read
    (if the worker keeps its promise), so the checkpoint read after it covers the entry.
    """
    stream = stream_key(topic, partition)
    info = client.xinfo_stream(stream)
    groups = [g for g in client.xinfo_groups(stream) if g["name"] == app.encode()]
    last_delivered = _sid(groups[0]["last-delivered-id"]) if groups else None
    pending: dict[StreamId, str] = {}
    if groups:
        for row in client.xpending_range(stream, app, "-", "+", 1_000_000):
            pending[StreamId.parse(row["message_id"])] = row["consumer"].decode()
    checkpoints, state = read_store(state_dir, app, partition, engine)
    checkpoint = checkpoints.get(topic)
    view = PartitionView(
        partition=partition,
        checkpoint=checkpoint,
        last_id=_sid(info["last-generated-id"]),
        last_delivered=last_delivered,
        pending=pending,
        applied=sum(v["count"] for v in state.values()),
    )
    delivered = last_delivered is not None and last_delivered != StreamId(0, 0)
    if delivered and (checkpoint is None or checkpoint < last_delivered):
        low = f"({checkpoint}" if checkpoint is not None else "-"
        for raw_id, _ in client.xrange(stream, low, str(last_delivered)):
            entry_id = StreamId.parse(raw_id)
            if entry_id not in pending:
                view.acked_uncommitted.append(entry_id)
    return view


def view_all(
    client: redis.Redis, state_dir: Path, topic: str, app: str, partitions: int, engine: str = "sqlite"
) -> list[PartitionView]:
    return [view_partition(client, state_dir, topic, app, p, engine) for p in range(partitions)]


def assert_no_ack_before_commit(views: list[PartitionView]) -> None:
    """Every delivered entry above a partition's checkpoint is still pending."""
    for v in views:
        assert not v.acked_uncommitted, (
            f"partition {v.partition}: {len(v.acked_uncommitted)} entries acknowledged but not committed "
            f"(checkpoint {v.checkpoint}, first {v.acked_uncommitted[:3]})"
        )


def all_state(
    state_dir: Path, app: str, partitions: int, engine: str = "sqlite"
) -> dict[int, dict[str, dict[str, Any]]]:
    return {p: read_store(state_dir, app, p, engine)[1] for p in range(partitions)}


def backup_hash(client: redis.Redis, topic: str, partition: int, app: str) -> dict[bytes, bytes]:
    """Every field of a partition's backup, from all its buckets (its meta says how many)."""
    names = backup_keys(topic, partition, app)
    buckets = int(client.hget(names.meta, BACKUP_BUCKETS) or 1)
    found: dict[bytes, bytes] = {}
    for key in bucket_keys(names.values, buckets):
        found.update(client.hgetall(key))
    found.pop(BACKUP_LAYOUT_MARK, None)
    return found


def backup_state(client: redis.Redis, topic: str, app: str, partition: int) -> dict[str, dict[str, Any]]:
    """One partition's state as its backup in Redis holds it (what a new owner restores)."""
    head = STATE_NAMESPACE.encode() + b"\x00"
    return {
        name[len(head) :].decode(): codec.state_decoder.decode(value)
        for name, value in backup_hash(client, topic, partition, app).items()
        if name.startswith(head)
    }


def backup_applied(client: redis.Redis, topic: str, app: str, partitions: int) -> int:
    """Entries whose effects the backups of every partition hold (the crash app counts them)."""
    return sum(v["count"] for p in range(partitions) for v in backup_state(client, topic, app, p).values())


def backup_checkpoint(client: redis.Redis, topic: str, app: str, partition: int) -> StreamId | None:
    raw = client.hget(backup_meta_key(topic, partition, app), f"cp:{topic}")
    return None if raw is None else StreamId.parse(raw)


def assert_exact(
    client: redis.Redis,
    state_dir: Path,
    topic: str,
    app: str,
    partitions: int,
    records: Records,
    engine: str = "sqlite",
) -> None:
    """State = every record applied once; nothing pending; each checkpoint = its stream's last id."""
    got: dict[str, tuple[int, int]] = {}
    for p, state in all_state(state_dir, app, partitions, engine).items():
        for key, value in state.items():
            assert key not in got, f"key {key} has state in two partitions (also {p})"
            got[key] = (value["count"], value["total"])
    want = expected_state(records)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = {k: (got[k], want[k]) for k in want.keys() & got.keys() if got[k] != want[k]}
    assert not (missing or extra or wrong), (
        f"state differs from the input: {len(missing)} keys missing {missing[:5]}, {len(extra)} extra, "
        f"{len(wrong)} wrong (got, want): {dict(list(wrong.items())[:5])}; "
        f"counted {sum(c for c, _ in got.values())} of {len(records)} entries"
    )
    for v in view_all(client, state_dir, topic, app, partitions, engine):
        assert not v.pending, f"partition {v.partition}: {len(v.pending)} entries still pending"
        assert v.checkpoint == v.last_id, (
            f"partition {v.partition}: checkpoint {v.checkpoint} != last id {v.last_id}"
        )


def assert_store_files(state_dir: Path, app: str, partitions: int, engine: str) -> None:
    """Each partition's store is of ``engine`` (``--store`` reached the worker), none of another."""
    found = sorted(p.name for p in (state_dir / app).iterdir())
    stores = [name for name in found if re.fullmatch(r"p\d+\.(sqlite|rocksdb)", name)]
    assert stores == sorted(f"p{p}.{engine}" for p in range(partitions)), found


# -- the state backup, the stores' batch identity, and process states ----------------------------


def backup_identity(client: redis.Redis, topic: str, app: str, partition: int) -> str | None:
    """The batch identity the backup of one partition holds (None: no backup)."""
    raw = cast(bytes | None, client.hget(backup_meta_key(topic, partition, app), BACKUP_IDENTITY))
    return None if raw is None else raw.decode()


def store_identity(state_dir: Path, app: str, partition: int, engine: str = "sqlite") -> str | None:
    """The batch identity one partition's store holds (None: no store or none recorded)."""
    for attempt in range(50):
        try:
            with open_store(engine, state_dir, app, partition, readonly=True) as store:
                raw = store.get(BACKUP_NAMESPACE, BACKUP_IDENTITY)
                return None if raw is None else raw.decode()
        except NotFound:
            return None
        except StateError:
            if attempt == 49:
                raise
            time.sleep(0.02)
    raise AssertionError("unreachable")


def backup_raw(client: redis.Redis, topic: str, app: str, partitions: int) -> dict[int, tuple[Any, Any, Any]]:
    """Every partition's backup exactly as Redis holds it: values, meta and log entries."""
    found: dict[int, tuple[Any, Any, Any]] = {}
    for p in range(partitions):
        names = backup_keys(topic, p, app)
        found[p] = (backup_hash(client, topic, p, app), client.hgetall(names.meta), client.xrange(names.log))
    return found


def assert_backup_exact(client: redis.Redis, topic: str, app: str, partitions: int, records: Records) -> None:
    """The backups hold every record applied once, and each checkpoint is its stream's last id."""
    got: dict[str, tuple[int, int]] = {}
    for p in range(partitions):
        for key, value in backup_state(client, topic, app, p).items():
            assert key not in got, f"key {key} has state in two partitions' backups (also {p})"
            got[key] = (value["count"], value["total"])
        last = _sid(client.xinfo_stream(stream_key(topic, p))["last-generated-id"])
        assert backup_checkpoint(client, topic, app, p) == last, f"partition {p}: backup checkpoint"
        assert backup_identity(client, topic, app, p), f"partition {p}: the backup has no identity"
    want = expected_state(records)
    wrong = {k: (got.get(k), want.get(k)) for k in want.keys() | got.keys() if got.get(k) != want.get(k)}
    assert not wrong, (
        f"the backup differs from the input for {len(wrong)} keys (got, want): "
        f"{dict(list(wrong.items())[:5])}"
    )


def state_get_from_backup(redis_url: str, app: str, keys: list[str], cwd: Path) -> dict[str, Any]:
    """``pspf state get APP KEY --json`` for each key, without a state dir, run from ``cwd``.

    In process (a subprocess per key would take minutes for a thousand keys). No state dir is
    named and ``cwd`` holds none: the values can only come from the backups in Redis.
    """
    from click.testing import CliRunner

    from pspf.cli import cli

    runner = CliRunner()
    unset: dict[str, str | None] = {name: None for name in os.environ if name.startswith("PSPF_")}
    found: dict[str, Any] = {}
    here = Path.cwd()
    os.chdir(cwd)
    try:
        for key in keys:
            args = ["state", "get", app, key, "--json", "--broker", redis_url]
            result = runner.invoke(cli, args, env=unset)
            assert result.exit_code == 0, f"pspf state get {app} {key}: {result.output}"
            found[key] = json.loads(result.output)
    finally:
        os.chdir(here)
    return found


def process_state(pid: int) -> str:
    """The state letter Linux shows for a process (``T``: stopped by a signal)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]
