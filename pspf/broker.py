"""Every round trip PSPF makes to Redis or Valkey, one method each.

Replies stay bytes (never ``decode_responses``) so a binary value cannot poison a batch, the
protocol is pinned to RESP2 because the stream replies are parsed here, and redis-py's own retries
are off: re-sending an XREADGROUP whose reply was lost would hide delivered entries, so the worker
reconnects itself and re-reads its pending entries instead. Redis errors are translated here, in one
place, into PSPF's error types.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from importlib import resources
from typing import Any, NamedTuple, cast

import hiredis
import msgspec
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from pspf import codec, keys
from pspf.errors import (
    AuthenticationFailed,
    BackupDamaged,
    BackupWentBack,
    BrokerError,
    BrokerOutOfMemory,
    BrokerUnavailable,
    ConfigError,
    EvictingPolicy,
    GroupMissing,
    LeaseLost,
    MemoryFull,
    NotFound,
)
from pspf.settings import BrokerAddress, RedisSettings, mask_url, parse_broker_url

log = logging.getLogger(__name__)

Fields = dict[bytes, bytes]
#: One entry as read: its id and its fields, or None for an entry deleted while pending.
RawEntry = tuple[bytes, Fields | None]

_CLAIM_COUNT = 1000
#: How often a worker idle on a cluster looks for new entries (``Broker.wait_for_new``).
CLUSTER_POLL_MS = 20
#: How often producers look whether a server without maxmemory got one (``Broker.guard_memory``);
#: with one, they read its memory use before each write.
MEMORY_CHECK_S = 5.0
#: The longest pause a producer takes per write when the server nears its maxmemory.
MEMORY_PAUSE_S = 1.0
#: Updates a state backup's log keeps (about): a store or standby at most this many updates
#: behind catches up from the log; further behind, it restores the whole backup.
BACKUP_LOG_LENGTH = 1000
#: What the server's refusal of a write for memory says (``OOM command not allowed when ...``).
_OOM_TEXT = "command not allowed when used memory > 'maxmemory'"


class BackupUpdate(NamedTuple):
    """Writes to a partition's state backup, made in the call that acknowledges its batch."""

    keys: keys.BackupKeys
    #: the new batch identity; "" leaves it (a later part of an upload)
    identity: str
    checkpoints: Mapping[str, str]
    #: fields and values to set, flat: field, value, field, value, ... (as the call sends them)
    sets: Sequence[bytes]
    deletes: Sequence[bytes]
    #: "update" (logged), "replace" (the first part of a whole upload: the backup is emptied
    #: first) or "upload" (a later part); uploads are not logged
    mode: str = "update"
    #: an update's fence: the identities the backup may hold now (empty: not checked); any other
    #: means the backup went back (a fail-over lost writes) and nothing is done
    follows: Collection[str] = ()


class AckRequest(NamedTuple):
    """Entries of one topic partition to acknowledge, and dead ones to move, under a lease."""

    stream: str
    group: str
    lease_key: str
    lease_value: str
    ids: Sequence[bytes]
    dlq: str = ""
    #: (entry id, DLQ entry fields) of entries to move to the DLQ
    dead: Sequence[tuple[bytes, Fields]] = ()
    #: the partition's backup update, carried by the call of the app's first topic
    backup: BackupUpdate | None = None


class PendingEntry(NamedTuple):
    """One entry of a group's pending list: who holds it, since when, how often delivered."""

    id: bytes
    consumer: str
    idle_ms: int
    deliveries: int


class GroupInfo(NamedTuple):
    """One consumer group of a stream, as XINFO GROUPS says."""

    consumers: int
    pending: int
    last_delivered_id: bytes


class StreamInfo(NamedTuple):
    """A stream's length, last generated id and consumer groups by name (empty if absent)."""

    length: int
    last_id: bytes | None
    groups: dict[str, GroupInfo]


class ServerInfo(NamedTuple):
    """What the connected server is and what it lacks for PSPF's guarantees."""

    version: str
    warnings: list[str]


class GroupPosition(NamedTuple):
    """Where a consumer group stands in one stream (what ``lag`` and the metrics report)."""

    length: int
    last_id: bytes | None
    #: the group's last delivered id; None when the group does not exist
    delivered_id: bytes | None
    #: entries after ``delivered_id``; capped at LAG_COUNT_LIMIT where the server cannot say
    undelivered: int
    pending: int
    oldest_pending_id: bytes | None
    consumers: int

    @property
    def lag(self) -> int:
        """Entries the group has not acknowledged: not yet delivered, or delivered and pending."""
        return self.undelivered + self.pending


#: Without XINFO GROUPS' ``lag`` field (Redis 6.2, or after deletions) lag is counted with XRANGE
#: up to this many entries per stream, and reported as this number beyond it.
LAG_COUNT_LIMIT = 100_000


class _Sentinel(Sentinel):
    """redis-py's Sentinel client, with a "no master found" error that says why in words.

    redis-py's own names each sentinel that failed by its client's repr (every connection
    option, certificate paths included) and the failure by its class only
    ("network:ConnectionError"), so a CA that does not verify or a refused sentinel password reads
    the same as a sentinel that is down. This one gives each sentinel's address and reason.
    """

    def discover_master(self, service_name: str) -> tuple[str, int]:
        """The master's address; an AuthenticationError when every sentinel refused the login."""
        reasons = []
        refused = 0
        for number, sentinel in enumerate(self.sentinels):
            where = "{host}:{port}".format_map(sentinel.connection_pool.connection_kwargs)
            try:
                masters = cast(dict[str, Any], sentinel.sentinel_masters())  # by name: RESP2
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                reasons.append(f"sentinel {where}: {exc}")
                refused += isinstance(exc, redis.AuthenticationError)
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                # The sentinel that answered is asked first next time, as redis-py does.
                self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]
                return state["ip"], state["port"]
        message = f"No master found for {service_name!r}" + "".join(f"; {r}" for r in reasons)
        if refused and refused == len(self.sentinels):
            raise redis.AuthenticationError(message)
        raise MasterNotFoundError(message)


def _connect(settings: RedisSettings, address: BrokerAddress, socket_timeout_s: float) -> Any:
    """The client of the URL's topology: a server, a cluster (routing by slot) or a Sentinel's master.

    redis-py's own retries are off everywhere (see the module docstring); a cluster client still
    follows MOVED/ASK redirections, which re-send nothing that ran.
    """
    common: dict[str, Any] = {
        "protocol": 2,
        "decode_responses": False,
        "socket_connect_timeout": settings.connect_timeout_s,
        "socket_timeout": socket_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    # Given only when set: redis-py's plain connections take no ssl_* arguments, and the URL's
    # own ssl_* options win over these in from_url.
    tls: dict[str, Any] = {
        option: path
        for option, path in [
            ("ssl_ca_certs", settings.tls_ca_file),
            ("ssl_certfile", settings.tls_cert_file),
            ("ssl_keyfile", settings.tls_key_file),
        ]
        if path
    }
    if address.topology == "standalone":
        return redis.Redis.from_url(settings.url, health_check_interval=30, **common, **tls)
    options: dict[str, Any] = dict(address.options)
    sentinel_auth = {
        "username": options.pop("sentinel_username", None),
        "password": options.pop("sentinel_password", None),
    }
    if address.tls:
        tls = {**tls, **options, "ssl": True}
        if "ssl_check_hostname" in tls:
            tls["ssl_check_hostname"] = tls["ssl_check_hostname"].lower() in ("1", "true", "yes")
    auth: dict[str, Any] = {"username": address.username, "password": address.password}
    if address.topology == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in address.hosts],  # type: ignore[no-untyped-call]
            **auth,
            **common,
            **tls,
        )
    sentinel = _Sentinel(  # type: ignore[no-untyped-call]
        address.hosts,
        sentinel_kwargs={**common, **tls, **sentinel_auth},
        **common,
        **tls,
    )
    return sentinel.master_for(  # type: ignore[no-untyped-call]
        address.master, redis_class=redis.Redis, db=address.db, **auth
    )


def _raw_stream_replies(client: redis.Redis) -> None:
    """Stream replies are parsed by ``_entries``, which keeps deleted entries visible."""
    for command in ("XREADGROUP", "XAUTOCLAIM", "XCLAIM"):
        client.response_callbacks.pop(command, None)


def _script(name: str) -> str:
    return resources.files("pspf").joinpath(f"lua/{name}.lua").read_text()


