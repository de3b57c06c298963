from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from pspf import App, Worker
from pspf.cli import cli
from pspf.errors import ConfigError
from pspf.settings import (
    BrokerAddress,
    RedisSettings,
    Settings,
    check_broker_url,
    default_state_dir,
    mask_url,
    parse_broker_url,
)
from pspf.state_stores import register_engine, registry


def test_defaults() -> None:
    s = Settings.load(environ={})
    assert s.redis.url == "redis://127.0.0.1:6379/0"
    assert s.consumer.batch_size == 1000
    assert s.state.engine == "sqlite"
    assert s.state.durability == "normal"


def test_environment_then_overrides_win_in_order() -> None:
    env = {"PSPF_BATCH_SIZE": "50", "PSPF_STATE_DIR": "/env", "PSPF_BROKER": "redis://h:1/2"}
    s = Settings.load({"PSPF_STATE_DIR": "/flag", "PSPF_BLOCK_MS": None}, environ=env)
    assert s.consumer.batch_size == 50  # env coerced from text
    assert s.state.dir == "/flag"  # CLI flag beats env
    assert s.consumer.block_ms == 1000  # None means "not given"
    assert s.redis.url == "redis://h:1/2"


def test_standby_from_the_variable_and_the_flag_and_its_need_of_the_backup() -> None:
    assert Settings.load(environ={}).state.standby is False
    assert Settings.load(environ={"PSPF_STANDBY": "true"}).state.standby is True
    assert Settings.load({"PSPF_STANDBY": False}, environ={"PSPF_STANDBY": "1"}).state.standby is False
    with pytest.raises(ConfigError, match="PSPF_STANDBY"):
        Settings.load(environ={"PSPF_STANDBY": "maybe"})

    app = App("standby-check")
    app.handler("orders")(lambda value, ctx: None)
    off = Settings.load({"PSPF_STANDBY": True, "PSPF_STATE_BACKUP": "off"}, environ={})
    with pytest.raises(ConfigError, match="needs --state-backup on"):
        Worker(app, off)


def test_bad_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="PSPF_BATCH_SIZE"):
        Settings.load(environ={"PSPF_BATCH_SIZE": "many"})
    with pytest.raises(ConfigError, match="PSPF_BATCH_SIZE"):
        Settings.load({"PSPF_BATCH_SIZE": 0}, environ={})
    with pytest.raises(ConfigError, match="PSPF_DURABILITY"):
        Settings.load({"PSPF_DURABILITY": "sometimes"}, environ={})


