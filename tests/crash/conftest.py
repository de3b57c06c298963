"""Fixtures of the crash tests: worker subprocesses that are always reaped, logs shown on failure."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.crash.support import APP_TARGET, WorkerProcess


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


class Spawner:
    """Starts ``pspf run`` subprocesses of the crash app for one test."""

    def __init__(self, tmp_path: Path, redis_url: str) -> None:
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.state_dir = tmp_path / "state"
        self.workers: list[WorkerProcess] = []

    def __call__(
        self,
        label: str,
        topic: str,
        app: str,
        *args: str,
        env: dict[str, str] | None = None,
        cli_settings: bool = True,
        target: str = APP_TARGET,
    ) -> WorkerProcess:
        """Start a worker of ``target``; broker and state dir are given as options unless
        ``cli_settings`` is off."""
        extra = {"PSPF_TEST_TOPIC": topic, "PSPF_TEST_APP": app, **(env or {})}
        options = ["--broker", self.redis_url, "--state-dir", str(self.state_dir)] if cli_settings else []
        worker = WorkerProcess(
            self.tmp_path / f"{label}.log",
            [*options, *args],
            subprocess_env(**extra),
            cwd=self.tmp_path,
            target=target,
        )
        self.workers.append(worker)
        return worker

    def reap(self) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.kill9()


@pytest.fixture
def spawn(tmp_path: Path, redis_url: str, request: pytest.FixtureRequest) -> Iterator[Spawner]:
    spawner = Spawner(tmp_path, redis_url)
    try:
        yield spawner
    finally:
        spawner.reap()
        if request.node.stash.get(_FAILED, False):
            for worker in spawner.workers[-4:]:
                print(worker.tail())


@pytest.fixture
def state_dir(spawn: Spawner) -> Path:
    return spawn.state_dir