class Broker:
    """A connection pool to one Redis or Valkey server and the commands PSPF sends it."""

    def __init__(self, settings: RedisSettings, socket_timeout_s: float = 30.0) -> None:
        self.url = mask_url(settings.url)
        self.address = parse_broker_url(settings.url)
        #: a Redis Cluster: commands of several partitions go per slot, grouped per node
        self.cluster = self.address.topology == "cluster"
        try:  # a cluster client asks its seed nodes for the slot map at once
            self.client = _connect(settings, self.address, socket_timeout_s)
        except (redis.RedisError, RedisClusterException) as exc:
            self._refused_login(exc)
            raise BrokerUnavailable(f"cannot reach Redis at {self.url}: {exc}") from exc
        self._slots_stale = False
        #: sent after each acknowledging call on its connection (``PSPF_WAIT_REPLICAS``)
        self._wait: tuple[Any, ...] = (
            ("WAIT", settings.wait_replicas, settings.wait_timeout_ms) if settings.wait_replicas else ()
        )
        self._memory_limits = (settings.memory_slow_at, settings.memory_fail_at)
        #: (when last read, highest share of maxmemory in use over the servers)
        self._memory: tuple[float, float] = (-MEMORY_CHECK_S, 0.0)
        self._slowed = False
        if not self.cluster:  # a cluster's node clients are set so in _on
            _raw_stream_replies(self.client)
        self._ack = self.client.register_script(_script("ack"))
        self._redrive = self.client.register_script(_script("redrive"))
        self._sink_write = self.client.register_script(_script("sink_write"))
        self._lease_acquire = self.client.register_script(_script("lease_acquire"))
        self._lease_renew = self.client.register_script(_script("lease_renew"))
        self._lease_release = self.client.register_script(_script("lease_release"))
        self._member_heartbeat = self.client.register_script(_script("member_heartbeat"))
        self._publish = self.client.register_script(_script("publish"))
        self._read = self.client.register_script(_script("read"))
        self._last_ids = self.client.register_script(_script("last_ids"))
        self._read_loaded = False

    def close(self) -> None:
        self.client.close()

    def _on(self, key: str) -> redis.Redis:
        """The client of the server that holds ``key``: the server itself unless it is a cluster.

        Transactions and the replies parsed here (streams) go through it: on a cluster node they
        work as on one server, as long as their keys share a slot (one partition's hash tag).
        """
        if not self.cluster:
            return cast(redis.Redis, self.client)
        with self.translate_errors():
            if self._slots_stale:
                self.client.nodes_manager.initialize()
                self._slots_stale = False
            node = cast(redis.Redis, self.client.get_node_from_key(key).redis_connection)
        _raw_stream_replies(node)
        return node

    def _by_node(self, keys_: Sequence[str]) -> list[tuple[redis.Redis, list[int]]]:
        """The positions of ``keys_`` grouped by the server that holds them (one group unless a cluster)."""
        if not self.cluster:
            return [(cast(redis.Redis, self.client), list(range(len(keys_))))]
        groups: dict[int, tuple[redis.Redis, list[int]]] = {}
        for i, key in enumerate(keys_):
            node = self._on(key)
            groups.setdefault(id(node), (node, []))[1].append(i)
        return list(groups.values())

    @contextmanager
    def translate_errors(self, key: str | None = None) -> Iterator[None]:
        """Turn redis-py exceptions into PSPF errors with a message a user can act on.

        ``key`` names the key a WRONGTYPE reply is about (Redis does not say).
        """
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, redis.WatchError) as exc:
            # A WatchError reaching here is redis-py's name for a connection lost while keys were
            # WATCHed (a lease moving is caught where the transaction runs).
            self._refused_login(exc)
            self._slots_stale = self.cluster  # a node may have failed over: ask the cluster again
            raise BrokerUnavailable(f"cannot reach Redis at {self.url}: {exc}") from exc
        except (AskError, ClusterDownError, TryAgainError, RedisClusterException) as exc:
            # Slots moving or a cluster failing over: the next call asks the cluster where they are.
            self._refused_login(exc)
            self._slots_stale = True
            raise BrokerUnavailable(f"the cluster at {self.url} is changing: {exc}") from exc
        except redis.ResponseError as exc:
            text = str(exc)
            # redis-py strips the OOM prefix; an older server's script error keeps it in its text
            if isinstance(exc, OutOfMemoryError) or _OOM_TEXT in text:
                raise BrokerOutOfMemory(
                    f"the server at {self.url} refuses writes: it is out of memory (maxmemory reached, "
                    f"maxmemory-policy noeviction): {text.rstrip('.')}"
                ) from exc
            if text.startswith("LEASE_LOST"):
                raise LeaseLost(text) from exc
            if "NOGROUP" in text:
                raise GroupMissing(f"consumer group missing: {text}") from exc
            if "WRONGTYPE" in text:
                where = f"key {key}" if key else "a PSPF key"
                raise BrokerError(f"{where} holds the wrong Redis type (expected a stream): {text}") from exc
            raise BrokerError(f"Redis refused a command: {text}") from exc
        except redis.RedisError as exc:
            raise BrokerError(f"Redis error: {exc}") from exc

    def _refused_login(self, exc: BaseException) -> None:
        """Raise AuthenticationFailed when ``exc`` is, or was caused by, a refused login.

        redis-py reports one as a connection error (a cluster client wraps it in its own), which
        would read as an unreachable server. Redis's reply never holds the password.
        """
        seen: BaseException | None = exc
        for _ in range(8):  # a short chain: the error, the cluster client's, a node's
            if seen is None:
                return
            if isinstance(seen, redis.AuthenticationError):
                raise AuthenticationFailed(
                    f"authentication to Redis at {self.url} failed: {seen} (check the user name and "
                    "password of the broker URL)"
                ) from exc
            seen = seen.__cause__ or seen.__context__

    # -- server ---------------------------------------------------------------------------------

    def check_server(self) -> ServerInfo:
        """Check that the server has what PSPF needs and say what weakens the guarantee.

        Features are detected, not inferred from a version: Valkey reports its own versions.
        """
        versions: list[str] = []
        warnings: list[str] = []
        for server in self._servers():
            with self.translate_errors():
                info = server.info("server")
                if server.execute_command("COMMAND", "INFO", "XAUTOCLAIM") in ([None], [], None):  # type: ignore[no-untyped-call]
                    raise BrokerError(
                        f"the server at {self.url} lacks XAUTOCLAIM: PSPF needs Redis >= 6.2 or Valkey"
                    )
            versions.append(str(info.get("valkey_version") or info.get("redis_version") or "unknown"))
            where = "" if not self.cluster else f"node {_node_name(server)}: "
            warnings += [where + warning for warning in _guarantee_warnings(server)]
        return ServerInfo(", ".join(sorted(set(versions))), warnings)

    def check_eviction(self) -> bool:
        """Raise EvictingPolicy when a server may evict keys; False when its policy cannot be read.

        Any ``maxmemory-policy`` but ``noeviction`` may evict PSPF's keys, the ``volatile-*`` ones
        too (leases and markers have a TTL). One cheap ``CONFIG GET`` per server; where CONFIG is
        renamed or refused by an ACL the policy is unchecked.
        """
        checked = True
        for server in self._servers():
            try:
                with self.translate_errors():
                    reply = server.config_get("maxmemory-policy")
            except (BrokerUnavailable, AuthenticationFailed):
                raise
            except BrokerError:
                checked = False
                continue
            policy = _text(next(iter(reply.values()), None)) or "noeviction"
            if policy != "noeviction":
                where = self.url if not self.cluster else f"{self.url} (node {_node_name(server)})"
                raise EvictingPolicy(
                    f"the server at {where} has maxmemory-policy {policy}: it may evict PSPF's streams, "
                    "state backups and leases, so exactly-once cannot hold and the worker stops before "
                    "acknowledging anything more; fix: CONFIG SET maxmemory-policy noeviction (and set "
                    "it in the server's configuration file)"
                )
        return checked

    def _servers(self) -> list[redis.Redis]:
        """Every server PSPF's keys live on: the one, or a cluster's primaries."""
        if not self.cluster:
            return [cast(redis.Redis, self.client)]
        with self.translate_errors():
            return [node.redis_connection for node in self.client.get_primaries()]

    # -- topics ---------------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int) -> bool:
        """Record a topic; False when it exists already with the same partition count.

        Raises:
            ConfigError: it exists with another partition count (the request is at fault, not
                the broker).
        """
        with self.translate_errors():
            created = self.client.hsetnx(keys.topic_key(topic), "partitions", partitions)
            self.client.sadd(keys.TOPICS_KEY, topic)
        if not created:
            existing = self.topic_partitions(topic)
            if existing != partitions:
                raise ConfigError(
                    f"topic {topic!r} exists with {existing} partitions, not {partitions}: "
                    "a topic's partition count is fixed when it is created"
                )
        return bool(created)

    def topic_partitions(self, topic: str) -> int:
        """The partition count of a topic; NotFound when it was never created."""
        with self.translate_errors():
            raw = self.client.hget(keys.topic_key(topic), "partitions")
        if raw is None:
            raise NotFound(
                f"topic {topic!r} does not exist; create it with `pspf topic create {topic} --partitions N`"
            )
        return int(raw)

    def list_topics(self) -> list[str]:
        with self.translate_errors():
            return sorted(_text(t) for t in self.client.smembers(keys.TOPICS_KEY))

    def topic_retention(self, topic: str) -> dict[str, str]:
        """A topic's stored retention fields (``retention.Retention``); empty when none is set."""
        with self.translate_errors():
            raw = self.client.hgetall(keys.topic_key(topic))
        return {
            _text(k)[len("retention:") :]: _text(v) for k, v in raw.items() if k.startswith(b"retention:")
        }

    def set_topic_retention(self, topic: str, fields: Mapping[str, str | None]) -> None:
        """Store retention fields of a topic (None removes one)."""
        key = keys.topic_key(topic)
        with self.translate_errors(), self._on(key).pipeline(transaction=True) as pipe:
            for name, value in fields.items():
                if value is None:
                    pipe.hdel(key, f"retention:{name}")
                else:
                    pipe.hset(key, f"retention:{name}", value)
            pipe.execute()

    def server_time_ms(self) -> int:
        with self.translate_errors():
            seconds, micros = self._servers()[0].time()
        return int(seconds) * 1000 + int(micros) // 1000

    def stream_memory(self, stream: str) -> int | None:
        """The bytes a stream takes on its server (MEMORY USAGE); None where that is not allowed."""
        try:
            with self.translate_errors(stream):
                used = self.client.memory_usage(stream)
        except (BrokerUnavailable, AuthenticationFailed):
            raise
        except BrokerError:  # an ACL user without MEMORY USAGE
            return None
        return None if used is None else int(used)

    def oldest_pending(self, stream: str, group: str) -> bytes | None:
        """The id of the group's oldest pending entry in the stream (None when nothing is pending)."""
        with self.translate_errors(stream):
            summary = self.client.xpending(stream, group)
        return cast(bytes | None, summary.get("min"))

    def nth_id(self, stream: str, n: int) -> bytes | None:
        """The id of the stream's n-th entry from its start (None when it has fewer)."""
        with self.translate_errors(stream):
            entries = cast(list[tuple[bytes, Any]], self.client.xrange(stream, "-", "+", n))
        return bytes(entries[-1][0]) if len(entries) == n else None

    def trim_before(self, stream: str, before: str) -> int:
        """Remove the stream's entries with ids below ``before`` (XTRIM MINID); how many went."""
        with self.translate_errors(stream):
            return int(self.client.xtrim(stream, minid=before, approximate=False))

    def register_app(self, app: str, topics: list[str], partitions: int) -> None:
        """Record what an app reads, so operators can find its state by app name alone."""
        with self.translate_errors():
            self.client.hset(
                keys.app_key(app), mapping={"topics": ",".join(topics), "partitions": partitions}
            )
            self.client.sadd(keys.APPS_KEY, app)

    def app_topics(self, app: str) -> set[str]:
        """The topics an app read when it last ran here (empty if it never ran)."""
        return set(self.app_topic_list(app))

    def app_topic_list(self, app: str) -> list[str]:
        """The topics an app read when it last ran here, in the app's order.

        The first one's partitions carry the app's state backup.
        """
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "topics")
        return [t for t in _text(raw).split(",") if t] if raw else []

    def record_group_start(self, app: str, topic: str, partition: int, stream: str) -> None:
        """Remember where the app's group began in a stream it never read before.

        Entries before it were never meant to be applied. The first worker to record it wins.
        """
        mine = self.stream_info(stream).groups.get(app)
        if mine is not None:
            with self.translate_errors():
                self.client.hsetnx(keys.app_key(app), f"start:{topic}:{partition}", mine.last_delivered_id)

    def group_start(self, app: str, topic: str, partition: int) -> keys.StreamId | None:
        """Where the app's group began in that stream (``record_group_start``), if recorded."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), f"start:{topic}:{partition}")
        return None if raw is None else keys.StreamId.parse(raw)

    def app_partitions(self, app: str) -> int:
        """The partition count an app was last run with; NotFound if it never ran here."""
        with self.translate_errors():
            raw = self.client.hget(keys.app_key(app), "partitions")
        if raw is None:
            raise NotFound(f"app {app!r} has never run against the broker at {self.url}")
        return int(raw)

    def stream_info(self, stream: str) -> StreamInfo:
        """Length, last entry id and consumer groups of a stream (zero and none if absent)."""
        with self.translate_errors(stream):
            if not self.client.exists(stream):
                return StreamInfo(0, None, {})
            info = self.client.xinfo_stream(stream)
            groups = self.client.xinfo_groups(stream)
        return StreamInfo(
            int(info["length"]),
            info.get("last-generated-id"),
            {
                _text(g["name"]): GroupInfo(int(g["consumers"]), int(g["pending"]), g["last-delivered-id"])
                for g in groups
            },
        )

    def group_position(self, stream: str, group: str) -> GroupPosition:
        """Length, last id, lag and pending of ``group`` in ``stream``, in one or two round trips."""
        with self.translate_errors(stream):
            pipe = self.client.pipeline(transaction=False)
            pipe.xinfo_stream(stream)
            pipe.xinfo_groups(stream)
            try:
                info, groups = pipe.execute()
            except redis.ResponseError as exc:
                if "no such key" not in str(exc):
                    raise
                return GroupPosition(0, None, None, 0, 0, None, 0)
            mine = next((g for g in groups if _text(g["name"]) == group), None)
            length, last_id = int(info["length"]), info.get("last-generated-id")
            if mine is None:
                return GroupPosition(length, last_id, None, length, 0, None, 0)
            pending = int(mine["pending"])
            oldest = None
            if pending:
                summary = self.client.xpending(stream, group)
                oldest = summary.get("min")
            delivered = mine["last-delivered-id"]
            undelivered = mine.get("lag")  # Redis 7+ and Valkey; nil after some deletions
            if undelivered is None:
                undelivered = self.count_after(stream, delivered)
        return GroupPosition(
            length, last_id, delivered, int(undelivered), pending, oldest, int(mine["consumers"])
        )

    def count_after(self, stream: str, after: bytes | str) -> int:
        """Entries after ``after``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return self._count(stream, str(keys.StreamId.parse(after).next()), "+")

    def count_before(self, stream: str, before: keys.StreamId) -> int:
        """Entries with an id below ``before``, counted up to LAG_COUNT_LIMIT (XRANGE pages)."""
        return 0 if before == keys.ZERO_ID else self._count(stream, "-", str(before.previous()))

    def _count(self, stream: str, start: str, end: str) -> int:
        counted = 0
        while counted < LAG_COUNT_LIMIT:
            with self.translate_errors(stream):
                page = cast(list[tuple[bytes, Any]], self.client.xrange(stream, start, end, 1000))
            counted += len(page)
            if len(page) < 1000:
                break
            start = str(keys.StreamId.parse(page[-1][0]).next())
        return min(counted, LAG_COUNT_LIMIT)

    def list_apps(self) -> list[str]:
        with self.translate_errors():
            return sorted(_text(a) for a in self.client.smembers(keys.APPS_KEY))

    def lease_values(self, lease_keys: Sequence[str]) -> list[str | None]:
        """Each lease's value (``consumer/pid/nonce|token``), None where it is free."""
        with self.translate_errors():
            if not lease_keys:
                values = []
            elif self.cluster:  # the leases of several partitions are in several slots
                values = self.client.mget_nonatomic(lease_keys)
            else:
                values = self.client.mget(lease_keys)
        return [None if v is None else _text(v) for v in values]

    def lease_holders(self, lease_keys: Sequence[str]) -> list[str | None]:
        """The owner part of each lease's value (``consumer/pid/nonce``), None where it is free."""
        return [None if v is None else v.rpartition("|")[0] for v in self.lease_values(lease_keys)]

    def reset_group(self, stream: str, group: str, position: str) -> None:
        """Re-create ``group`` at ``position`` with an empty pending list, atomically.

        XGROUP SETID alone would keep the pending entries, which would then be delivered
        before the entries they follow.
        """
        with self.translate_errors(stream):
            pipe = self._on(stream).pipeline(transaction=True)
            pipe.xgroup_destroy(stream, group)
            pipe.xgroup_create(stream, group, id=position, mkstream=True)
            pipe.execute()

    def has_backlog(self, stream: str, group: str) -> bool:
        """Whether ``group`` has pending or not yet delivered entries in ``stream``."""
        info = self.stream_info(stream)
        mine = info.groups.get(group)
        if mine is None:
            return info.length > 0
        if mine.pending:
            return True
        delivered = keys.StreamId.parse(mine.last_delivered_id)
        return info.last_id is not None and keys.StreamId.parse(info.last_id) > delivered

    # -- consuming ------------------------------------------------------------------------------

    def move_last_id(self, stream: str, last_id: str) -> None:
        """Raise an existing stream's last generated id to ``last_id`` (XSETID)."""
        with self.translate_errors(stream):
            self.client.execute_command("XSETID", stream, last_id)

    def ensure_group(self, stream: str, group: str, start_id: str) -> None:
        """Create the consumer group (and the stream) unless it exists."""
        with self.translate_errors(stream):
            try:
                self.client.xgroup_create(stream, group, id=start_id, mkstream=True)
            except redis.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

    def read_group(
        self,
        group: str,
        consumer: str,
        streams: dict[str, str],
        count: int,
        block_ms: int | None,
    ) -> list[tuple[bytes, list[RawEntry]]]:
        """One XREADGROUP; ``streams`` maps a stream to ``>`` (new entries) or an id (own PEL)."""
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", *streams.keys(), *streams.values()]
        with self.translate_errors():
            reply = self._on(next(iter(streams))).execute_command(*args)  # type: ignore[no-untyped-call]
        if not reply:
            return []
        return [(stream, _entries(entries)) for stream, entries in reply]

    def read_new(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]:
        """Deliver new entries from the streams (stream, lease key, lease value) we hold leases on.

        The leases are WATCHed, checked, and the XREADGROUP runs in MULTI/EXEC: if another worker
        takes a lease in between, nothing is delivered. So a worker that lost a lease cannot take
        entries out of the group's order, and none can end up unapplied below the new owner's
        checkpoint. Returns the streams whose lease is lost, the entries read, and, when nothing
        was read, each stream's last generated id (``lua/last_ids.lua``) for ``wait_for_new``.

        On a cluster, where one MULTI cannot span partitions, each partition's read is a Lua call
        that checks its lease (``lua/read.lua``), pipelined per node.
        """
        if self.cluster:
            return self._read_new_scripted(group, consumer, streams, count)
        lease_keys = [lease for _, lease, _ in streams]
        with (
            self.translate_errors(", ".join(s for s, _, _ in streams)),
            self.client.pipeline(transaction=True) as pipe,
        ):
            pipe.watch(*lease_keys)
            held_values = pipe.mget(lease_keys)
            held = [
                stream
                for (stream, _, value), current in zip(streams, held_values, strict=True)
                if current is not None and _text(current) == value
            ]
            lost = [stream for stream, _, _ in streams if stream not in held]
            if not held:
                pipe.unwatch()
                return lost, [], {}
            pipe.multi()
            pipe.execute_command(
                "XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS", *held, *[">"] * len(held)
            )
            try:
                (reply,) = pipe.execute()
            except redis.WatchError:
                return lost, [], {}  # a lease moved just now: the next cycle sees which
        if reply:
            return lost, [(stream, _entries(raw)) for stream, raw in reply], {}
        (last,) = self._eval_pipelined(self._last_ids, [(held, [])])
        return lost, [], {s: bytes(found) for s, found in zip(held, last, strict=True)}

    def _read_new_scripted(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]:
        calls = [([stream, lease], [group, consumer, count, value]) for stream, lease, value in streams]
        return _fenced_reads([s for s, _, _ in streams], self._eval_pipelined(self._read, calls))

    def read_ahead(
        self, group: str, consumer: str, streams: Sequence[tuple[str, str, str]], count: int
    ) -> ReadAhead:
        """Send ``read_new`` of the streams now and read its reply later (``ReadAhead``).

        The server builds the next batch while this process runs the current one. The read is
        fenced like any other (``lua/read.lua`` per stream): under a lease no longer held it
        delivers nothing. Not on a cluster, whose partitions' reads go to several nodes.
        """
        if not self._read_loaded:  # else the first read ahead finds no script and is read again
            self.load_read_script()
        pool = self.client.connection_pool
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", self._read.sha, 2, stream, lease, group, consumer, count, value)
            for stream, lease, value in streams
        ]
        with self.translate_errors():
            connection = pool.get_connection()
            try:
                connection.send_packed_command([hiredis.pack_command(c) for c in commands])
            except BaseException:
                connection.disconnect()
                pool.release(connection)
                raise
        return ReadAhead(self, connection, [s for s, _, _ in streams])

    def load_read_script(self) -> None:
        """Load ``lua/read.lua`` into the server's script cache (a read sent ahead cannot load it)."""
        with self.translate_errors():
            self.client.script_load(self._read.script)
        self._read_loaded = True

    def last_id(self, stream: str) -> bytes | None:
        """The stream's last generated id (also of deleted entries); None when it does not exist."""
        return self.stream_info(stream).last_id

    def wait_for_new(self, last_ids: dict[str, bytes], block_ms: int) -> None:
        """Block until an entry newer than ``last_ids`` arrives or ``block_ms`` passes.

        A plain XREAD delivers nothing to the group: the next ``read_new`` takes the entries. On a
        cluster, where one XREAD cannot span partitions, the streams are looked at every
        ``CLUSTER_POLL_MS`` instead (one XREAD per partition, pipelined: a round trip per node).
        """
        if not self.cluster or len({self.client.keyslot(s) for s in last_ids}) <= 1:
            with self.translate_errors():
                self.client.xread(dict(last_ids), count=1, block=block_ms)
            return
        deadline = time.monotonic() + block_ms / 1000
        while True:
            with self.translate_errors():
                pipe = self.client.pipeline(transaction=False)
                for stream, after in last_ids.items():
                    pipe.xread({stream: after}, count=1)
                if any(pipe.execute()) or time.monotonic() >= deadline:
                    return
            time.sleep(min(CLUSTER_POLL_MS / 1000, max(0.0, deadline - time.monotonic())))

    def delivery_counts(self, stream: str, group: str, ids: Sequence[bytes]) -> dict[bytes, int]:
        """How often each of these pending entries was delivered (one XPENDING each, pipelined)."""
        with self.translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xpending_range(stream, group, entry_id, entry_id, 1)
            replies = pipe.execute()
        return {
            row["message_id"]: int(row["times_delivered"])
            for rows in replies
            for row in cast(list[dict[str, Any]], rows)
        }

    def claim_idle(self, stream: str, group: str, consumer: str, min_idle_ms: int) -> tuple[list[bytes], int]:
        """Move the group's entries idle longer than ``min_idle_ms`` in ``stream`` to ``consumer``.

        With 0 it takes every pending entry (on takeover). Follows the XAUTOCLAIM cursor in
        bounded steps. Entries deleted while pending are dropped from the PEL by Redis 7 and
        returned apart; they are logged as lost. Returns (claimed ids, deleted count).
        """
        claimed: list[bytes] = []
        deleted = 0
        cursor: bytes | str = b"0-0"
        while True:
            with self.translate_errors():
                reply = self._on(stream).execute_command(  # type: ignore[no-untyped-call]
                    "XAUTOCLAIM",
                    stream,
                    group,
                    consumer,
                    min_idle_ms,
                    cursor,
                    "COUNT",
                    _CLAIM_COUNT,
                    "JUSTID",
                )
            cursor, ids = reply[0], reply[1]
            claimed += ids
            if len(reply) > 2 and reply[2]:
                deleted += len(reply[2])
                log.warning(
                    "entries deleted while pending, lost before processing stream=%s ids=%s",
                    stream,
                    [_text(i) for i in reply[2]],
                )
            if _text(cursor) == "0-0":
                return claimed, deleted

    def pending_entries(
        self, stream: str, group: str, end: keys.StreamId | None = None, min_idle_ms: int = 0
    ) -> list[PendingEntry]:
        """The group's pending entries up to ``end`` (all without), of every consumer, in id order.

        With ``min_idle_ms`` only those idle at least that long. Read in pages of XPENDING.
        """
        found: list[PendingEntry] = []
        start, last = "-", "+" if end is None else str(end)
        while True:
            with self.translate_errors(stream):
                rows = cast(
                    list[dict[str, Any]],
                    self.client.xpending_range(
                        stream, group, start, last, _CLAIM_COUNT, idle=min_idle_ms or None
                    ),
                )
            found += [
                PendingEntry(
                    row["message_id"],
                    _text(row["consumer"]),
                    int(row["time_since_delivered"]),
                    int(row["times_delivered"]),
                )
                for row in rows
            ]
            if len(rows) < _CLAIM_COUNT:
                return found
            start = str(keys.StreamId.parse(rows[-1]["message_id"]).next())

    def acknowledged_after(self, stream: str, group: str, after: keys.StreamId | None, upto: bytes) -> bool:
        """Whether ``group`` acknowledged an entry after ``after`` and up to ``upto``.

        That is an entry of the range that exists and is not pending (``upto``: the group's last
        delivered id). Only the first 1,000 entries of the range are looked at: a store behind by
        more than 1,000 pending entries in a row with nothing acknowledged among them is missed.
        """
        end = keys.StreamId.parse(upto)
        if after is not None and end <= after:
            return False
        start = "-" if after is None else str(after.next())
        with self.translate_errors(stream):
            pipe = self.client.pipeline(transaction=False)
            pipe.xrange(stream, start, str(end), count=_CLAIM_COUNT)
            pipe.xpending_range(stream, group, start, str(end), _CLAIM_COUNT)
            entries, pending = pipe.execute()
        held = {row["message_id"] for row in pending}
        if len(pending) == _CLAIM_COUNT:  # only as far as the pending page reaches
            last = keys.StreamId.parse(pending[-1]["message_id"])
            entries = [e for e in entries if keys.StreamId.parse(e[0]) <= last]
        return any(entry_id not in held for entry_id, _ in entries)

    def claim_ids(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, ids: Sequence[bytes]
    ) -> list[bytes]:
        """Move these pending entries to ``consumer`` where still idle ``min_idle_ms``; the ids moved.

        Unlike XAUTOCLAIM, it takes nothing but the entries named, so an entry that became
        pending (or active again) since they were chosen is left alone.
        """
        claimed: list[bytes] = []
        for start in range(0, len(ids), _CLAIM_COUNT):
            chunk = ids[start : start + _CLAIM_COUNT]
            with self.translate_errors(stream):
                claimed += self._on(stream).execute_command(  # type: ignore[no-untyped-call]
                    "XCLAIM", stream, group, consumer, min_idle_ms, *chunk, "JUSTID"
                )
        return claimed

    def pending_counts(
        self, stream: str, group: str, consumer: str, after: keys.StreamId, count: int
    ) -> list[tuple[bytes, int]]:
        """Own pending entries after ``after`` with their delivery counts, without delivering."""
        start = "-" if after == keys.ZERO_ID else str(after.next())
        with self.translate_errors():
            rows = self.client.xpending_range(stream, group, start, "+", count, consumer)
        return [(row["message_id"], int(row["times_delivered"])) for row in cast(list[dict[str, Any]], rows)]

    def claim_entries(
        self, stream: str, group: str, consumer: str, ids: Sequence[bytes], lease: tuple[str, str]
    ) -> list[RawEntry] | None:
        """Re-deliver own pending entries by id (XCLAIM counts the delivery); gone ones are left out.

        Only under the (lease key, value) held, as ``read_new``: None, and nothing claimed, when
        the lease moved. An ex-owner would otherwise take its old entries back from the new
        owner, and every such delivery would make them look more like poison.
        """
        lease_key, lease_value = lease
        with self.translate_errors(stream), self._on(stream).pipeline(transaction=True) as pipe:
            pipe.watch(lease_key)  # type: ignore[no-untyped-call]
            if _text(pipe.get(lease_key)) != lease_value:
                pipe.unwatch()
                return None
            pipe.multi()
            pipe.execute_command("XCLAIM", stream, group, consumer, 0, *ids)  # type: ignore[no-untyped-call]
            try:
                (reply,) = pipe.execute()
            except redis.WatchError:
                return None
        return [entry for entry in _entries([e for e in reply if e is not None]) if entry[1] is not None]

    def ack(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost]:
        """Acknowledge several partitions' batches (and update their backups) under their leases.

        Usually one MULTI/EXEC with the leases WATCHed (``_ack_in_transaction``). With DLQ moves,
        an upload, or a lease not held, each partition's call runs in a Lua call that checks its
        lease (one pipelined round trip), so one lost lease refuses only that partition's
        acknowledgement. Each result is (acknowledged, moved to the DLQ) or LeaseLost (BackupWentBack
        when the backup is not where the update follows on: ``BackupUpdate.follows``).
        """
        if not requests:
            return []
        common = all(not r.dead and (r.backup is None or r.backup.mode == "update") for r in requests)
        if common and not self.cluster:  # one MULTI cannot span a cluster's partitions
            done = self._ack_in_transaction(requests)
            if done is not None:
                return done
        results: list[tuple[int, int] | LeaseLost] = []
        calls = [_ack_call(r) for r in requests]
        for reply in self._eval_pipelined(self._ack, calls, raise_on_error=False, then=self._wait):
            if isinstance(reply, redis.ResponseError):
                if str(reply).startswith("LEASE_LOST"):
                    results.append(LeaseLost(str(reply)))
                    continue
                if str(reply).startswith("BACKUP_WENT_BACK"):
                    results.append(BackupWentBack(str(reply)))
                    continue
                if str(reply).startswith("BACKUP_DAMAGED"):
                    results.append(BackupDamaged(str(reply)))
                    continue
                with self.translate_errors():
                    raise reply
            results.append((int(reply[0]), int(reply[1])))
        return results

    def _ack_in_transaction(self, requests: Sequence[AckRequest]) -> list[tuple[int, int] | LeaseLost] | None:
        """The common acknowledgement (no DLQ moves, no upload) as plain commands in MULTI/EXEC.

        Same effects as ``lua/ack.lua``, fenced the way reads are: the leases (and backup metas)
        are WATCHed and checked first, so EXEC applies nothing if any of them changed or expired
        meanwhile. A batch's values travel as command arguments, which Redis takes far faster than
        a script's. None when a lease is not held or changed: then the script decides, per
        partition.
        """
        leases = [r.lease_key for r in requests]
        fenced = [r.backup for r in requests if r.backup is not None]
        backup_keys = [key for b in fenced for key in (b.keys.meta, b.keys.values)]
        with self._raw_connection(cast(redis.Redis, self.client)) as send:
            reads: list[tuple[Any, ...]] = [("WATCH", *leases, *backup_keys), ("MGET", *leases)]
            reads += [("HMGET", b.keys.meta, "identity", keys.BACKUP_MARKED) for b in fenced]
            reads += [("HGET", b.keys.values, keys.BACKUP_MARK) for b in fenced]
            replies = send(reads)
            held, heads, marks = replies[1], replies[2 : 2 + len(fenced)], replies[2 + len(fenced) :]
            identities = [identity for identity, _ in heads]
            if (
                any(_text(v) != r.lease_value for v, r in zip(held, requests, strict=True))
                or any(
                    b.follows and _text(i) not in b.follows for b, i in zip(fenced, identities, strict=True)
                )
                or any(
                    marked and mark != identity for (identity, marked), mark in zip(heads, marks, strict=True)
                )
            ):  # the script says which: a lost lease, a backup gone back or damaged
                send([("UNWATCH",)])
                return None
            commands: list[tuple[Any, ...]] = [("MULTI",)]
            acks: list[int | None] = []
            prevs = iter(identities)
            for r in requests:
                if r.backup is not None:
                    commands += _backup_commands(r.backup, _text(next(prevs)))
                acks.append(len(commands) - 1 if r.ids else None)
                if r.ids:
                    commands.append(("XACK", r.stream, r.group, *r.ids))
            replies = send([*commands, ("EXEC",), *([self._wait] if self._wait else [])])
        if self._wait:
            self._replicated(replies.pop())
        done = replies[-1]  # after OK and QUEUED..., EXEC's
        if done is None:
            return None  # a lease or backup changed under us: nothing was applied
        for reply in done:
            if isinstance(reply, redis.ResponseError):
                with self.translate_errors():
                    raise reply
        return [(0, 0) if at is None else (int(done[at]), 0) for at in acks]

    def _replicated(self, replicas: int) -> None:
        """Say when fewer replicas than asked for have an acknowledging call (WAIT's reply)."""
        wanted, timeout_ms = self._wait[1:]
        if replicas < wanted:
            log.warning(
                "only %s of %s replicas have the last acknowledgement after %s ms: a fail-over now "
                "could lose it (PSPF_WAIT_REPLICAS)",
                replicas,
                wanted,
                timeout_ms,
            )

    def _eval_pipelined(
        self,
        script: Script,
        calls: Sequence[tuple[list[Any], list[Any]]],
        raise_on_error: bool = True,
        then: tuple[Any, ...] = (),
    ) -> list[Any]:
        """Run ``script`` once per (keys, args) in ONE pipelined round trip (one per node of a cluster).

        ``then`` is a command sent after the calls on each server's connection (a WAIT).

        EVALSHA goes straight into the pipeline: redis-py's Script objects would add a SCRIPT
        EXISTS round trip to every pipeline. When the server lost its script cache (a restart),
        the script is loaded and only the calls it refused are sent again, so nothing runs twice.
        """
        replies: list[Any] = [None] * len(calls)
        with self.translate_errors():
            for node, at in self._by_node([k[0] for k, _ in calls]):
                sent = self._evalsha_each(node, script, [calls[i] for i in at], then)
                for i, reply in zip(at, sent, strict=True):
                    replies[i] = reply
                missing = [i for i in at if isinstance(replies[i], NoScriptError)]
                if missing:
                    node.script_load(script.script)
                    for i, reply in zip(
                        missing,
                        self._evalsha_each(node, script, [calls[i] for i in missing], then),
                        strict=True,
                    ):
                        replies[i] = reply
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, redis.ResponseError):
                    with self.translate_errors():
                        raise reply
        return replies

    def _evalsha_each(
        self,
        node: redis.Redis,
        script: Script,
        calls: Sequence[tuple[list[Any], list[Any]]],
        then: tuple[Any, ...] = (),
    ) -> list[Any]:
        """Send the calls to one server in one write; their replies (error replies returned, not raised)."""
        commands: list[tuple[Any, ...]] = [("EVALSHA", script.sha, len(k), *k, *a) for k, a in calls]
        with self._raw_connection(node) as send:
            replies = send([*commands, *([then] if then else [])], keep_errors=True)
        if then:
            if then[0] == "WAIT" and isinstance(replies[-1], int):
                self._replicated(replies[-1])
            replies.pop()
        return replies

    @contextmanager
    def _raw_connection(self, node: redis.Redis) -> Iterator[Callable[..., list[Any]]]:
        """A pooled connection's ``send(commands, keep_errors=False)``: one write, then every reply.

        Packed by hiredis directly: these calls carry a batch's values (thousands of arguments),
        and redis-py's generic packing costs about a microsecond more per argument. Errors are
        PSPF errors; a connection left with unread replies is closed, never reused.
        """
        pool = node.connection_pool
        with self.translate_errors():
            connection = pool.get_connection()

            def send(commands: Sequence[tuple[Any, ...]], keep_errors: bool = False) -> list[Any]:
                connection.send_packed_command([hiredis.pack_command(c) for c in commands])  # type: ignore[no-untyped-call]
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:
                        if not keep_errors:
                            raise
                        replies.append(exc)
                return replies

            try:
                yield send
            except BaseException:
                connection.disconnect()  # type: ignore[no-untyped-call]
                raise
            finally:
                pool.release(connection)

    # -- leases ---------------------------------------------------------------------------------

    def acquire_lease(self, lease_key: str, fence_key: str, owner: str, ttl_ms: int) -> str | None:
        """Take a free lease; its value (owner and fencing token), or None when it is held."""
        with self.translate_errors():
            value = self._lease_acquire(keys=[lease_key, fence_key], args=[owner, ttl_ms])
        return None if value is None else bytes(value).decode()

    def renew_leases(self, leases: Sequence[tuple[str, str]], ttl_ms: int) -> list[bool]:
        """Extend leases (key, value) in one round trip; False where a lease is lost."""
        calls = [([key], [value, ttl_ms]) for key, value in leases]
        return [bool(r) for r in self._eval_pipelined(self._lease_renew, calls)]

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        """Give leases up so a standby takes the partitions at once."""
        self._eval_pipelined(self._lease_release, [([key], [value]) for key, value in leases])

    # -- members --------------------------------------------------------------------------------

    def member_heartbeat(
        self, app: str, member: str, ttl_ms: int, info: bytes, stay: bool = True
    ) -> tuple[int, bool, list[tuple[str, int, int, bytes]]]:
        """Renew (or end) a worker's membership; the server's time, whether it was a member, the live.

        Each member as (id, joined ms, expiry ms, info), in id order. "Was a member": its entries
        were there and unexpired before this call.
        """
        member_keys = [keys.members_key(app), keys.joined_key(app), keys.member_info_key(app)]
        with self.translate_errors(member_keys[0]):
            reply = self._member_heartbeat(
                keys=member_keys, args=[member, ttl_ms, info, "1" if stay else "0"]
            )
        now, present, rest = int(reply[0]), int(reply[1]) == 1, reply[2:]
        return (
            now,
            present,
            [
                (_text(rest[i]), int(float(rest[i + 1])), int(float(rest[i + 2])), bytes(rest[i + 3]))
                for i in range(0, len(rest), 4)
            ],
        )

    def members(self, app: str) -> tuple[int, list[tuple[str, int, int, bytes]]]:
        """The server's time and the live members as ``member_heartbeat`` gives them (a read only)."""
        with self.translate_errors(keys.members_key(app)):
            pipe = self._on(keys.members_key(app)).pipeline(transaction=True)
            pipe.time()
            pipe.zrange(keys.members_key(app), 0, -1, withscores=True)
            pipe.zrange(keys.joined_key(app), 0, -1, withscores=True)
            pipe.hgetall(keys.member_info_key(app))
            (seconds, micros), expiries, joined, info = pipe.execute()
        now = int(seconds) * 1000 + int(micros) // 1000
        since = {_text(m): int(score) for m, score in joined}
        return now, [
            (_text(m), since.get(_text(m), now), int(expiry), bytes(info.get(m, b"{}")))
            for m, expiry in expiries
            if expiry > now
        ]

    # -- state backup ---------------------------------------------------------------------------

    def backup_meta(self, meta_key: str) -> dict[str, str]:
        """A backup's identity and checkpoints (``cp:TOPIC``); empty when there is no backup."""
        with self.translate_errors(meta_key):
            raw = self.client.hgetall(meta_key)
        return {_text(k): _text(v) for k, v in raw.items()}

    def set_backup_field(self, meta_key: str, name: str, value: str) -> None:
        """Record a fact about a backup in its meta (its partition count)."""
        with self.translate_errors(meta_key):
            self.client.hset(meta_key, name, value)

    def backup_head(self, backup: keys.BackupKeys) -> tuple[dict[str, str], bytes | None]:
        """A backup's meta and the id of its log's last entry, read in one atomic step."""
        with self.translate_errors(backup.meta):
            pipe = self._on(backup.meta).pipeline(transaction=True)
            pipe.hgetall(backup.meta)
            pipe.xrevrange(backup.log, "+", "-", count=1)
            raw, last = pipe.execute()
        return {_text(k): _text(v) for k, v in raw.items()}, (bytes(last[0][0]) if last else None)

    def backup_log(self, log_key: str, after: bytes, count: int) -> list[tuple[bytes, Fields]]:
        """Up to ``count`` log entries after the id ``after``, oldest first."""
        with self.translate_errors(log_key):
            reply = cast(list[Any], self.client.xread({log_key: after}, count=count))
        return [(bytes(entry_id), fields) for _, entries in reply for entry_id, fields in entries]

    def backup_log_before(self, log_key: str, before: bytes | None, count: int) -> list[tuple[bytes, Fields]]:
        """Up to ``count`` log entries before the id ``before`` (all when None), newest first."""
        if before is None:
            top = "+"
        else:
            parsed = keys.StreamId.parse(before)
            if parsed == keys.ZERO_ID:
                return []
            top = str(parsed.previous())
        with self.translate_errors(log_key):
            entries = cast(list[tuple[bytes, Fields]], self.client.xrevrange(log_key, top, "-", count=count))
        return [(bytes(entry_id), fields) for entry_id, fields in entries]

    def backup_values(
        self, key: str, count: int = 10_000, match: bytes | None = None
    ) -> Iterator[list[tuple[bytes, bytes]]]:
        """A backup's fields and values (those ``match`` selects), in pages of about ``count`` (HSCAN)."""
        cursor = 0
        while True:
            with self.translate_errors(key):
                cursor, page = cast(
                    tuple[int, dict[bytes, bytes]],
                    self.client.hscan(key, cursor, match=match, count=count),
                )
            page.pop(keys.BACKUP_MARK, None)
            if page:
                yield list(page.items())
            if cursor == 0:
                return

    def backup_value(self, key: str, field: bytes) -> bytes | None:
        with self.translate_errors(key):
            value = cast(bytes | None, self.client.hget(key, field))
        return value

    def rewind_backup(
        self,
        backup: keys.BackupKeys,
        clear: Collection[str],
        checkpoints: Mapping[str, keys.StreamId | None],
        values: Mapping[bytes, bytes],
        identity: str,
    ) -> bool:
        """Rewind a backup as ``StateStore.rewind`` does a store, under a new identity.

        For a stopped app; one MULTI. The log goes: it no longer leads to this state. False
        when there is no backup.
        """
        if not self.backup_meta(backup.meta).get(keys.BACKUP_IDENTITY):
            return False
        prefixes = tuple(namespace.encode() + b"\x00" for namespace in clear)
        gone = [f for page in self.backup_values(backup.values) for f, _ in page if f.startswith(prefixes)]
        with self.translate_errors(backup.values):
            pipe = self._on(backup.values).pipeline(transaction=True)
            for start in range(0, len(gone), _CLAIM_COUNT):
                pipe.hdel(backup.values, *gone[start : start + _CLAIM_COUNT])
            pipe.hset(backup.values, mapping={**values, keys.BACKUP_MARK: identity.encode()})  # type: ignore[dict-item]
            dropped = [f"cp:{topic}" for topic, cid in checkpoints.items() if cid is None]
            if dropped:
                pipe.hdel(backup.meta, *dropped)
            meta: dict[str | bytes, str | bytes] = {keys.BACKUP_IDENTITY: identity, keys.BACKUP_MARKED: "1"}
            meta.update({f"cp:{topic}": str(cid) for topic, cid in checkpoints.items() if cid is not None})
            pipe.hset(backup.meta, mapping=meta)  # type: ignore[arg-type]
            pipe.delete(backup.log)
            pipe.execute()
        return True

    def delete_backup(self, backup: keys.BackupKeys) -> None:
        with self.translate_errors(backup.values):
            self.client.delete(*backup)

    # -- DLQ ------------------------------------------------------------------------------------

    def dlq_range(
        self, dlq: str, start: str = "-", end: str = "+", count: int | None = None
    ) -> list[tuple[bytes, Fields]]:
        """DLQ entries in id order."""
        with self.translate_errors():
            return list(self.client.xrange(dlq, start, end, count))

    def redrive(self, dlq: str, stream: str, dlq_id: bytes, fields: Fields) -> bytes | None:
        """Move one DLQ entry back to ``stream`` as ``fields``; None when it was gone already."""
        args = [dlq_id, *(x for pair in fields.items() for x in pair)]
        with self.translate_errors():
            new_id = self._redrive(keys=[dlq, stream], args=args)
        return None if new_id is None else bytes(new_id)

    def dlq_delete(self, dlq: str, ids: Sequence[bytes]) -> int:
        with self.translate_errors():
            return int(self.client.xdel(dlq, *ids)) if ids else 0

    # -- producing ------------------------------------------------------------------------------

    def guard_memory(self) -> None:
        """Producers' brake: pause near the servers' maxmemory, and refuse (MemoryFull) at it.

        Above ``memory_slow_at`` of maxmemory a write waits, the longer the fuller the server
        (up to MEMORY_PAUSE_S), so workers can drain and retention trim; above ``memory_fail_at``
        it fails, before the server evicts keys or refuses writes. No limit without maxmemory.
        """
        checked, used = self._memory
        if used > 0 or time.monotonic() - checked >= MEMORY_CHECK_S:  # with a limit, before each write
            used = 0.0
            for server in self._servers():
                with self.translate_errors():
                    info = server.info("memory")
                limit = int(info.get("maxmemory", 0))
                if limit:
                    used = max(used, int(info["used_memory"]) / limit)
            self._memory = (time.monotonic(), used)
        slow_at, fail_at = self._memory_limits
        if used >= fail_at:
            raise MemoryFull(
                f"the server at {self.url} uses {used:.0%} of its maxmemory: producing stops before it "
                f"evicts or refuses writes (PSPF_MEMORY_FAIL_AT={fail_at}); let the apps catch up and "
                "trim the topics (pspf topic trim), or give the server more memory"
            )
        if used >= slow_at:
            if not self._slowed:  # said once per stretch
                log.warning(
                    "the server at %s uses %.0f%% of its maxmemory: producing slows down",
                    self.url,
                    100 * used,
                )
            self._slowed = True
            time.sleep(MEMORY_PAUSE_S * min(1.0, (used - slow_at) / max(fail_at - slow_at, 1e-9)))
        else:
            self._slowed = False

    def add_entries(
        self, entries: Sequence[tuple[str, Fields]], maxlen: str = "", minid: str = ""
    ) -> list[bytes]:
        """XADD many entries in one pipelined round trip; their ids, in order.

        ``maxlen`` or ``minid`` trim each stream approximately as it grows. Held back near the
        server's maxmemory (``guard_memory``).
        """
        self.guard_memory()
        with self.translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for stream, fields in entries:
                pipe.xadd(
                    stream,
                    fields,
                    maxlen=int(maxlen) if maxlen else None,
                    minid=minid or None,
                    approximate=True,
                )
            return list(pipe.execute())

    def publish(self, topic: str, partition: int, producer: str, rows: Sequence[tuple[int, Fields]]) -> int:
        """Append a producer's rows to a topic partition, each at most once; how many were new.

        Rows are (sequence, fields), the same field names in each; this waits for the reply (see
        ``lua/publish.lua``).
        """
        names = tuple(rows[0][1]) if rows else ()
        seqs = ",".join(f"{seq}:1" for seq, _ in rows)
        values = [value for _, fields in rows for value in fields.values()]
        (reply,) = self.send_publish(
            producer, [PublishCall((topic, partition), 0, seqs, names, b"", values)]
        ).replies()
        if isinstance(reply, BaseException):
            raise reply
        return int(reply[0])

    def send_publish(self, producer: str, calls: Sequence[PublishCall]) -> SentCalls:
        """Send publishing calls (``lua/publish.lua``) in one write; their replies are read later.

        The server runs them while this process goes on; ``SentCalls.replies`` reads them. On a
        cluster the calls run at once, one round trip per node.
        """
        scripted = [
            (
                [keys.stream_key(*call.target), keys.producers_key(*call.target)],
                [producer, call.prev, call.seqs, len(call.names), *call.names, call.head, *call.values],
            )
            for call in calls
        ]
        if self.cluster:
            try:
                replies = self._eval_pipelined(self._publish, scripted, raise_on_error=False)
            except BrokerError as exc:
                return SentCalls.failed(len(calls), exc)
            return SentCalls(self, None, scripted, [self._error(r) for r in replies])
        pool = self.client.connection_pool
        try:
            with self.translate_errors():
                connection = pool.get_connection()
                try:
                    packed = [
                        hiredis.pack_command(("EVALSHA", self._publish.sha, 2, *k, *a)) for k, a in scripted
                    ]
                    connection.send_packed_command(packed)
                except BaseException:
                    connection.disconnect()
                    pool.release(connection)
                    raise
        except BrokerError as exc:
            return SentCalls.failed(len(calls), exc)
        return SentCalls(self, connection, scripted)

    def _error(self, reply: Any) -> Any:
        """A reply, or the PSPF error of an error reply."""
        if not isinstance(reply, redis.ResponseError):
            return reply
        try:
            with self.translate_errors():
                raise reply
        except BrokerError as exc:
            return exc

    def request_outbox_replay(self, app: str, partition: int, ids: Sequence[int]) -> None:
        """Ask the owner of a partition to replay outbox rows (added to a request still waiting)."""
        key = keys.outbox_replay_key(app)
        with self.translate_errors(key), self._on(key).pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)  # type: ignore[no-untyped-call]
                    waiting = pipe.hget(key, str(partition))
                    wanted = sorted({*ids, *(msgspec.json.decode(waiting) if waiting else [])})
                    pipe.multi()
                    pipe.hset(key, str(partition), msgspec.json.encode(wanted))
                    pipe.hdel(keys.outbox_replayed_key(app), str(partition))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def outbox_replay_requests(self, app: str, partitions: Sequence[int]) -> dict[int, bytes]:
        """The waiting replay requests (raw) of those partitions."""
        if not partitions:
            return {}
        key = keys.outbox_replay_key(app)
        with self.translate_errors(key):
            found = cast(list[bytes | None], self.client.hmget(key, [str(p) for p in partitions]))
        return {p: raw for p, raw in zip(partitions, found, strict=True) if raw}

    def finish_outbox_replay(self, app: str, partition: int, request: bytes, outcome: bytes) -> None:
        """Record what a replay request did and drop it, unless a newer request replaced it meanwhile."""
        key = keys.outbox_replay_key(app)
        with self.translate_errors(key), self._on(key).pipeline(transaction=True) as pipe:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            if pipe.hget(key, str(partition)) != request:
                pipe.unwatch()
                return  # the next lease round applies the newer one (it includes these ids too)
            pipe.multi()
            pipe.hdel(key, str(partition))
            pipe.hset(keys.outbox_replayed_key(app), str(partition), outcome)
            with suppress(redis.WatchError):
                pipe.execute()

    def outbox_replay_outcomes(self, app: str, partitions: Sequence[int]) -> dict[int, bytes | None]:
        """Per partition: None while its request waits, else what its owner did (raw JSON)."""
        with self.translate_errors(keys.outbox_replay_key(app)):
            pipe = self._on(keys.outbox_replay_key(app)).pipeline(transaction=True)
            pipe.hmget(keys.outbox_replay_key(app), [str(p) for p in partitions])
            pipe.hmget(keys.outbox_replayed_key(app), [str(p) for p in partitions])
            waiting, done = pipe.execute()
        return {p: None if w else d for p, w, d in zip(partitions, waiting, done, strict=True)}

    def add_chunks(
        self,
        chunks: Sequence[tuple[str, str | None, list[Any]]],
        marker_ttl_s: int,
        maxlen: str = "",
        minid: str = "",
    ) -> list[int]:
        """Add chunks of entries, one Lua call per chunk, all in one pipelined round trip.

        Each chunk is (stream, marker or None, flat entries): per entry the number of field and
        value arguments, then those arguments. A chunk's marker counts its entries already added,
        which are skipped. Returns how many entries each chunk added. Held back near the server's
        maxmemory (``guard_memory``).
        """
        self.guard_memory()
        calls = [
            ([stream] if marker is None else [stream, marker], [marker_ttl_s, maxlen, minid, *flat])
            for stream, marker, flat in chunks
        ]
        return [int(added) for added in self._eval_pipelined(self._sink_write, calls)]


