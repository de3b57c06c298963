"""Two apps, one lagging, across a repartition, then SIGKILLed at random on two state dirs each.

Every key's state exact in both apps, every entry in its key's partition of the new count.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from pspf import Settings
from pspf.broker import Broker
from pspf.keys import partition_for, stream_key
from pspf.repartition.run import Repartition, make_plan
from tests.conftest import Names
from tests.crash.conftest import Spawner
from tests.crash.support import backup_state, expected_state, held_by, no_leases, order_records
from tests.support import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.crash]

LEASE_TTL_MS = 1000
WORK_US = 300


@pytest.mark.parametrize(("before", "after"), [(4, 8), (8, 3)])
def test_two_apps_across_a_repartition_and_random_sigkills_on_two_state_dirs_stay_exact(
    before: int,
    after: int,
    spawn: Spawner,
    tmp_path: Path,
    make_topic: Callable[[int], str],
    produce: Callable[..., int],
    make_settings: Callable[..., Settings],
    names: Names,
    rclient: redis.Redis,
) -> None:
    seed = int(os.environ.get("PSPF_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (set PSPF_TEST_SEED to repeat)")
    rng = random.Random(seed)
    topic, ahead, behind = make_topic(before), names.app(), names.app()
    records = order_records(9000, 200, seed)
    options = ["--batch-size", "50", "--block-ms", "100", "--lease-ttl-ms", str(LEASE_TTL_MS)]
    options += ["--broker", spawn.redis_url]
    env = {"PSPF_TEST_WORK_US": str(WORK_US)}

    def to_the_end(app: str, where: str, label: str) -> int:
        final = spawn(
            label,
            topic,
            app,
            *options,
            "--state-dir",
            str(tmp_path / where),
            "--until-idle",
            env=env,
            cli_settings=False,
        )
        assert final.wait(timeout=180) == 0, final.tail()
        return final.summary()[0]

    produce(topic, records[:2000])
    to_the_end(ahead, "a1", "ahead-0")
    to_the_end(behind, "b1", "behind-0")
    produce(topic, records[2000:6000])
    to_the_end(ahead, "a1", "ahead-1")  # the other app lags by 4,000 entries

    broker = Broker(make_settings().redis)
    Repartition(broker, make_plan(broker, topic, after)).run()
    produce(topic, records[6000:])

    for app, dirs in ((ahead, ("a1", "a2")), (behind, ("b1", "b2"))):
        for life in range(4):
            where = ["--state-dir", str(tmp_path / dirs[life % 2])]
            worker = spawn(f"{app}-{life}", topic, app, *options, *where, env=env, cli_settings=False)
            wait_until(
                lambda w=worker, a=app: held_by(rclient, topic, a, after, w.pid) or not w.alive(),
                timeout=LEASE_TTL_MS / 1000 + 15,
                what="the worker to take every partition",
            )
            time.sleep(rng.uniform(0.1, 0.6))
            assert worker.alive(), f"worker exited by itself\n{worker.tail()}"
            assert worker.kill9() == -9
        wait_until(
            lambda a=app: no_leases(rclient, topic, a, after), 10, "the dead worker's leases to expire"
        )
        handled = to_the_end(app, dirs[0], f"{app}-final")
        if app == behind:  # 7,000 entries to handle: the kills land mid-stream (the other has 3,000)
            assert handled > 0, "the kills should land mid-stream"

    expected = expected_state(records)
    for app in (ahead, behind):
        got = {}
        for partition in range(after):
            for key, value in backup_state(rclient, topic, app, partition).items():
                assert partition_for(key.encode(), after) == partition
                got[key] = (value["count"], value["total"])
        assert got == expected, app
    seen = 0
    for partition in range(after):
        for _, fields in rclient.xrange(stream_key(topic, partition)):
            assert partition_for(fields[b"key"], after) == partition
            seen += 1
    assert seen == len(records)
