"""The PostgreSQL sink against a real PostgreSQL and a real Redis/Valkey: each entry's row once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner

from pspf import Settings
from pspf.cli import cli
from pspf.errors import ConfigError
from pspf.keys import dlq_key, partition_for, stream_key
from pspf.sink_postgres import PostgresSink, mask_dsn
from pspf.worker import RunSummary
from tests.support import wait_until
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration

Query = Callable[..., list[tuple[Any, ...]]]


def add(
    rclient: redis.Redis, topic: str, partitions: int, key: str | None, value: Any, **headers: str
) -> str:
    """One entry in PSPF's wire format; its id."""
    fields: dict[bytes, bytes] = {b"value": msgspec.json.encode(value)}
    if key is not None:
        fields[b"key"] = key.encode()
    if headers:
        fields[b"headers"] = msgspec.json.encode(headers)
    partition = 0 if key is None else partition_for(key.encode(), partitions)
    return bytes(rclient.xadd(stream_key(topic, partition), fields)).decode()  # type: ignore[arg-type]


def test_rows_mode_writes_every_entry_once_with_its_key_value_and_headers(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    topic = make_topic(4)
    sent: dict[tuple[int, str], tuple[str | None, int]] = {}
    for n in range(300):
        key = None if n % 10 == 0 else f"k{n % 17}"
        entry_id = add(rclient, topic, 4, key, {"n": n, "text": "é"}, trace=f"t{n}")
        sent[(0 if key is None else partition_for(key.encode(), 4), entry_id)] = (key, n)
    sink = PostgresSink(pg_dsn, "orders_rows")
    summary = sink.run(topic, make_settings(), until_idle=True)
    assert summary.handled == 300
    rows = pg_query("SELECT partition, entry_id, key, value, headers FROM orders_rows")
    assert len(rows) == 300
    for partition, entry_id, key, value, headers in rows:
        assert sent.pop((partition, entry_id)) == (key, value["n"])
        assert value["text"] == "é" and headers == {"trace": f"t{value['n']}"}
    # The checkpoints are in the database; a second run finds nothing to do.
    assert sink.run(topic, make_settings(), until_idle=True).handled == 0
    assert pg_query("SELECT count(*) FROM orders_rows") == [(300,)]
    checkpoints = pg_query("SELECT partition FROM pspf_sink_checkpoints WHERE sink = %s", sink.name)
    assert sorted(p for (p,) in checkpoints) == [0, 1, 2, 3]


def test_upsert_mode_keeps_each_keys_latest_value_and_an_older_entry_never_overwrites_it(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    topic = make_topic(2)
    latest: dict[str, tuple[str, int]] = {}
    for n in range(200):
        key = f"u{n % 7}"
        latest[key] = (add(rclient, topic, 2, key, {"n": n}), n)
    add(rclient, topic, 2, None, {"n": -1})  # no key: refused by an upsert sink, to the DLQ
    first = PostgresSink(pg_dsn, "latest", mode="upsert")
    summary = first.run(topic, make_settings(), until_idle=True)
    assert summary.handled == 200 and summary.dead_lettered == 1
    expected = {key: (entry_id, {"n": n}) for key, (entry_id, n) in latest.items()}

    def table() -> dict[str, tuple[str, Any]]:
        return {k: (e, v) for k, e, v in pg_query("SELECT key, entry_id, value FROM latest")}

    assert table() == expected
    dead = rclient.xrange(dlq_key(topic, 0))
    assert len(dead) == 1 and b"no key" in dead[0][1][b"message"]
    assert dead[0][1][b"error_type"] == b"SinkRefused"
    # Another sink writing the same table from the start, older entries first, changes nothing.
    PostgresSink(pg_dsn, "latest", mode="upsert", name="second").run(topic, make_settings(), until_idle=True)
    assert table() == expected


def test_a_row_postgres_refuses_goes_to_the_dlq_with_its_error_and_the_others_are_written(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    topic = make_topic(1)
    pg_query(
        "CREATE TABLE checked (partition integer, entry_id text, key text, value jsonb, headers jsonb,"
        " PRIMARY KEY (partition, entry_id), CHECK ((value->>'n')::int <> 13))"
    )
    for n in range(30):
        add(rclient, topic, 1, f"k{n}", {"n": n})
    add(rclient, topic, 1, "nul", {"n": 99, "text": "a\u0000b"})  # jsonb cannot hold \u0000
    summary = PostgresSink(pg_dsn, "checked").run(topic, make_settings(PSPF_BLOCK_MS=100), until_idle=True)
    assert summary.dead_lettered == 2
    written = sorted(v["n"] for (v,) in pg_query("SELECT value FROM checked"))
    assert written == [n for n in range(30) if n != 13]
    dead = [dict(fields) for _, fields in rclient.xrange(dlq_key(topic, 0))]
    assert sorted(d[b"key"] for d in dead) == [b"k13", b"nul"]
    messages = {d[b"key"]: d[b"message"].decode() for d in dead}
    assert "violates check constraint" in messages[b"k13"]
    assert messages[b"nul"].startswith("PostgreSQL refused the row")


def test_a_table_with_other_columns_is_refused_with_one_line(
    make_topic: Callable[[int], str], redis_url: str, pg_dsn: str, pg_query: Query
) -> None:
    topic = make_topic(1)
    pg_query("CREATE TABLE wrong (id serial PRIMARY KEY, payload text)")
    with pytest.raises(ConfigError, match="exists with other columns"):
        PostgresSink(pg_dsn, "wrong").prepare()
    result = CliRunner().invoke(
        cli,
        [
            "sink",
            "postgres",
            topic,
            "--dsn",
            pg_dsn,
            "--table",
            "wrong",
            "--broker",
            redis_url,
            "--until-idle",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "exists with other columns" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    pg_query("CREATE TABLE no_key (partition integer, entry_id text, key text, value jsonb, headers jsonb)")
    with pytest.raises(ConfigError, match="no unique key"):
        PostgresSink(pg_dsn, "no_key").prepare()


def test_the_cli_delivers_a_topic_and_shows_in_lag(
    make_topic: Callable[[int], str], rclient: redis.Redis, redis_url: str, pg_dsn: str, pg_query: Query
) -> None:
    topic = make_topic(2)
    for n in range(50):
        add(rclient, topic, 2, f"k{n % 5}", {"n": n})
    runner = CliRunner()
    args = ["sink", "postgres", topic, "--dsn", pg_dsn, "--table", "public.cli_rows", "--broker", redis_url]
    result = runner.invoke(cli, [*args, "--until-idle"])
    assert result.exit_code == 0, result.output
    assert "processed 50 entries" in result.output
    assert pg_query("SELECT count(*) FROM cli_rows") == [(50,)]
    lag = runner.invoke(cli, ["lag", "sink-postgres-public.cli_rows", "--broker", redis_url, "--json"])
    assert lag.exit_code == 0, lag.output
    found = json.loads(lag.output)
    assert found["lag"] == 0 and len(found["detail"]) == 2


def test_a_postgres_restart_mid_run_loses_and_doubles_nothing(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    postgres: PostgresServer,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    topic = make_topic(2)
    sink = PostgresSink(pg_dsn, "restarted")
    worker = sink.worker(topic, make_settings(PSPF_BLOCK_MS=100, PSPF_BATCH_SIZE=20))
    result: list[RunSummary] = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
    thread.start()
    try:
        produced = 0
        for round_ in range(3):
            for _ in range(200):
                add(rclient, topic, 2, f"k{produced % 9}", {"n": produced})
                produced += 1
            if round_ == 0:
                wait_until(lambda: pg_query("SELECT count(*) FROM restarted")[0][0] > 0, 20, "the first rows")
                postgres.stop("fast")  # mid-run: the sink loses its connections
                time.sleep(1.5)
                postgres.start()
        wait_until(lambda: pg_query("SELECT count(*) FROM restarted") == [(produced,)], 60, "every row")
    finally:
        worker.stop()
        thread.join(30)
    values = sorted(v["n"] for (v,) in pg_query("SELECT value FROM restarted"))
    assert values == list(range(produced))
    assert result and result[0].dead_lettered == 0


def test_sinks_started_together_create_their_tables_once(pg_dsn: str, pg_query: Query) -> None:
    """CREATE TABLE IF NOT EXISTS alone races: two sinks starting at once both tried to create."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def prepare(table: str) -> None:
        barrier.wait()
        try:
            PostgresSink(pg_dsn, table).prepare()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=prepare, args=(f"together_{n % 2}",)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    tables = {name for (name,) in pg_query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"together_0", "together_1", "pspf_sink_owners", "pspf_sink_state"} <= tables


def test_dsn_passwords_are_masked() -> None:
    assert mask_dsn("host=db password=s3cret user=app") == "host=db password=*** user=app"
    assert "s3cret" not in mask_dsn("postgresql://app:s3cret@db/shop")


def test_bad_table_names_and_modes_are_refused() -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        PostgresSink("postgresql://nobody@127.0.0.1:1/none", "a.b.c")
    with pytest.raises(ConfigError, match="unknown sink mode"):
        PostgresSink("postgresql://nobody@127.0.0.1:1/none", "t", mode="merge")  # type: ignore[arg-type]
