"""Topic schemas against a real server: set and evolve them, the producer refuses, the worker dead-letters."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from click.testing import CliRunner

from pspf import App, Context, Producer, Settings, Worker
from pspf.cli import cli
from pspf.errors import ConfigError, SchemaError
from pspf.keys import stream_key
from pspf.service import IngestEntry, Service
from pspf.source.files import FilesSource
from tests.conftest import Names

pytestmark = pytest.mark.integration


class OrderV1(msgspec.Struct):
    user: str
    amount: int


class OrderV2(msgspec.Struct):
    user: str
    amount: int
    note: str | None = None  # an added optional field


V3_REQUIRED_NOTE: dict[str, Any] = {
    "type": "object",
    "properties": {"user": {"type": "string"}, "amount": {"type": "integer"}, "note": {"type": "string"}},
    "required": ["user", "amount", "note"],
}


def schema_cli(redis_url: str, *args: str) -> Any:
    return CliRunner().invoke(cli, ["topic", "schema", *args, "--broker", redis_url])


def test_a_producer_refuses_a_bad_value_in_one_line_and_writes_nothing_of_it(
    make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis
) -> None:
    topic = make_topic(1)
    set_v1 = schema_cli(redis_url, "set", topic, "--type", f"{__name__}:OrderV1")
    assert set_v1.exit_code == 0 and "schema v1 set (backward)" in set_v1.output, set_v1.output
    settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
    with Producer(settings=settings) as producer:
        producer.send(topic, {"user": "u1", "amount": 3}, key="u1")
        with pytest.raises(SchemaError, match=r"schema v1: Expected `int`, got `str` - at `\$.amount`"):
            producer.send(topic, {"user": "u2", "amount": "three"}, key="u2")
    entries = rclient.xrange(stream_key(topic, 0))
    assert [json.loads(f[b"value"])["user"] for _, f in entries] == ["u1"]
    assert entries[0][1][b"schema"] == b"1"  # the version it was checked against

    produced = CliRunner().invoke(
        cli, ["produce", topic, '{"user": "u3", "amount": "x"}', "--key", "u3", "--broker", redis_url]
    )
    assert produced.exit_code == 2, produced.output
    assert "at `$.amount`" in produced.output and "Traceback" not in produced.output
    assert len(rclient.xrange(stream_key(topic, 0))) == 1


def test_changes_are_checked_for_compatibility_and_old_entries_still_pass(
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
    tmp_path: Path,
) -> None:
    topic = make_topic(1)
    assert schema_cli(redis_url, "set", topic, "--type", f"{__name__}:OrderV1").exit_code == 0
    settings = make_settings()
    with Producer(settings=settings) as producer:
        producer.send(topic, {"user": "u1", "amount": 3}, key="u1")  # written under v1

    v2 = schema_cli(redis_url, "set", topic, "--type", f"{__name__}:OrderV2")
    assert v2.exit_code == 0 and "schema v2 set" in v2.output, v2.output
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(V3_REQUIRED_NOTE))
    refused = schema_cli(redis_url, "set", topic, "--file", str(path))
    assert refused.exit_code == 2, refused.output
    assert "not backward compatible with v2" in refused.output and "note" in refused.output
    assert "Traceback" not in refused.output
    history = json.loads(schema_cli(redis_url, "history", topic, "--json").output)
    assert [v["version"] for v in history] == [1, 2]
    shown = json.loads(schema_cli(redis_url, "show", topic, "--version", "1", "--json").output)
    assert shown["schema"] == msgspec.json.schema(OrderV1)

    with Producer(settings=settings) as producer:  # reads v2 now
        producer.send(topic, {"user": "u2", "amount": 4, "note": "gift"}, key="u2")
    seen: list[Any] = []
    app = App(names.app())

    @app.handler(topic)
    def keep(order: OrderV2, ctx: Context) -> None:
        seen.append((order.user, order.note))

    summary = Worker(app, settings).run(until_idle=True)
    assert summary.handled == 2 and summary.dead_lettered == 0
    assert sorted(seen) == [("u1", None), ("u2", "gift")]


def test_a_raw_xadd_of_a_bad_value_goes_to_the_dlq_as_a_schema_error(
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    topic = make_topic(1)
    assert schema_cli(redis_url, "set", topic, "--type", f"{__name__}:OrderV1").exit_code == 0
    stream = stream_key(topic, 0)
    rclient.xadd(stream, {"key": "u1", "value": '{"user": "u1", "amount": 2}'})
    rclient.xadd(stream, {"key": "u2", "value": '{"user": "u2", "amount": "two"}'})  # bypasses the checks
    rclient.xadd(stream, {"key": "u3", "user": "u3", "amount": "5"})  # a flat record: converted, passes
    rclient.xadd(stream, {"key": "u4", "value": '{"user": "u4", "amount": 1}', "schema": "9"})
    totals: dict[str, int] = {}
    app = App(names.app())

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        totals[ctx.key] = totals.get(ctx.key, 0) + int(order["amount"])

    settings = make_settings()
    summary = Worker(app, settings).run(until_idle=True)
    assert totals == {"u1": 2, "u3": 5}
    assert summary.dead_lettered == 2
    service = Service(settings)
    dead = {d.key: d for d in service.dlq.dlq_list(topic)}
    service.close()
    assert dead["u2"].error_type == "SchemaError"
    assert "schema v1: Expected `int`, got `str` - at `$.amount`" in dead["u2"].message
    assert dead["u4"].error_type == "SchemaError" and "has no schema v9" in dead["u4"].message


def test_a_schema_outside_the_subset_or_for_no_topic_is_refused(
    make_topic: Callable[[int], str], redis_url: str, tmp_path: Path
) -> None:
    topic = make_topic(1)
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "oneOf": []}))
    bad = schema_cli(redis_url, "set", topic, "--file", str(path))
    assert bad.exit_code == 2 and "'oneOf' is not supported" in bad.output
    missing = schema_cli(redis_url, "set", "no-such-topic", "--file", str(path))
    assert missing.exit_code == 4, missing.output
    neither = schema_cli(redis_url, "set", topic)
    assert neither.exit_code == 2 and "--type MODULE:TYPE or --file" in neither.output
    none_yet = schema_cli(redis_url, "show", topic)
    assert none_yet.exit_code == 4 and "has no schema" in none_yet.output
    service = Service(Settings.load({"PSPF_BROKER": redis_url}, environ={}))
    with pytest.raises(ConfigError, match="--compat must be one of"):
        service.schemas.set_schema(topic, {}, "sideways")
    service.close()


def test_the_files_source_and_the_http_ingest_refuse_a_bad_row_and_add_nothing_of_its_call(
    make_topic: Callable[[int], str], redis_url: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    topic = make_topic(2)
    assert schema_cli(redis_url, "set", topic, "--type", f"{__name__}:OrderV1").exit_code == 0
    settings = Settings.load({"PSPF_BROKER": redis_url}, environ={})
    service = Service(settings)
    bad = [IngestEntry(key="u1", value={"user": "u1", "amount": 1}), IngestEntry(key="u2", value={"user": 2})]
    with pytest.raises(SchemaError, match=r"row 2: topic '.*' schema v1: .*at `\$.user`"):
        service.ingest.ingest(topic, bad, "req-1")
    good = service.ingest.ingest(topic, bad[:1], "req-2")
    assert good.added == 1
    service.close()

    folder = tmp_path / "in"
    folder.mkdir()
    lines = [{"user": "u3", "amount": 3}, {"user": "u4", "amount": "four"}]
    (folder / "a.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SchemaError, match=r"row 2: .*Expected `int`, got `str` - at `\$.amount`"):
        FilesSource(str(folder), topic, "jsonl", key_field="user").run(settings)
    stored = [f for p in (0, 1) for _, f in rclient.xrange(stream_key(topic, p))]
    assert [json.loads(f[b"value"])["user"] for f in stored] == ["u1"]
    assert stored[0][b"schema"] == b"1"


def test_an_emit_that_does_not_match_its_targets_schema_fails_its_entry_to_the_dlq(
    make_topic: Callable[[int], str],
    redis_url: str,
    rclient: redis.Redis,
    make_settings: Callable[..., Settings],
    names: Names,
) -> None:
    source, target = make_topic(1), make_topic(1)
    assert schema_cli(redis_url, "set", target, "--type", f"{__name__}:OrderV1").exit_code == 0
    app = App(names.app())

    @app.handler(source)
    def forward(order: dict[str, Any], ctx: Context) -> None:
        ctx.emit(target, {"user": ctx.key, "amount": order["amount"]}, key=ctx.key)

    settings = make_settings()
    with Producer(settings=settings) as producer:
        producer.send(source, {"amount": 5}, key="u1")
        producer.send(source, {"amount": "five"}, key="u2")
    summary = Worker(app, settings).run(until_idle=True)
    assert summary.dead_lettered == 1
    emitted = [json.loads(f[b"value"]) for _, f in rclient.xrange(stream_key(target, 0))]
    assert emitted == [{"user": "u1", "amount": 5}]
    service = Service(settings)
    (dead,) = service.dlq.dlq_list(source)
    service.close()
    assert dead.key == "u2" and dead.error_type == "SchemaError" and "at `$.amount`" in dead.message


class TotalsV1(msgspec.Struct):
    total: int


class TotalsV2(msgspec.Struct):
    total_cents: int
    orders: int = 0


def totals_app(name: str, topic: str, migrate: bool) -> App:
    app = App(name, state_type=TotalsV2)
    if migrate:

        @app.migrate_state(TotalsV1)
        def to_cents(old: dict[str, Any]) -> dict[str, Any]:
            return {field: TotalsV2(total_cents=value.total * 100) for field, value in old.items()}

    @app.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        now = ctx.state.get("t", TotalsV2(total_cents=0))
        ctx.state["t"] = TotalsV2(total_cents=now.total_cents + order["amount"] * 100, orders=now.orders + 1)

    return app


def test_a_new_state_type_is_refused_without_a_migration_and_each_key_is_migrated_once_with_one(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    produce: Callable[..., int],
    names: Names,
    tmp_path: Path,
) -> None:
    topic, name = make_topic(2), names.app()
    settings = make_settings(PSPF_STATE_DIR=str(tmp_path / "state"))
    v1 = App(name, state_type=TotalsV1)

    @v1.handler(topic)
    def add(order: dict[str, Any], ctx: Context) -> None:
        ctx.state["t"] = TotalsV1(total=ctx.state.get("t", TotalsV1(0)).total + order["amount"])

    produce(topic, [(f"k{i % 10}", {"amount": 1}) for i in range(100)])
    Worker(v1, settings).run(until_idle=True)
    with pytest.raises(
        ConfigError, match=r"cannot read the state its stores hold .*total_cents.*migrate_state"
    ):
        Worker(totals_app(name, topic, migrate=False), settings).run(until_idle=True)

    produce(topic, [(f"k{i % 10}", {"amount": 2}) for i in range(50)])
    summary = Worker(totals_app(name, topic, migrate=True), settings).run(until_idle=True)
    assert summary.handled == 50
    service = Service(settings)
    state = {k: service.state_get(name, k) for k in [f"k{i}" for i in range(10)]}
    service.close()
    # 10 entries of 1 before (migrated once: x100), then 5 entries of 2 after
    assert all(s == {"t": {"total_cents": 10 * 100 + 5 * 200, "orders": 5}} for s in state.values()), state


class NeedsNote(msgspec.Struct):
    user: str
    note: str


def test_typed_handlers_check_or_declare_their_topics_schemas_at_start(
    make_topic: Callable[[int], str], make_settings: Callable[..., Settings], names: Names, redis_url: str
) -> None:
    declared, checked = make_topic(1), make_topic(1)
    settings = make_settings()
    app = App(names.app(), schemas="declare")

    @app.handler(declared)
    def keep(order: OrderV1, ctx: Context) -> None:
        pass

    Worker(app, settings).run(until_idle=True)
    shown = json.loads(schema_cli(redis_url, "show", declared, "--json").output)
    assert shown["version"] == 1 and shown["schema"] == msgspec.json.schema(OrderV1)

    assert schema_cli(redis_url, "set", checked, "--type", f"{__name__}:OrderV1").exit_code == 0
    strict = App(names.app())  # schemas="check", the default

    @strict.handler(checked)
    def read(order: NeedsNote, ctx: Context) -> None:
        pass

    with pytest.raises(
        ConfigError, match=r"cannot read the topic's schema v1: \$.note: the reader requires it"
    ):
        Worker(strict, settings).run(until_idle=True)
    off = App(names.app(), schemas="off")
    off.handler(checked)(read)
    assert Worker(off, settings).run(until_idle=True).handled == 0


def test_value_types_msgspec_cannot_describe_are_left_unchecked_and_the_worker_starts(
    make_topic: Callable[[int], str],
    make_settings: Callable[..., Settings],
    produce: Callable[..., int],
    names: Names,
    redis_url: str,
) -> None:
    topic = make_topic(1)
    app = App(names.app(), schemas="declare")

    @app.handler(topic)
    def keep(value: object, ctx: Context) -> None:  # msgspec decodes it, but has no schema for it
        ctx.state["n"] = ctx.state.get("n", 0) + 1

    produce(topic, [("k", {"a": 1})])
    assert Worker(app, make_settings()).run(until_idle=True).handled == 1
    assert schema_cli(redis_url, "show", topic).exit_code == 4  # nothing declared
