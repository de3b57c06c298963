from __future__ import annotations

import pytest

from pspf.errors import ConfigError
from pspf.settings import Settings, check_broker_url, mask_url


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
    ],
)
def test_malformed_broker_urls(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        check_broker_url(url)


def test_good_broker_urls() -> None:
    for url in ("redis://localhost", "rediss://u:p@host:6380/1", "unix:///run/redis.sock"):
        check_broker_url(url)


def test_passwords_never_show() -> None:
    url = "rediss://alice:s3cret@cache.example:6380/0"
    assert mask_url(url) == "rediss://alice:***@cache.example:6380/0"
    s = Settings.load({"PSPF_BROKER": url}, environ={})
    assert "s3cret" not in repr(s)
    with pytest.raises(ConfigError) as info:
        check_broker_url("ftp://alice:s3cret@host")
    assert "s3cret" not in str(info.value)
