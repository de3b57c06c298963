"""Replay after a DLQ redrive applies each entry once, through its last redriven copy.

A redrive puts a dead entry back as a new entry at the end of its partition; the original stays
in the stream. Replay delivers both, and once the original succeeds (the bug was fixed, the
failure was transient) it would be applied next to its copy: the state after replay would not
be the first run's. Replay marks the originals a copy replaces, so the state is the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from pspf import App, Context, NonRetryableError
from pspf.cli import cli
from pspf.keys import SUPERSEDED_NAMESPACE, StreamId, stream_key
from tests.conftest import Names

pytestmark = pytest.mark.integration

ENTRIES = 400
KEYS = 20
#: failing at first: every fifth entry; a tenth fails again after its first redrive
BAD = {n for n in range(ENTRIES) if n % 5 == 0}
BAD_TWICE = {n for n in BAD if n % 10 == 0}


def make() -> App:
    """Orders whose ``n`` is listed in PSPF_TEST_FAILING fail (DLQ at once); each key keeps its ns."""
    app = App(os.environ["PSPF_TEST_APP"])
    failing = {int(n) for n in os.environ.get("PSPF_TEST_FAILING", "").split(",") if n}

    @app.handler(os.environ["PSPF_TEST_TOPIC"])
    def add(order: dict[str, Any], ctx: Context) -> None:
        if order["n"] in failing:
            raise NonRetryableError(f"order {order['n']} fails")
        ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
        ctx.state["ns"] = [*ctx.state.get("ns", []), order["n"]]

    return app


class Scenario:
    """A topic, an app and the CLI, in-process, against the test server."""

    def __init__(self, redis_url: str, state_dir: Path, names: Names) -> None:
        self.topic, self.app = names.topic(), names.app()
        self.env = {
            "PSPF_BROKER": redis_url,
            "PSPF_STATE_DIR": str(state_dir),
            "PSPF_BLOCK_MS": "100",
            "PSPF_TEST_TOPIC": self.topic,
            "PSPF_TEST_APP": self.app,
        }

    def __call__(self, *args: str, input: str | None = None, **env: str) -> Result:
        result = CliRunner().invoke(cli, list(args), input=input, env={**self.env, **env})
        assert result.exit_code == 0, result.output
        return result

    def run(self, failing: Collection[int] = ()) -> Result:
        listed = ",".join(str(n) for n in sorted(failing))
        return self("run", f"{__name__}:make", "--until-idle", PSPF_TEST_FAILING=listed)

    def redrive_all(self) -> int:
        listed = json.loads(self("dlq", "list", self.topic, "--json").stdout)
        if listed:
            self("dlq", "redrive", self.topic, "--all", "--yes")
        return len(listed)

    def state(self) -> dict[str, Any]:
        """Every key's state, from an export of the stores."""
        lines = [json.loads(line) for line in self("state", "export", self.app).stdout.splitlines()]
        return {line["key"]: line["state"] for line in lines if line.get("namespace") == "state"}

    def marks(self) -> int:
        """The superseded marks: bookkeeping, which only an export with --all writes."""
        lines = [json.loads(line) for line in self("state", "export", self.app, "--all").stdout.splitlines()]
        return sum(1 for line in lines if line.get("namespace") == SUPERSEDED_NAMESPACE)

    def replay(self, *args: str) -> dict[str, Any]:
        return dict(
            json.loads(self("replay", self.app, "--topic", self.topic, *args, "--yes", "--json").stdout)
        )


@pytest.fixture
def redriven(
    redis_url: str, tmp_path: Path, names: Names, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Scenario, dict[str, Any]]]:
    """A first run in which every fifth entry failed, was redriven, and half of those failed and
    were redriven again, until they all succeeded; with the state that run ended with."""
    for name in ("PSPF_BROKER", "PSPF_STATE_DIR", "PSPF_UNTIL_IDLE", "PSPF_TEST_FAILING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    s = Scenario(redis_url, tmp_path / "state", names)
    s("topic", "create", s.topic, "--partitions", "2")
    lines = "".join(
        json.dumps({"user": f"u{n % KEYS}", "n": n, "amount": n + 1}) + "\n" for n in range(ENTRIES)
    )
    s("produce", s.topic, "--key-field", "user", input=lines)

    assert f"{len(BAD)} dead-lettered" in s.run(BAD).output
    assert s.redrive_all() == len(BAD)
    assert f"{len(BAD_TWICE)} dead-lettered" in s.run(BAD_TWICE).output  # their copies fail again
    assert s.redrive_all() == len(BAD_TWICE)
    assert f"processed {len(BAD_TWICE)} entries" in s.run().output
    first = s.state()
    # The first run applied every order once: the state this test compares with is right.
    assert sorted(n for state in first.values() for n in state["ns"]) == list(range(ENTRIES))
    assert sum(state["total"] for state in first.values()) == sum(n + 1 for n in range(ENTRIES))
    yield s, first


def test_replay_from_start_after_redrives_rebuilds_the_first_runs_state(
    redriven: tuple[Scenario, dict[str, Any]],
) -> None:
    s, first = redriven
    result = s.replay("--from-start")
    assert result["entries_to_replay"] == ENTRIES + len(BAD) + len(BAD_TWICE)

    rerun = s.run()
    # Exactly the first run's state, in the same order per key: each original is skipped and
    # applied through its last copy (a chain of two redrives skips the first copy too).
    assert s.state() == first
    skipped = len(BAD) + len(BAD_TWICE)
    assert f"processed {ENTRIES} entries ({skipped} already done" in rerun.output
    assert result["superseded"] == skipped
    assert s.marks() == 0  # forgotten once the checkpoints passed them
    dry = s("replay", s.app, "--topic", s.topic, "--from-start", "--dry-run").stdout
    assert f"{skipped} of them were redriven from the DLQ later" in dry


def test_replay_keep_state_after_redrives_applies_each_entry_once_more(
    redriven: tuple[Scenario, dict[str, Any]],
) -> None:
    s, first = redriven
    result = s.replay("--from-start", "--keep-state")
    s.run()
    again = s.state()
    assert again == {
        key: {"total": 2 * state["total"], "ns": state["ns"] * 2} for key, state in first.items()
    }
    assert result["superseded"] == len(BAD) + len(BAD_TWICE)
    assert s.marks() == 0


def test_replay_from_an_id_marks_only_originals_after_it(
    redriven: tuple[Scenario, dict[str, Any]], rclient: redis.Redis
) -> None:
    """Replayed after the last produced entry: the copies are replayed, not the originals; the
    first copies of the entries that failed twice are replaced by their second copies, so every
    entry that failed is applied exactly once, and no mark is left for an original not replayed."""
    s, _ = redriven
    # After the last original of both partitions (copies came later, so their ids are larger).
    position = max(
        StreamId.parse(
            [i for i, fields in rclient.xrange(stream_key(s.topic, p)) if b"headers" not in fields][-1]
        )
        for p in range(2)
    )
    result = s.replay("--to-id", str(position))
    s.run()
    state = s.state()
    assert sorted(n for st in state.values() for n in st["ns"]) == sorted(BAD)
    assert result["superseded"] == len(BAD_TWICE)
    assert s.marks() == 0
