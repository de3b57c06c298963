"""``pspf sink postgres`` mistakes: one line on stderr, a documented exit code, nothing created."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner, Result

from pspf.cli import cli
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration

Query = Callable[..., list[tuple[Any, ...]]]


def sink(redis_url: str, topic: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["sink", "postgres", topic, "--broker", redis_url, "--until-idle", *args])


def one_line(result: Result) -> str:
    """The command's output, which must be one line and no traceback."""
    assert "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def test_a_dsn_that_is_no_dsn_is_one_line_exit_2(make_topic: Callable[[int], str], redis_url: str) -> None:
    result = sink(redis_url, make_topic(1), "--dsn", "not a dsn", "--table", "t")
    assert result.exit_code == 2, result.output
    assert "--dsn: not a PostgreSQL DSN or URL" in one_line(result)


def test_a_table_in_a_missing_schema_is_one_line_exit_2(
    make_topic: Callable[[int], str], redis_url: str, pg_dsn: str
) -> None:
    result = sink(redis_url, make_topic(1), "--dsn", pg_dsn, "--table", "nosuchschema.t")
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert 'schema "nosuchschema" does not exist' in line and "CREATE SCHEMA" in line


def test_a_database_that_refuses_the_login_is_one_line_exit_3(
    make_topic: Callable[[int], str], redis_url: str, postgres: PostgresServer
) -> None:
    result = sink(redis_url, make_topic(1), "--dsn", postgres.dsn("no_such_database"), "--table", "t")
    assert result.exit_code == 3, result.output
    line = one_line(result)
    assert 'database "no_such_database" does not exist' in line


def test_a_missing_topic_creates_nothing_and_prints_no_banner(
    names: Any, redis_url: str, pg_dsn: str, pg_query: Query
) -> None:
    result = sink(redis_url, names.topic(), "--dsn", pg_dsn, "--table", "never")
    assert result.exit_code == 4, result.output
    assert "does not exist" in one_line(result)
    tables = pg_query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    assert tables == []