class PublishCall(NamedTuple):
    """One publishing call (``lua/publish.lua``): rows of one shape to one target partition."""

    target: tuple[str, int]
    #: the sequence number the producer's record there must have reached before it runs (0: none)
    prev: int
    #: the rows' sequence numbers as runs, "first:count,..."
    seqs: str
    names: tuple[bytes, ...]
    #: the headers' JSON up to the source entry id, the last value of each row (b"": the last
    #: value is the headers whole)
    head: bytes
    #: each row's values, one after another
    values: list[bytes]


class SentCalls:
    """Publishing calls sent (``Broker.send_publish``); their connection is theirs until read.

    ``replies`` gives one reply per call, or the PSPF error of the call: a call that did not run
    because the server had lost its scripts is sent again then; calls whose replies cannot be read
    (a lost connection) are errors, whether or not they ran.
    """

    def __init__(
        self,
        broker: Broker | None,
        connection: Any,
        calls: list[tuple[list[Any], list[Any]]],
        replies: list[Any] | None = None,
    ) -> None:
        self.broker = broker
        self._connection = connection
        self._calls = calls
        self._replies = replies

    @classmethod
    def failed(cls, count: int, error: BrokerError) -> SentCalls:
        return cls(None, None, [], [error] * count)

    def replies(self) -> list[Any]:
        if self._replies is not None:
            return self._replies
        broker, connection = self.broker, self._connection
        assert broker is not None and connection is not None
        self._connection = None
        replies: list[Any] = []
        try:
            with broker.translate_errors():
                for _ in self._calls:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:
                        replies.append(exc)
        except BrokerError as exc:
            connection.disconnect()
            replies += [exc] * (len(self._calls) - len(replies))
        finally:
            broker.client.connection_pool.release(connection)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            try:
                again = broker._eval_pipelined(
                    broker._publish, [self._calls[i] for i in missing], raise_on_error=False
                )
            except BrokerError as exc:
                again = [exc] * len(missing)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        self._replies = [broker._error(reply) for reply in replies]
        return self._replies

    def abandon(self) -> None:
        """Close the connection unread (the calls may or may not have run)."""
        if self._connection is not None and self.broker is not None:
            self._connection.disconnect()
            self.broker.client.connection_pool.release(self._connection)
            self._connection = None
            self._replies = [BrokerUnavailable("the connection of the publishing calls was closed")] * len(
                self._calls
            )


