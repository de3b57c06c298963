"""Connecting to the server and the raw round trips every other family of the broker builds on.

The contract of the whole broker is kept here: replies stay bytes (never ``decode_responses``) so
a binary value cannot poison a batch, the protocol is pinned to RESP2 because the stream replies
are parsed by the broker, and redis-py's own retries are off: re-sending an XREADGROUP whose reply
was lost would hide delivered entries, so the worker reconnects itself and re-reads its pending
entries instead. Redis errors are translated in one place, ``Connection.translate_errors``, into
PSPF's error types; every other family runs its commands inside it.

What lives here: the client of the URL's topology (a server, a cluster, a Sentinel's master),
the routing of keys to a cluster's nodes, the checks of what the server offers, the Lua scripts
(``pspf/lua/``, registered once per broker), and the pipelined raw sends
(``eval_pipelined``, ``raw_connection``) that carry a batch in one round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any, cast

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

from pspf.broker.records import ServerInfo, _text, packed
from pspf.errors import (
    AuthenticationFailed,
    BrokerError,
    BrokerOutOfMemory,
    BrokerUnavailable,
    EvictingPolicy,
    GroupMissing,
    LeaseLost,
)
from pspf.settings import BrokerAddress, RedisSettings, mask_url, parse_broker_url

log = logging.getLogger(__name__)


#: What the server's refusal of a write for memory says (``OOM command not allowed when ...``).
_OOM_TEXT = "command not allowed when used memory > 'maxmemory'"


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


def script_source(name: str) -> str:
    """The text of the Lua script ``pspf/lua/NAME.lua``."""
    return resources.files("pspf").joinpath(f"lua/{name}.lua").read_text()


#: Host names of this machine, where ``pspf server`` can start a server the URL reaches.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def local_server_hint(address: BrokerAddress) -> str:
    """How to start a local server (``pspf server``) where a plain URL on this machine points."""
    if address.topology != "standalone" or address.tls or len(address.hosts) != 1:
        return ""
    host, port = address.hosts[0]
    if host.lower() not in LOCAL_HOSTS:
        return ""
    flag = "" if port == 6379 else f" --port {port}"
    return f" (to start a local server there: pspf server{flag})"


class Connection:
    """A connection pool to one Redis or Valkey server and the raw round trips.

    Every family of the broker holds one (``conn``) and sends its commands through ``client``
    (or ``on(key)`` for a transaction on one partition), inside ``translate_errors``.
    """

    def __init__(self, settings: RedisSettings, socket_timeout_s: float = 30.0) -> None:
        self.url = mask_url(settings.url)
        self.address = parse_broker_url(settings.url)
        #: how long producers of this connection wait for a repartition to finish
        self.repartition_wait_s = settings.repartition_wait_s
        #: a Redis Cluster: commands of several partitions go per slot, grouped per node
        self.cluster = self.address.topology == "cluster"
        try:  # a cluster client asks its seed nodes for the slot map at once
            self.client = _connect(settings, self.address, socket_timeout_s)
        except (redis.RedisError, RedisClusterException) as exc:
            self._refused_login(exc)
            raise self._unreachable(exc) from exc
        self._slots_stale = False
        #: sent after each acknowledging call on its connection (``PSPF_WAIT_REPLICAS``)
        self.ack_wait: tuple[Any, ...] = (
            ("WAIT", settings.wait_replicas, settings.wait_timeout_ms) if settings.wait_replicas else ()
        )
        if not self.cluster:  # a cluster's node clients are set so in on
            _raw_stream_replies(self.client)

    def register(self, name: str) -> Script:
        """The Lua script ``pspf/lua/NAME.lua``, registered with this client (no round trip)."""
        return self.client.register_script(script_source(name))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()
        # Behind Sentinel the client's pool asks the sentinels through clients of its own.
        pool = getattr(self.client, "connection_pool", None)
        for sentinel in getattr(getattr(pool, "sentinel_manager", None), "sentinels", ()):
            sentinel.close()

    def on(self, key: str) -> redis.Redis:
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
            node = self.on(key)
            groups.setdefault(id(node), (node, []))[1].append(i)
        return list(groups.values())

    def _unreachable(self, exc: Exception) -> BrokerUnavailable:
        """The cannot-reach error; on this machine's own address it says how to start a server there."""
        return BrokerUnavailable(f"cannot reach Redis at {self.url}: {exc}{local_server_hint(self.address)}")

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
            raise self._unreachable(exc) from exc
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
        names: list[str] = []
        warnings: list[str] = []
        for server in self.servers():
            with self.translate_errors():
                info = server.info("server")
                if server.execute_command("COMMAND", "INFO", "XAUTOCLAIM") in ([None], [], None):  # type: ignore[no-untyped-call]
                    raise BrokerError(
                        f"the server at {self.url} lacks XAUTOCLAIM: PSPF needs Redis >= 6.2 or Valkey"
                    )
            versions.append(str(info.get("valkey_version") or info.get("redis_version") or "unknown"))
            valkey = "valkey_version" in info or info.get("server_name") == "valkey"
            names.append("Valkey" if valkey else "Redis")
            where = "" if not self.cluster else f"node {_node_name(server)}: "
            warnings += [where + warning for warning in _guarantee_warnings(server)]
        return ServerInfo(", ".join(sorted(set(versions))), warnings, "/".join(sorted(set(names))))

    def check_eviction(self) -> bool:
        """Raise EvictingPolicy when a server may evict keys; False when its policy cannot be read.

        Any ``maxmemory-policy`` but ``noeviction`` may evict PSPF's keys, the ``volatile-*`` ones
        too (leases and markers have a TTL). One cheap ``CONFIG GET`` per server; where CONFIG is
        renamed or refused by an ACL the policy is unchecked.
        """
        checked = True
        for server in self.servers():
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

    def servers(self) -> list[redis.Redis]:
        """Every server PSPF's keys live on: the one, or a cluster's primaries."""
        if not self.cluster:
            return [cast(redis.Redis, self.client)]
        with self.translate_errors():
            return [node.redis_connection for node in self.client.get_primaries()]

    def replicated(self, replicas: int) -> None:
        """Say when fewer replicas than asked for have an acknowledging call (WAIT's reply)."""
        wanted, timeout_ms = self.ack_wait[1:]
        if replicas < wanted:
            log.warning(
                "only %s of %s replicas have the last acknowledgement after %s ms: a fail-over now "
                "could lose it (PSPF_WAIT_REPLICAS)",
                replicas,
                wanted,
                timeout_ms,
            )

    def eval_pipelined(
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
        with self.raw_connection(node) as send:
            replies = send([*commands, *([then] if then else [])], keep_errors=True)
        if then:
            if then[0] == "WAIT" and isinstance(replies[-1], int):
                self.replicated(replies[-1])
            replies.pop()
        return replies

    @contextmanager
    def raw_connection(self, node: redis.Redis) -> Iterator[Callable[..., list[Any]]]:
        """A pooled connection's ``send(commands, keep_errors=False)``: one write, then every reply.

        Packed by hiredis directly: these calls carry a batch's values (thousands of arguments),
        and redis-py's generic packing costs about a microsecond more per argument. Errors are
        PSPF errors; a connection left with unread replies is closed, never reused.
        """
        pool = node.connection_pool
        with self.translate_errors():
            connection = pool.get_connection()

            def send(commands: Sequence[tuple[Any, ...]], keep_errors: bool = False) -> list[Any]:
                connection.send_packed_command(packed(commands))  # type: ignore[no-untyped-call]
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

    def reply_or_error(self, reply: Any) -> Any:
        """A reply, or the PSPF error of an error reply."""
        if not isinstance(reply, redis.ResponseError):
            return reply
        try:
            with self.translate_errors():
                raise reply
        except BrokerError as exc:
            return exc


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