def test_unknown_setting_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.load({"PSPF_BATCHSIZE": 5}, environ={})


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://localhost:6379", "scheme"),
        ("localhost:6379", "scheme"),
        ("redis://", "no host"),
        ("redis://localhost:notaport/0", "invalid broker URL"),
        ("redis://localhost:6379/zero", "database"),
        ("unix://", "socket path"),
        ("redis://h1:6379,h2:6379/0", "several hosts need"),
        ("redis+cluster://h1:7000,:7001", "no host"),
        ("redis+cluster://h1:7000,h2:70000", "port must be a number"),
        ("redis+cluster://h1:7000/3", "only database 0"),
        ("redis+cluster://h1:7000?ssl_ca_certz=x", "unknown option 'ssl_ca_certz'"),
        ("redis+sentinel://s1:26379", "master's name"),
        ("redis+sentinel://s1:26379/mymaster/one", "database must be a number"),
        ("redis+sentinel://s1:26379/mymaster/0/x", "master's name"),
        ("redis+sentinal://s1:26379/mymaster", "scheme must be one of"),
    ],
)
def test_malformed_broker_urls(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        check_broker_url(url)


def test_good_broker_urls() -> None:
    for url in ("redis://localhost", "rediss://u:p@host:6380/1", "unix:///run/redis.sock"):
        check_broker_url(url)


@pytest.mark.parametrize(
    ("url", "address"),
    [
        (
            "redis+cluster://n1:7000,n2,[::1]:7002",
            BrokerAddress("cluster", False, [("n1", 7000), ("n2", 6379), ("::1", 7002)]),
        ),
        (
            "rediss+cluster://alice:s%40cret@n1:7000/0?ssl_ca_certs=ca.pem&ssl_cert_reqs=none",
            BrokerAddress(
                "cluster",
                True,
                [("n1", 7000)],
                "alice",
                "s@cret",
                options={"ssl_ca_certs": "ca.pem", "ssl_cert_reqs": "none"},
            ),
        ),
        (
            "redis+sentinel://:pw@s1,s2:26380/my%20master/2?sentinel_password=spw",
            BrokerAddress(
                "sentinel",
                False,
                [("s1", 26379), ("s2", 26380)],
                None,
                "pw",
                "my master",
                2,
                {"sentinel_password": "spw"},
            ),
        ),
        ("rediss+sentinel://s1/m", BrokerAddress("sentinel", True, [("s1", 26379)], master="m")),
    ],
)
def test_cluster_and_sentinel_urls_are_taken_apart(url: str, address: BrokerAddress) -> None:
    assert parse_broker_url(url) == address


def test_cluster_and_sentinel_urls_never_show_their_passwords() -> None:
    for url in (
        "redis+cluster://alice:s3cret@n1:7000,n2:7001",
        "redis+sentinel://s1:26379,s2:26379/m?sentinel_password=s3cret",
        "rediss+sentinel://:s3cret@s1/m",
    ):
        assert "s3cret" not in mask_url(url)
        assert "s3cret" not in repr(Settings.load({"PSPF_BROKER": url}, environ={}))
    with pytest.raises(ConfigError) as info:
        check_broker_url("redis+cluster://alice:s3cret@n1:7000/4")
    assert "s3cret" not in str(info.value)


def test_passwords_never_show() -> None:
    url = "rediss://alice:s3cret@cache.example:6380/0"
    assert mask_url(url) == "rediss://alice:***@cache.example:6380/0"
    s = Settings.load({"PSPF_BROKER": url}, environ={})
    assert "s3cret" not in repr(s)
    with pytest.raises(ConfigError) as info:
        check_broker_url("ftp://alice:s3cret@host")
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        # user-info: the user name is shown next to a masked password
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://alice:s3cret@h/0", "redis://alice:***@h/0"),
        ("redis://alice:s%40cr%3Aet@h/0", "redis://alice:***@h/0"),
        ("redis://alice:s3c@ret@h/0", "redis://alice:***@h/0"),
        # a lone user-info may be a password (other clients read it so): hidden whole
        ("redis://s3cret@h/0", "redis://***@h/0"),
        # query parameters redis-py turns into credentials, and any it does not know
        ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
        ("redis://h/0?username=alice&password=s3cret", "redis://h/0?username=alice&password=***"),
        ("redis://h/0?pass%77ord=s3cret", "redis://h/0?pass%77ord=***"),
        (
            "rediss://h/0?ssl_password=s3cret&ssl_keyfile=k.pem",
            "rediss://h/0?ssl_password=***&ssl_keyfile=k.pem",
        ),
        ("redis://h/0?pasword=s3cret", "redis://h/0?pasword=***"),
        ("redis://h/0?s3cret", "redis://h/0?***"),
        ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
        ("unix://:s3cret@/run/redis.sock", "unix://:***@/run/redis.sock"),
        # options that carry no credential stay readable
        (
            "rediss://h:6380/0?ssl_ca_certs=ca.crt&ssl_cert_reqs=required&socket_timeout=5",
            "rediss://h:6380/0?ssl_ca_certs=ca.crt&ssl_cert_reqs=required&socket_timeout=5",
        ),
        # a password with an unencoded / ? or # cuts the URL short: all before the last @ is hidden
        ("redis://alice:s3/cret@h:6379/0", "redis://***@h:6379/0"),
        ("redis://:s3?cret@h:6379/0?password=s3cret", "redis://***@h:6379/0?password=***"),
        ("redis://:s3#cret@h/0", "redis://***@h/0"),
        ("redis://h/0#s3cret", "redis://h/0#***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_mask_url_hides_every_credential(url: str, masked: str) -> None:
    assert mask_url(url) == masked
    assert "s3cret" not in repr(RedisSettings(url=url))


@pytest.mark.parametrize(
    "url",
    [
        "redis://alice:s3cret/x@h:6379/0",
        "redis://:s3cret#x@h/0",
        "redis://:s3cret[@h/0",
        "ftp://h/0?password=s3cret",
        "redis://:12/s3cret@h/0",
    ],
)
def test_malformed_url_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(ConfigError, match="invalid broker URL") as info:
        check_broker_url(url)
    assert "s3cret" not in str(info.value)


def test_spark_sink_options_repr_never_shows_the_url() -> None:
    """Spark may print the options it ships to its tasks; they hold the URL with its password."""
    pytest.importorskip("pyspark")
    pytest.importorskip("pyarrow")
    from pspf.spark import SinkOptions

    options = SinkOptions(
        url="redis://h/0?password=s3cret",
        topic="orders",
        partitions=1,
        key=None,
        value=None,
        columns=(),
        maxlen="",
        minid="",
        idempotency_key=None,
        marker_ttl_s=1,
    )
    assert "s3cret" not in repr(options)
    assert "orders" in repr(options)


def test_tls_files_from_the_environment_and_their_checks(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not checked here: the TLS handshake reads it")
    env = {"PSPF_BROKER": "rediss://h:6380/0", "PSPF_TLS_CA_FILE": str(ca)}
    settings = Settings.load(environ=env)
    assert settings.redis.tls_ca_file == str(ca)
    assert "tls_ca_file" in repr(settings.redis)
    with pytest.raises(ConfigError, match="need a rediss://"):
        Settings.load(environ={**env, "PSPF_BROKER": "redis://h:6379/0"})
    with pytest.raises(ConfigError, match="no such file"):
        Settings.load({"PSPF_TLS_CERT_FILE": str(tmp_path / "missing.crt")}, environ=env)
    with pytest.raises(ConfigError, match="needs the certificate"):
        Settings.load({"PSPF_TLS_KEY_FILE": str(ca)}, environ=env)


def test_default_state_dir_is_the_user_data_dir_wherever_the_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    want = str(tmp_path / "data" / "pspf" / "state")
    for folder in (tmp_path, tmp_path / "elsewhere"):
        folder.mkdir(exist_ok=True)
        monkeypatch.chdir(folder)
        assert Settings.load(environ={}).state.dir == want
    assert default_state_dir() == want

    # Without XDG_DATA_HOME (or with a relative one, which the spec says to ignore): ~/.local/share
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_state_dir() == str(tmp_path / "home" / ".local" / "share" / "pspf" / "state")
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")
    assert default_state_dir() == str(tmp_path / "home" / ".local" / "share" / "pspf" / "state")

    # the variable and the flag still win
    assert Settings.load(environ={"PSPF_STATE_DIR": "/env"}).state.dir == "/env"
    assert Settings.load({"PSPF_STATE_DIR": "/flag"}, environ={"PSPF_STATE_DIR": "/env"}).state.dir == "/flag"


@pytest.fixture
def json_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The JSON engine of the tests registered for one test, the registry as it was after it."""
    monkeypatch.setattr(registry, "_ENGINES", dict(registry.engines()))
    register_engine("json", "tests.support.json_store:JsonStore", suffix=".json")
    yield


def test_store_engines_are_the_registered_ones(json_engine: None) -> None:
    """PSPF_STORE and --store take what the registry lists, with the same words for a bad value."""
    assert Settings.load(environ={"PSPF_STORE": "json"}).state.engine == "json"
    assert Settings.load(environ={"PSPF_STORE": "rocksdb"}).state.engine == "rocksdb"
    with pytest.raises(ConfigError, match=r"^invalid PSPF_STORE=memory: invalid enum value 'memory'$"):
        Settings.load(environ={"PSPF_STORE": "memory"})  # registered, but keeps nothing on disk
    with pytest.raises(ConfigError, match=r"^invalid --store nosuch: invalid enum value 'nosuch'$"):
        Settings.load({"PSPF_STORE": "nosuch"}, environ={}, spelled={"PSPF_STORE": "--store"})
    result = CliRunner().invoke(cli, ["run", "--store", "nosuch", "x:app"])
    assert result.exit_code == 2
    assert "'nosuch' is not one of 'sqlite', 'rocksdb', 'json'" in result.output