class ReadAhead:
    """A fenced read sent ahead (``Broker.read_ahead``); its connection is its own until then.

    What it delivered is pending for this consumer either way: ``take`` returns it as
    ``read_new`` would, ``drop`` only says which entries they were (to be read again from the
    pending list, in order), ``abandon`` closes the connection without reading.
    """

    def __init__(self, broker: Broker, connection: Any, streams: list[str]) -> None:
        self.broker = broker
        self.streams = streams
        self._connection = connection

    def take(self) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]] | None:
        """The read's result as ``read_new`` returns it.

        None when the server had no script (a restart emptied its cache): then nothing was
        delivered, and the caller reads again.
        """
        replies = self._replies()
        if any(isinstance(reply, NoScriptError) for reply in replies):
            self.broker.load_read_script()
            return None
        return _fenced_reads(self.streams, replies)

    def drop(self) -> dict[str, list[bytes]]:
        """Read the replies without using them: the ids delivered, per stream."""
        replies = self._replies()
        if any(isinstance(reply, NoScriptError) for reply in replies):
            return {}  # nothing ran
        _, read, _ = _fenced_reads(self.streams, replies)
        return {stream.decode(): [entry_id for entry_id, _ in entries] for stream, entries in read}

    def abandon(self) -> None:
        """Close the connection unread: what the read delivered stays pending for this consumer."""
        if self._connection is not None:
            self._connection.disconnect()
            self._release()

    def _replies(self) -> list[Any]:
        connection = self._connection
        if connection is None:
            raise BrokerError("a read sent ahead was already read")
        replies: list[Any] = []
        try:
            with self.broker.translate_errors():
                for _ in self.streams:
                    try:
                        replies.append(connection.read_response())
                    except redis.ResponseError as exc:
                        if not isinstance(exc, NoScriptError):
                            raise
                        replies.append(exc)
        except BaseException:
            connection.disconnect()
            raise
        finally:
            self._release()
        return replies

    def _release(self) -> None:
        self.broker.client.connection_pool.release(self._connection)
        self._connection = None


