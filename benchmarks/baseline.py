"""What the throughput benchmarks share: the orders, the servers, the order-totals app and the plain loops.

The plain loops are the baselines of the ratios the benchmarks print:

- the strong loop (``run_strong``), the strongest plain redis-py consumer we can write for the
  work: hiredis and RESP2 with the reply left raw, each entry's key and value taken from its flat
  field list (by position when the entry has just those two fields, the common shape), a msgspec
  Struct decoder, state in a dict, and each batch's XACK pipelined with the next XREADGROUP (one
  round trip per batch). It commits nothing: a loop that may lose or repeat work;
- the plain loop (``run_plain``) the older benchmarks compare with: fields paired into a dict per
  entry, a decode into a dict, and an XACK that waits for its reply before the next read.

``cpu_seconds`` and ``server_cpu_seconds`` give the CPU a process and a server used, so a report
can say where the time went besides the ratio (``Costs`` in a worker child, ``cpu_per_million``
in its report).
"""

from __future__ import annotations

import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hiredis
import msgspec
import redis

from pspf import App, Context, Producer, Settings
from pspf.broker import Broker
from pspf.embedded import LocalRedis
from pspf.service import Service

PRELOAD_CHUNK = 5_000
#: Debian's Redis, benchmarked beside the embedded Valkey when it is installed.
DEBIAN_REDIS = "/usr/bin/redis-server"


@contextmanager
def own_redis_server(binary: str | None = None) -> Iterator[tuple[str, str]]:
    """A throw-away server without persistence (``binary``, else the embedded order's first).

    Yields (url, description).
    """
    with (
        tempfile.TemporaryDirectory(prefix="pspf-bench-redis-") as folder,
        LocalRedis(Path(folder), binary=binary) as server,
    ):
        yield server.url, f"own {server.release} server ({server.binary})"


class Order(msgspec.Struct):
    """An entry's value as the strong loop and the PSPF handler decode it."""

    user: str
    amount: int
    note: str = ""


def make_orders(entries: int, keys: int, seed: int = 17) -> list[tuple[str, bytes]]:
    """(key, JSON value) pairs of about 100 bytes, e.g. {"user":"u17","amount":42,"note":"..."}."""
    rng = random.Random(seed)
    encoder = msgspec.json.Encoder()
    out = []
    for i in range(entries):
        user = f"u{rng.randrange(keys)}"
        order = {"user": user, "amount": rng.randrange(1, 1000), "note": ""}
        room = 100 - len(encoder.encode(order))
        order["note"] = f"order {i} of the benchmark ".ljust(room, ".")[: max(room, 0)]
        out.append((user, encoder.encode(order)))
    return out


def expected_totals(orders: list[tuple[str, bytes]]) -> tuple[int, int, int]:
    """(keys, sum of amounts, number of entries) the state must add up to."""
    decode = msgspec.json.Decoder().decode
    users = set()
    total = 0
    for user, value in orders:
        users.add(user)
        total += decode(value)["amount"]
    return len(users), total, len(orders)


def forget_run(url: str, tag: str) -> None:
    """Delete every key whose name holds ``tag`` (a run's topics, streams and apps' records).

    So every run starts on the same server: one that kept each run's keys grows with every run
    (``emit.py`` adds 600,000 entries a run), and its appends get dearer (the wheel's Valkey
    allocates with the C library's malloc), which counts against whichever app writes more.
    """
    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=f"*{tag}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


def preload(url: str, topic: str, plain_stream: str | None, orders: list[tuple[str, bytes]]) -> None:
    """The entries into partition 0 of a new one-partition topic, and the same into a plain stream."""
    settings = Settings.load({"PSPF_BROKER": url}, environ={})
    service = Service(settings)
    try:
        service.create_topic(topic, 1)
        with Producer(service.broker, batch_size=PRELOAD_CHUNK) as producer:
            for user, value in orders:
                producer.send_raw(topic, value, key=user)
        broker: Broker = service.broker
        if plain_stream is None:
            return
        for start in range(0, len(orders), PRELOAD_CHUNK):
            chunk = orders[start : start + PRELOAD_CHUNK]
            broker.publishing.add_entries(
                [(plain_stream, {b"key": u.encode(), b"value": v}) for u, v in chunk]
            )
    finally:
        service.close()


