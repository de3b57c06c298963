"""The one settings object, loaded as defaults < ``PSPF_*`` environment < CLI flags < code.

Each setting that a user may set from outside the code has one environment variable, listed in
``ENV_VARS``; the CLI builds its options from the same table, so the flag ``--batch-size`` and
the variable ``PSPF_BATCH_SIZE`` can never drift apart.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote_plus, urlsplit

import msgspec

from pspf.errors import ConfigError
from pspf.state_stores.registry import file_engines

#: A state store engine's name: one of ``pspf.state_stores.registry.file_engines()``, checked on load.
Engine = str
Durability = Literal["normal", "fsync"]
StartFrom = Literal["earliest", "latest"]
RetryMode = Literal["ordered", "deferred"]


class RedisSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach the broker.

    The TLS files are for ``rediss://`` URLs: the CA to verify the server with (else the system's
    trust store), and the client certificate and key for servers that ask for one (mutual TLS).
    """

    url: str = "redis://127.0.0.1:6379/0"
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: replicas that must have each acknowledging call (WAIT) before the worker goes on; 0: none
    wait_replicas: Annotated[int, msgspec.Meta(ge=0)] = 0
    wait_timeout_ms: Annotated[int, msgspec.Meta(ge=1)] = 1000
    #: producers slow down above this share of the server's maxmemory, and stop above the next
    memory_slow_at: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.85
    memory_fail_at: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.95
    #: how long producers wait for a repartition of a topic they write to before they fail
    repartition_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0

    def __repr__(self) -> str:
        tls = "".join(
            f", {name}={value!r}"
            for name, value in [
                ("tls_ca_file", self.tls_ca_file),
                ("tls_cert_file", self.tls_cert_file),
                ("tls_key_file", self.tls_key_file),
            ]
            if value
        )
        return f"RedisSettings(url={mask_url(self.url)!r}, connect_timeout_s={self.connect_timeout_s}{tls})"

    def check_tls(self) -> None:
        """Raise ConfigError for TLS files that cannot work, before a connection fails obscurely."""
        files = {
            "PSPF_TLS_CA_FILE (--tls-ca-file)": self.tls_ca_file,
            "PSPF_TLS_CERT_FILE (--tls-cert-file)": self.tls_cert_file,
            "PSPF_TLS_KEY_FILE (--tls-key-file)": self.tls_key_file,
        }
        given = {name: path for name, path in files.items() if path}
        if given and not self.url.startswith("rediss"):
            raise ConfigError(f"{', '.join(given)}: TLS files need a rediss:// (or rediss+...) broker URL")
        if self.tls_key_file and not self.tls_cert_file:
            raise ConfigError("PSPF_TLS_KEY_FILE (--tls-key-file) needs the certificate of that key too")
        for name, path in given.items():
            if not os.path.isfile(path):
                raise ConfigError(f"{name}: no such file {path!r}")


class ConsumerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How a worker reads, owns and acknowledges partitions."""

    batch_size: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000
    block_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 1000
    #: after a read that filled no stream's batch, the next read waits this long (0: at once), so
    #: batches (a sink's objects) gather what arrives meanwhile
    linger_ms: Annotated[int, msgspec.Meta(ge=0, le=600_000)] = 0
    consumer_name: str | None = None
    start_from: StartFrom = "earliest"
    lease_ttl_ms: Annotated[int, msgspec.Meta(ge=500)] = 10_000
    min_idle_ms: Annotated[int, msgspec.Meta(ge=1)] = 60_000
    #: group consumers with nothing pending idle this long are deleted (0: never)
    forget_consumers_after_s: Annotated[float, msgspec.Meta(ge=0)] = 86_400.0


class RetrySettings(msgspec.Struct, frozen=True, kw_only=True):
    """The run-wide retry policy; an App or a handler may override any of it in code."""

    max_retries: Annotated[int, msgspec.Meta(ge=1)] = 3
    base_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 200
    factor: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    max_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 30_000
    mode: RetryMode = "ordered"
    max_deliveries: Annotated[int, msgspec.Meta(ge=1)] = 5
    timeout_ms: Annotated[int, msgspec.Meta(gt=0)] | None = None


def default_state_dir() -> str:
    """The state directory unless ``PSPF_STATE_DIR`` or ``--state-dir`` names one.

    A per-user data directory, never one relative to the working directory, so that a worker and
    the commands reading its stores find the same stores wherever they are started from:
    ``$XDG_DATA_HOME/pspf/state`` (``~/.local/share/pspf/state`` without it) on Linux and other
    Unix systems, ``~/Library/Application Support/pspf/state`` on macOS, and ``pspf/state`` under
    ``%LOCALAPPDATA%`` on Windows.
    """
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = str(Path.home() / "Library" / "Application Support")
    else:
        xdg = os.environ.get("XDG_DATA_HOME", "")
        # The XDG spec: a relative path in the variable is invalid and is ignored.
        base = xdg if os.path.isabs(xdg) else str(Path.home() / ".local" / "share")
    return str(Path(base) / "pspf" / "state")


class StateSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how state is kept."""

    dir: str = msgspec.field(default_factory=default_state_dir)
    engine: Engine = "sqlite"
    durability: Durability = "normal"
    #: Keep each partition's state in Redis too, so that it follows the partition to any
    #: machine; "off" for one machine whose disk lasts (then a missing or stale store is refused).
    backup: Literal["on", "off"] = "on"
    #: How many hashes each partition's backup spreads its values over. One hash of many small
    #: values takes 2-3x their size in Redis; hashes of up to 512 small values are kept compact
    #: (listpack): set it near (keys per partition) / 100. A change re-uploads each partition's
    #: backup once, at its next takeover.
    backup_buckets: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1
    #: Keep the stores of the partitions this worker does not own following their backups, so
    #: that taking one over needs no full restore (each worker then holds a copy of all state).
    standby: bool = False


class OutboxSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the outbox relay publishes what handlers emit."""

    #: Publish attempts of a row before it is DEAD (an operator replays it).
    max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 10
    base_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 200
    max_delay_ms: Annotated[int, msgspec.Meta(ge=0)] = 30_000
    #: A claim not settled for this long is expired: the row goes back to PENDING.
    claim_timeout_ms: Annotated[int, msgspec.Meta(ge=1)] = 30_000
    #: Published rows are kept this long (for ``pspf outbox list/replay``), then deleted.
    retention_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0


class TimeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Event time: windows, and what moves them when input stops."""

    #: A partition with open windows that gets no entry for this long closes them all (their
    #: results are emitted; entries for them that come later are late).
    idle_close_ms: Annotated[int, msgspec.Meta(ge=1)] = 30_000


class MetricsSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where a worker serves Prometheus metrics and its health; without a port it serves nothing.

    The host defaults to the loopback interface so a worker exposes nothing by accident; set
    0.0.0.0 to let a Prometheus on another machine scrape it. Port 0 takes any free port.
    """

    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    host: str = "127.0.0.1"
    #: A worker that owns a partition with lag and has not committed for this long is "stuck".
    stuck_after_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a worker or a CLI command needs to know, validated once."""

    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    consumer: ConsumerSettings = msgspec.field(default_factory=ConsumerSettings)
    retry: RetrySettings = msgspec.field(default_factory=RetrySettings)
    state: StateSettings = msgspec.field(default_factory=StateSettings)
    metrics: MetricsSettings = msgspec.field(default_factory=MetricsSettings)
    outbox: OutboxSettings = msgspec.field(default_factory=OutboxSettings)
    time: TimeSettings = msgspec.field(default_factory=TimeSettings)

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        spelled: Mapping[str, str] | None = None,
    ) -> Settings:
        """Build settings from defaults, then ``PSPF_*`` variables, then ``overrides``.

        ``overrides`` maps environment variable names (``PSPF_BATCH_SIZE``) to values; a value of
        None means "not given" and leaves the lower layer in place. ``spelled`` names how the
        user gave an override (``--batch-size``, a CLI flag), so that an error names that.
        """
        environ = os.environ if environ is None else environ
        layered: dict[str, Any] = {name: environ[name] for name in ENV_VARS if name in environ}
        for name, value in (overrides or {}).items():
            if name not in ENV_VARS:
                raise ConfigError(f"unknown setting {name!r}")
            if value is not None:
                layered[name] = value
        tree: dict[str, dict[str, Any]] = {}
        for name, value in layered.items():
            group, field = ENV_VARS[name]
            tree.setdefault(group, {})[field] = value
        try:
            settings = msgspec.convert(tree, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(_invalid(str(exc), layered, spelled or {})) from None
        _check_engine(settings.state.engine, layered, spelled or {})
        check_broker_url(settings.redis.url)
        settings.redis.check_tls()
        return settings


ENV_VARS: dict[str, tuple[str, str]] = {
    "PSPF_BROKER": ("redis", "url"),
    "PSPF_TLS_CA_FILE": ("redis", "tls_ca_file"),
    "PSPF_TLS_CERT_FILE": ("redis", "tls_cert_file"),
    "PSPF_TLS_KEY_FILE": ("redis", "tls_key_file"),
    "PSPF_WAIT_REPLICAS": ("redis", "wait_replicas"),
    "PSPF_WAIT_TIMEOUT_MS": ("redis", "wait_timeout_ms"),
    "PSPF_MEMORY_SLOW_AT": ("redis", "memory_slow_at"),
    "PSPF_REPARTITION_WAIT_S": ("redis", "repartition_wait_s"),
    "PSPF_MEMORY_FAIL_AT": ("redis", "memory_fail_at"),
    "PSPF_BATCH_SIZE": ("consumer", "batch_size"),
    "PSPF_BLOCK_MS": ("consumer", "block_ms"),
    "PSPF_LINGER_MS": ("consumer", "linger_ms"),
    "PSPF_CONSUMER": ("consumer", "consumer_name"),
    "PSPF_START_FROM": ("consumer", "start_from"),
    "PSPF_LEASE_TTL_MS": ("consumer", "lease_ttl_ms"),
    "PSPF_MIN_IDLE_MS": ("consumer", "min_idle_ms"),
    "PSPF_FORGET_CONSUMERS_AFTER_S": ("consumer", "forget_consumers_after_s"),
    "PSPF_MAX_RETRIES": ("retry", "max_retries"),
    "PSPF_RETRY_BASE_MS": ("retry", "base_delay_ms"),
    "PSPF_RETRY_FACTOR": ("retry", "factor"),
    "PSPF_RETRY_MAX_MS": ("retry", "max_delay_ms"),
    "PSPF_RETRY_MODE": ("retry", "mode"),
    "PSPF_MAX_DELIVERIES": ("retry", "max_deliveries"),
    "PSPF_HANDLER_TIMEOUT_MS": ("retry", "timeout_ms"),
    "PSPF_STATE_DIR": ("state", "dir"),
    "PSPF_STORE": ("state", "engine"),
    "PSPF_DURABILITY": ("state", "durability"),
    "PSPF_STATE_BACKUP": ("state", "backup"),
    "PSPF_STATE_BACKUP_BUCKETS": ("state", "backup_buckets"),
    "PSPF_STANDBY": ("state", "standby"),
    "PSPF_OUTBOX_MAX_ATTEMPTS": ("outbox", "max_attempts"),
    "PSPF_OUTBOX_RETRY_BASE_MS": ("outbox", "base_delay_ms"),
    "PSPF_OUTBOX_RETRY_MAX_MS": ("outbox", "max_delay_ms"),
    "PSPF_OUTBOX_CLAIM_TIMEOUT_MS": ("outbox", "claim_timeout_ms"),
    "PSPF_OUTBOX_RETENTION_S": ("outbox", "retention_s"),
    "PSPF_WINDOW_IDLE_CLOSE_MS": ("time", "idle_close_ms"),
    "PSPF_METRICS_PORT": ("metrics", "port"),
    "PSPF_METRICS_HOST": ("metrics", "host"),
    "PSPF_STUCK_AFTER_S": ("metrics", "stuck_after_s"),
}


_SETTING_OF = {where: name for name, where in ENV_VARS.items()}


def _invalid(message: str, given: Mapping[str, Any], spelled: Mapping[str, str]) -> str:
    """The validation error named as the user gave the value: ``invalid --batch-size 0: expected ...``.

    msgspec says ``Expected `int` >= 1 - at `$.consumer.batch_size```; the path becomes the flag
    the value came from (``spelled``), else the variable (``PSPF_BATCH_SIZE=0``).
    """
    what, _, path = message.rpartition(" - at ")
    group, _, field = path.strip("`").removeprefix("$.").partition(".")
    name = _SETTING_OF.get((group, field))
    if not what or name is None:
        return f"invalid setting: {message}"
    what = what[:1].lower() + what[1:]
    if name not in given:
        return f"invalid {name}: {what}"
    value = given[name]
    if name in spelled:
        return f"invalid {spelled[name]} {value}: {what}"
    return f"invalid {name}={value}: {what}"


def _check_engine(engine: str, given: Mapping[str, Any], spelled: Mapping[str, str]) -> None:
    """Refuse a store engine the registry does not list, worded as msgspec words a bad enum value."""
    if engine not in file_engines():
        message = f"Invalid enum value {engine!r} - at `$.state.engine`"
        raise ConfigError(_invalid(message, given, spelled))


_ENCODE_HINT = "percent-encode / ? # @ [ ] in a password"


#: Broker URL schemes: (topology, TLS) of each.
_SCHEMES: dict[str, tuple[str, bool]] = {
    "redis": ("standalone", False),
    "rediss": ("standalone", True),
    "unix": ("standalone", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
#: Query parameters a cluster or Sentinel URL may carry (a standalone URL takes redis-py's own).
_TOPOLOGY_OPTIONS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "sentinel_username",
        "sentinel_password",
    }
)


class BrokerAddress(msgspec.Struct, frozen=True):
    """A parsed cluster or Sentinel broker URL (standalone URLs go to redis-py as they are).

    ``hosts`` are the cluster's seed nodes or the sentinels; the user name and password are the
    data nodes' (ACL), ``sentinel_username`` / ``sentinel_password`` options the sentinels'.
    """

    topology: str
    tls: bool
    hosts: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    master: str = ""
    db: int = 0
    options: dict[str, str] = {}


def parse_broker_url(url: str) -> BrokerAddress:
    """Check a broker URL and, for a cluster or Sentinel, take it apart; ConfigError when unusable.

    ``redis+cluster://[user:pass@]host:port[,host:port...]`` names seed nodes of a cluster;
    ``redis+sentinel://[user:pass@]host:port[,host:port...]/MASTER[/DB]`` the sentinels of a
    master; ``rediss+...`` is the same over TLS.
    """
    # Never the exceptions' text: it quotes parts of the URL, which may be a password cut short.
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ConfigError(f"invalid broker URL: cannot parse it ({_ENCODE_HINT})") from None
    shown = mask_url(url)
    if parts.scheme not in _SCHEMES:
        raise ConfigError(
            f"invalid broker URL {shown!r}: scheme must be one of " + ", ".join(f"{s}://" for s in _SCHEMES)
        )
    topology, tls = _SCHEMES[parts.scheme]
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"invalid broker URL {shown!r}: unix:// needs a socket path")
        return BrokerAddress(topology, tls, [])
    userinfo, _, netloc = parts.netloc.rpartition("@")
    hosts = [_host_port(hp, 26379 if topology == "sentinel" else 6379, shown) for hp in netloc.split(",")]
    if topology == "standalone":
        if len(hosts) != 1:
            raise ConfigError(
                f"invalid broker URL {shown!r}: several hosts need redis+cluster:// or redis+sentinel://"
            )
        number = parts.path.lstrip("/")
        if number and not number.isdigit():
            raise ConfigError(f"invalid broker URL {shown!r}: database must be a number")
        return BrokerAddress(topology, tls, hosts)
    master, db = _master_and_db(topology, parts.path, shown)
    options = _topology_options(parts.query, shown)
    user, has_password, password = userinfo.partition(":")
    return BrokerAddress(
        topology,
        tls,
        hosts,
        unquote_plus(user) or None,
        unquote_plus(password) if has_password else None,
        master,
        db,
        options,
    )