def _fenced_reads(
    streams: Sequence[str], replies: Sequence[Any]
) -> tuple[list[str], list[tuple[bytes, list[RawEntry]]], dict[str, bytes]]:
    """``lua/read.lua``'s replies as ``Broker.read_new`` returns them: lost, read, last ids."""
    lost: list[str] = []
    read: list[tuple[bytes, list[RawEntry]]] = []
    last: dict[str, bytes] = {}
    for stream, reply in zip(streams, replies, strict=True):
        if reply[0] == 0:
            lost.append(stream)
        elif reply[0] == 1:
            read.append((stream.encode(), _entries(reply[1])))
        else:
            last[stream] = bytes(reply[1])
    return lost, read, ({} if read else last)


def _ack_call(r: AckRequest) -> tuple[list[Any], list[Any]]:
    """The keys and arguments of ``lua/ack.lua`` for one request."""
    b = r.backup
    mode = "" if b is None else b.mode
    args: list[Any] = [
        r.group,
        r.lease_value,
        len(r.ids),
        len(r.dead),
        mode,
        BACKUP_LOG_LENGTH,
        "" if b is None else ",".join(b.follows),
        *r.ids,
    ]
    for entry_id, fields in r.dead:
        args += [entry_id, 2 * len(fields), *(x for pair in fields.items() for x in pair)]
    if b is not None:
        args += [b.identity, len(b.checkpoints), len(b.sets) // 2, len(b.deletes)]
        for topic, checkpoint in b.checkpoints.items():
            args += [topic, checkpoint]
        args += b.sets
        args += b.deletes
        args.append(log_data(b) if b.mode == "update" else b"")
    backup_keys = [r.stream, r.stream, r.stream] if b is None else list(b.keys)
    return [r.stream, r.lease_key, r.dlq or r.stream, *backup_keys], args


_log_encoder = msgspec.msgpack.Encoder()


def log_data(b: BackupUpdate) -> bytes:
    """An update as its log entry's ``data``: (checkpoints, flat sets, deleted fields), msgpack.

    One field, not a field per value: Redis builds a stream entry by appending to one buffer, so
    an entry of many fields costs far more than one of a single value of the same size.
    """
    return _log_encoder.encode((b.checkpoints, b.sets, b.deletes))


def _backup_commands(b: BackupUpdate, prev: str) -> list[tuple[Any, ...]]:
    """The commands of ``lua/ack.lua``'s "update": values, deletes, meta, and the log entry."""
    commands: list[tuple[Any, ...]] = []
    if b.deletes:
        commands.append(("HDEL", b.keys.values, *b.deletes))
    sets = [*b.sets, keys.BACKUP_MARK, b.identity] if b.identity else b.sets
    if sets:
        commands.append(("HSET", b.keys.values, *sets))
    meta: list[Any] = [x for topic, checkpoint in b.checkpoints.items() for x in ("cp:" + topic, checkpoint)]
    if b.identity:
        meta += ["identity", b.identity, keys.BACKUP_MARKED, "1"]
    if meta:
        commands.append(("HSET", b.keys.meta, *meta))
    if BACKUP_LOG_LENGTH > 0:
        head = ("XADD", b.keys.log, "MAXLEN", "~", BACKUP_LOG_LENGTH, "*", "prev", prev)
        commands.append((*head, "id", b.identity or prev, "data", log_data(b)))
    return commands


def _guarantee_warnings(server: redis.Redis) -> list[str]:
    """What in a server's configuration weakens PSPF's guarantees."""
    try:
        config = server.config_get("*")
    except redis.RedisError:
        return ["cannot read the server's CONFIG; persistence and eviction are unchecked"]
    text = {_text(k): _text(v) for k, v in config.items()}
    warnings = []
    if text.get("appendonly") != "yes" and not text.get("save"):
        warnings.append(
            "the server persists nothing (appendonly no, no save points): a server restart loses every stream"
        )
    return warnings  # an evicting maxmemory-policy is a refusal, not a warning: check_eviction


def _node_name(server: redis.Redis) -> str:
    kwargs = server.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _entries(raw: list[Any]) -> list[RawEntry]:
    """Parse XREADGROUP's entry list; a pending entry deleted from the stream has no fields.

    An entry that gives a field name twice keeps a mark of it (``codec.RepeatedFields``).
    """
    parsed: list[RawEntry] = []
    append = parsed.append
    for entry_id, flat in raw:
        if flat is None:
            append((entry_id, None))
        elif len(flat) == 4 and flat[0] != flat[2]:  # the common key + value entry, built directly
            append((entry_id, {flat[0]: flat[1], flat[2]: flat[3]}))
        else:
            append((entry_id, codec.entry_fields_of(flat)))
    return parsed