def order_totals_app(name: str, topic: str, typed: bool = False) -> App:
    """Each key's total amount and count; ``typed`` decodes values into ``Order``, else a dict."""
    app = App(name)
    if typed:

        @app.handler(topic)
        def add_typed(order: Order, ctx: Context) -> None:
            state = ctx.state
            state["total"] = state.get("total", 0) + order.amount
            state["count"] = state.get("count", 0) + 1

        return app

    @app.handler(topic)
    def add(order: dict, ctx: Context) -> None:  # type: ignore[type-arg] # the decoder as measured
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["count"] = ctx.state.get("count", 0) + 1

    return app


def cpu_seconds() -> float:
    """CPU seconds (user + system) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu_seconds(url: str) -> float:
    """CPU seconds (user + system, main thread and the rest) the server at ``url`` has used."""
    client = redis.Redis.from_url(url)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class Costs:
    """The CPU seconds a worker child and the server use from its creation to ``spent``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.server, self.cpu = server_cpu_seconds(url), cpu_seconds()

    def spent(self) -> dict[str, float]:
        """{"cpu": this process's CPU seconds, "server_cpu": the server's}, as the children report."""
        return {"cpu": cpu_seconds() - self.cpu, "server_cpu": server_cpu_seconds(self.url) - self.server}


def cpu_per_million(results: Sequence[Mapping[str, Any]], entries: int) -> str:
    """The medians of the children's ``Costs`` per million entries: "worker X s, server Y s"."""
    worker = statistics.median(r["cpu"] for r in results) * 1e6 / entries
    server = statistics.median(r["server_cpu"] for r in results) * 1e6 / entries
    return f"worker {worker:.2f} s, server {server:.2f} s"


def max_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB.

    On Linux this is ``VmHWM`` of /proc/self/status, the high-water mark of this process's own
    memory. ``ru_maxrss`` (of the child itself, or ``RUSAGE_CHILDREN`` in the parent) is NOT
    used there: subprocess starts the child with vfork + exec, and Linux folds the parent's peak
    RSS at that moment into the child's ``ru_maxrss``, so it would report the benchmark parent
    (which holds all the generated entries) rather than the worker.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def run_strong(
    url: str, stream: str, group: str, batch_size: int, emit_to: str | None = None
) -> dict[str, Any]:
    """The strongest plain consumer loop we can write for the same work: the ratio's baseline.

    One connection used directly (no pool, no pipeline object), hiredis and RESP2 with the reply
    left raw, the key and value of the common entry (``key``, ``value``) taken by position and any
    other shape scanned, a msgspec Struct decoder, state in a dict, and the XACK of one batch sent
    with the XREADGROUP of the next (one round trip per batch). No durability: this is what a loop
    that may lose or repeat work costs.

    ``emit_to``: a stream each entry also emits ``{"user", "total"}`` to, with its key and a
    headers field naming its source, as ``ctx.emit`` publishes it: ONE script call per batch
    appends the batch's outputs, sent in the same write as the XACK and after the next read, so
    the server appends while the loop handles the next batch. Nothing makes them exactly once:
    what emitting costs a loop that does nothing else.
    """
    client = redis.Redis.from_url(url, protocol=2)
    client.xgroup_create(stream, group, id="0")
    decode = msgspec.json.Decoder(Order).decode
    encode = msgspec.json.Encoder().encode
    read = ("XREADGROUP", "GROUP", group, "plain", "COUNT", batch_size, "STREAMS", stream, ">")
    append = None if emit_to is None else client.script_load(_APPEND_LUA)
    head = b'{"source-stream":"' + stream.encode() + b'","source-id":"'
    outputs: list[bytes] = []
    appending = False
    connection = client.connection_pool.get_connection()
    state: dict[bytes, list[int]] = {}
    handled = 0
    start = time.perf_counter()
    connection.send_command(*read)
    reply = connection.read_response()
    while reply:
        entries = reply[0][1]
        ids = []
        for entry_id, flat in entries:
            if len(flat) == 4 and flat[0] == b"key" and flat[2] == b"value":
                key, value = flat[1], flat[3]
            else:
                key = value = b""
                for i in range(0, len(flat), 2):
                    if flat[i] == b"value":
                        value = flat[i + 1]
                    elif flat[i] == b"key":
                        key = flat[i + 1]
            order = decode(value)
            st = state.get(key)
            if st is None:
                st = state[key] = [0, 0]
            st[0] += order.amount
            st[1] += 1
            ids.append(entry_id)
            if append is not None:
                outputs += (key, encode({"user": key.decode(), "total": st[0]}), entry_id)
        handled += len(entries)
        if appending:  # the last batch's outputs, appended while this batch was handled
            connection.read_response()
        commands: list[tuple[Any, ...]] = [("XACK", stream, group, *ids), read]
        appending = bool(outputs)
        if appending:  # after the read: the server appends while this loop handles the next batch
            commands.append(("EVALSHA", append, 1, emit_to, head, *outputs))
            outputs = []
        connection.send_packed_command([b"".join(hiredis.pack_command(c) for c in commands)])
        connection.read_response()
        reply = connection.read_response()
    if appending:
        connection.read_response()
    client.connection_pool.release(connection)
    totals = [(s[0], s[1]) for s in state.values()]
    return _loop_result(client, stream, group, time.perf_counter() - start, handled, totals)