def _master_and_db(topology: str, path: str, shown: str) -> tuple[str, int]:
    """A Sentinel URL's master name and database (a cluster has database 0 only)."""
    names = [p for p in path.split("/") if p]
    if topology == "cluster":
        if names not in ([], ["0"]):
            raise ConfigError(f"invalid broker URL {shown!r}: a cluster has only database 0")
        return "", 0
    if not names or len(names) > 2:
        raise ConfigError(f"invalid broker URL {shown!r}: give the master's name: .../MASTER_NAME[/DB]")
    db = names[1] if len(names) == 2 else "0"
    if not db.isdigit():
        raise ConfigError(f"invalid broker URL {shown!r}: database must be a number")
    return unquote_plus(names[0]), int(db)


def _topology_options(query: str, shown: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for arg in filter(None, query.split("&")):
        name, _, value = arg.partition("=")
        name = unquote_plus(name)
        if name not in _TOPOLOGY_OPTIONS:
            known = ", ".join(sorted(_TOPOLOGY_OPTIONS))
            raise ConfigError(f"invalid broker URL {shown!r}: unknown option {name!r} (known: {known})")
        options[name] = unquote_plus(value)
    return options


def _host_port(text: str, default_port: int, shown: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, ""
    host = host.strip("[]")
    if not host:
        raise ConfigError(f"invalid broker URL {shown!r}: no host")
    if port and not (port.isdigit() and 0 < int(port) <= 65535):
        raise ConfigError(
            f"invalid broker URL {shown!r}: the port must be a number up to 65535 ({_ENCODE_HINT})"
        )
    return host, int(port) if port else default_port


def check_broker_url(url: str) -> None:
    """Raise ConfigError unless ``url`` is a broker URL we can use (see ``parse_broker_url``)."""
    parse_broker_url(url)


#: Query parameters of a broker URL whose values carry no credential and are shown in messages
#: (redis-py's connection options); the value of any other parameter, ``password``,
#: ``ssl_password`` or a misspelt one alike, is masked.
_SHOWN_QUERY_ARGS = frozenset(
    {
        "db",
        "username",
        "client_name",
        "protocol",
        "timeout",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_read_size",
        "retry_on_timeout",
        "max_connections",
        "health_check_interval",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)


def mask_url(url: str) -> str:
    """The URL with every credential replaced by ``***``, safe to log or print.

    A user name is shown next to its masked password; a user-info without a password is hidden
    whole, since some clients read ``redis://secret@host`` as a password. Query values are shown
    only for the options in ``_SHOWN_QUERY_ARGS``. An ``@`` after the host means a password with an
    unencoded ``/``, ``?`` or ``#`` cut the URL short, so everything up to the last ``@`` is hidden.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if "@" in parts.path + parts.query + parts.fragment:
        tail = mask_url(f"{parts.scheme}://{url.rpartition('@')[2]}")
        return tail.replace("://", "://***@", 1)
    masked = url.partition("#")[0].partition("?")[0]
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        user = f"{userinfo.partition(':')[0]}:" if parts.password is not None else ""
        masked = masked.replace(parts.netloc, f"{user}***@{host}", 1)
    if parts.query:
        masked += "?" + "&".join(_mask_query_arg(arg) for arg in parts.query.split("&"))
    return masked + ("#***" if parts.fragment else "")


def _mask_query_arg(arg: str) -> str:
    name, sep, _ = arg.partition("=")
    if unquote_plus(name) in _SHOWN_QUERY_ARGS:
        return arg
    return f"{name}=***" if sep else "***"
