"""A sink's table that is not the one its checkpoints describe: refused, and ``pspf sink reset``.

Against a real PostgreSQL and a real Redis/Valkey. A DROP or a TRUNCATE of the table under a sink
(running or stopped) would otherwise leave the checkpoints skipping every entry delivered before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import Settings, keys
from pspf.cli import cli
from pspf.errors import SinkTargetChanged
from pspf.sink_postgres import Mode, PostgresSink
from tests.sinks.test_postgres_sink import add
from tests.support import wait_until
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.integration

Query = Callable[..., list[tuple[Any, ...]]]

MODES = ["rows", "upsert"]
CHANGES = {"drop": "DROP TABLE ev", "truncate": "TRUNCATE ev"}


def produce(rclient: redis.Redis, topic: str, start: int, count: int) -> None:
    for n in range(start, start + count):
        add(rclient, topic, 2, f"k{n % 40}", {"n": n})


def expected(mode: str, produced: int) -> list[int]:
    """The values of ``n`` the table holds once every entry is delivered."""
    if mode == "rows":
        return list(range(produced))
    return sorted(max(n for n in range(produced) if n % 40 == key) for key in range(40))


def delivered(pg_query: Query) -> list[int]:
    return sorted(v["n"] for (v,) in pg_query("SELECT value FROM ev"))


def run_sink(redis_url: str, topic: str, dsn: str, mode: str) -> Result:
    args = ["sink", "postgres", topic, "--dsn", dsn, "--table", "ev", "--mode", mode, "--name", "ev-sink"]
    return CliRunner().invoke(cli, [*args, "--broker", redis_url, "--block-ms", "100", "--until-idle"])


def one_line(result: Result) -> str:
    assert "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("mode", MODES)
def test_a_stopped_sinks_dropped_or_truncated_table_is_refused_and_reset_delivers_again(
    mode: str,
    change: str,
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    redis_url: str,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    topic = make_topic(2)
    produce(rclient, topic, 0, 300)
    assert run_sink(redis_url, topic, pg_dsn, mode).exit_code == 0
    assert delivered(pg_query) == expected(mode, 300)
    pg_query(CHANGES[change])
    produce(rclient, topic, 300, 100)
    refused = run_sink(redis_url, topic, pg_dsn, mode)
    assert refused.exit_code == 5, refused.output
    line = one_line(refused)
    assert "pspf sink reset ev-sink" in line and "--name" in line
    found = pg_query("SELECT count(*) FROM pg_tables WHERE tablename = 'ev'")
    assert found == [(0 if change == "drop" else 1,)]  # nothing created, nothing written
    if change == "truncate":
        assert delivered(pg_query) == []
    reset = CliRunner().invoke(
        cli, ["sink", "reset", "ev-sink", "--dsn", pg_dsn, "--broker", redis_url, "--yes"]
    )
    assert reset.exit_code == 0, reset.output
    again = run_sink(redis_url, topic, pg_dsn, mode)
    assert again.exit_code == 0, again.output
    assert delivered(pg_query) == expected(mode, 400)


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("mode", MODES)
def test_running_sinks_stop_at_a_dropped_or_truncated_table(
    mode: Mode,
    change: str,
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    """Two workers of one sink: each stops with one line at its next commit, writing nothing."""
    topic = make_topic(2)
    settings = make_settings(PSPF_BLOCK_MS=100, PSPF_BATCH_SIZE=20)
    workers = [PostgresSink(pg_dsn, "ev", mode=mode).worker(topic, settings) for _ in range(2)]
    errors: list[BaseException] = []

    def run(worker: Any) -> None:
        try:
            worker.run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    try:
        produce(rclient, topic, 0, 300)
        wait_until(lambda: delivered(pg_query) == expected(mode, 300), 30, "the first rows")
        leases = [keys.lease_key(topic, p, "sink-postgres-ev") for p in range(2)]
        wait_until(
            lambda: len({(rclient.get(k) or b"").rpartition(b"|")[0] for k in leases} - {b""}) == 2,
            30,
            "a partition each",
        )
        pg_query(CHANGES[change])
        produce(rclient, topic, 300, 100)
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        for worker in workers:
            worker.stop()
    assert len(errors) == 2 and all(isinstance(e, SinkTargetChanged) for e in errors), errors
    assert all("pspf sink reset" in str(e) and "\n" not in str(e) for e in errors)
    if change == "truncate":
        assert delivered(pg_query) == []  # the entries after the TRUNCATE wrote nothing either


def test_a_sink_started_while_the_database_is_down_waits_for_it(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    rclient: redis.Redis,
    postgres: PostgresServer,
    pg_dsn: str,
    pg_query: Query,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = make_topic(2)
    produce(rclient, topic, 0, 100)
    postgres.stop("fast")
    result: list[Any] = []
    try:
        sink = PostgresSink(pg_dsn, "ev")
        worker = sink.worker(topic, make_settings(PSPF_BLOCK_MS=100))
        thread = threading.Thread(target=lambda: result.append(_run(worker)), daemon=True)
        thread.start()
        time.sleep(2)
        assert thread.is_alive(), result  # waiting, not exited
    finally:
        postgres.start()
    try:
        wait_until(
            lambda: pg_query("SELECT count(*) FROM pg_tables WHERE tablename = 'ev'") == [(1,)], 60, "ev"
        )
        wait_until(lambda: delivered(pg_query) == list(range(100)), 60, "every row")
    finally:
        worker.stop()
        thread.join(30)
    assert result and not isinstance(result[0], BaseException), result
    waits = [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]
    assert len(waits) == 1, waits


def _run(worker: Any) -> Any:
    try:
        return worker.run()
    except BaseException as exc:
        return exc


def test_the_table_is_known_by_its_identity_not_its_spelling(pg_dsn: str, pg_query: Query) -> None:
    PostgresSink(pg_dsn, "ev", name="named").prepare()
    PostgresSink(pg_dsn, "public.ev", name="named").prepare()  # the same table
    with pytest.raises(SinkTargetChanged, match="its checkpoints are of table ev"):
        PostgresSink(pg_dsn, "other", name="named").prepare()
    assert pg_query("SELECT count(*) FROM pg_tables WHERE tablename = 'other'") == [(0,)]


def test_a_rewritten_table_is_refused_and_keep_checkpoints_accepts_it(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    redis_url: str,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    """VACUUM FULL keeps the rows but changes the relfilenode, as TRUNCATE does: the operator says."""
    topic = make_topic(2)
    produce(rclient, topic, 0, 100)
    assert run_sink(redis_url, topic, pg_dsn, "rows").exit_code == 0
    pg_query("VACUUM FULL ev")
    refused = run_sink(redis_url, topic, pg_dsn, "rows")
    assert refused.exit_code == 5 and "VACUUM FULL" in one_line(refused)
    args = ["sink", "reset", "ev-sink", "--dsn", pg_dsn, "--broker", redis_url, "--keep-checkpoints"]
    accepted = CliRunner().invoke(cli, args)
    assert accepted.exit_code == 0, accepted.output
    produce(rclient, topic, 100, 50)
    again = run_sink(redis_url, topic, pg_dsn, "rows")
    assert again.exit_code == 0, again.output
    assert "processed 50 entries" in again.output  # the checkpoints were kept
    assert delivered(pg_query) == list(range(150))


def repartition(redis_url: str, topic: str, partitions: int) -> Result:
    args = ["topic", "repartition", topic, "--partitions", str(partitions), "--yes", "--broker", redis_url]
    return CliRunner().invoke(cli, args)


def test_a_topic_a_sink_delivers_is_refused_by_repartition_with_the_steps_that_work(
    make_topic: Callable[[int], str],
    rclient: redis.Redis,
    redis_url: str,
    pg_dsn: str,
    pg_query: Query,
) -> None:
    """The refusal's steps, followed: every entry once in the table, before and after the switch."""
    topic = make_topic(2)
    produce(rclient, topic, 0, 300)
    assert run_sink(redis_url, topic, pg_dsn, "rows").exit_code == 0
    refused = repartition(redis_url, topic, 3)
    assert refused.exit_code == 5, refused.output
    line = one_line(refused)
    assert "sink" in line and "state backup on" not in line
    for step in ("pspf app delete ev-sink", "pspf sink reset ev-sink", "--start-from latest"):
        assert step in line, line
    # The steps: the sink delivered everything and stopped (above), the producers wait.
    assert (
        CliRunner().invoke(cli, ["app", "delete", "ev-sink", "--yes", "--broker", redis_url]).exit_code == 0
    )
    moved = repartition(redis_url, topic, 3)
    assert moved.exit_code == 0, moved.output
    reset = ["sink", "reset", "ev-sink", "--dsn", pg_dsn, "--broker", redis_url, "--yes"]
    assert CliRunner().invoke(cli, reset).exit_code == 0
    started = CliRunner().invoke(
        cli,
        [
            "sink", "postgres", topic, "--dsn", pg_dsn, "--table", "ev", "--name", "ev-sink",
            "--broker", redis_url, "--start-from", "latest", "--until-idle",
        ],
    )  # fmt: skip
    assert started.exit_code == 0 and "processed 0 entries" in started.output, started.output
    for n in range(300, 400):
        add(rclient, topic, 3, f"k{n % 40}", {"n": n})
    again = run_sink(redis_url, topic, pg_dsn, "rows")
    assert again.exit_code == 0, again.output
    assert delivered(pg_query) == list(range(400))  # each once
    partitions = {p for (p,) in pg_query("SELECT DISTINCT partition FROM ev WHERE (value->>'n')::int >= 300")}
    assert partitions <= {0, 1, 2} and 2 in partitions