#: The strong loop's emitting script: the batch's outputs (key, value, source id) appended.
_APPEND_LUA = """
local head = ARGV[1]
for i = 2, #ARGV, 3 do
  local headers = head .. ARGV[i + 2] .. '"}'
  redis.call('XADD', KEYS[1], '*', 'key', ARGV[i], 'value', ARGV[i + 1], 'headers', headers)
end
return (#ARGV - 1) / 3
"""


def run_plain(url: str, stream: str, group: str, batch_size: int, raw: bool = True) -> dict[str, Any]:
    """A simpler loop: XREADGROUP a batch, decode each value to a dict, XACK the batch; until empty.

    The raw reply's fields are paired into a dict per entry, and the XACK waits for its reply
    before the next read. The other benchmarks compare with this loop, which keeps their ratios
    comparable with earlier figures; ``raw=False`` lets ``client.xreadgroup()`` parse the reply.
    """
    client = redis.Redis.from_url(url, protocol=2)
    if raw:
        client.response_callbacks.pop("XREADGROUP", None)
    client.xgroup_create(stream, group, id="0")
    decode = msgspec.json.Decoder().decode
    state: dict[str, dict[str, int]] = {}
    handled = 0
    start = time.perf_counter()
    while True:
        if raw:
            reply = client.execute_command(  # type: ignore[no-untyped-call]
                "XREADGROUP", "GROUP", group, "plain", "COUNT", batch_size, "STREAMS", stream, ">"
            )
        else:
            reply = client.xreadgroup(group, "plain", {stream: ">"}, count=batch_size)
        if not reply:
            break
        entries = reply[0][1]
        ids = []
        for entry_id, flat in entries:
            if raw:
                it = iter(flat)
                fields = dict(zip(it, it))  # noqa: B905 - Redis always returns field/value pairs
            else:
                fields = flat
            order = decode(fields[b"value"])
            key = fields[b"key"].decode()
            st = state.get(key)
            if st is None:
                st = state[key] = {}
            st["total"] = st.get("total", 0) + order["amount"]
            st["count"] = st.get("count", 0) + 1
            ids.append(entry_id)
        client.xack(stream, group, *ids)
        handled += len(entries)
    totals = [(s["total"], s["count"]) for s in state.values()]
    return _loop_result(client, stream, group, time.perf_counter() - start, handled, totals)


def _loop_result(
    client: redis.Redis, stream: str, group: str, seconds: float, handled: int, totals: list[tuple[int, int]]
) -> dict[str, Any]:
    """A plain loop's figures and state sums (per key: total, count), checked like PSPF's."""
    pending = client.xpending(stream, group)["pending"]
    client.close()
    return {
        "seconds": seconds,
        "handled": handled,
        "pending": pending,
        "keys": len(totals),
        "total": sum(total for total, _ in totals),
        "count": sum(count for _, count in totals),
    }


def check(what: str, got: dict[str, Any], expected: tuple[int, int, int]) -> None:
    seen = (got["keys"], got["total"], got["count"])
    if seen != expected:
        raise SystemExit(f"{what}: state (keys, total, count) is {seen}, expected {expected}")
    if got.get("failed") or got.get("pending"):
        raise SystemExit(f"{what}: {got.get('failed')} failed batches, {got.get('pending')} left pending")
