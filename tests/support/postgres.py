"""A real PostgreSQL for the sink tests: Debian's ``postgresql`` server in a temporary directory.

Registered in ``tests/conftest.py``: ``postgres`` (the server), ``pg_dsn`` and ``pg_query``.

``initdb`` and ``pg_ctl`` run as the ``postgres`` user when the tests run as root (PostgreSQL
refuses root). Without the server's binaries the tests skip and say why; CI installs them.
One server per test process; each test gets a database of its own (``pg_dsn``).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pspf.embedded import free_port  # the benchmarks start one too


def _binaries() -> Path | None:
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(Path(found) / "initdb", os.X_OK):
            return Path(found)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresMissing(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


class PostgresServer:
    """A PostgreSQL server on 127.0.0.1 with trust authentication, stopped with ``stop``."""

    def __init__(self, root: Path) -> None:
        binaries = _binaries()
        if binaries is None:
            raise PostgresMissing("PostgreSQL is not installed (apt-get install postgresql)")
        self.bin = binaries
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    # Not under pytest's temporary directory: the postgres user cannot enter it (mode 0700).
    root = Path(tempfile.mkdtemp(prefix="pspf-postgres-"))
    try:
        try:
            server = PostgresServer(root)
        except PostgresMissing as exc:
            pytest.skip(str(exc))
        yield server
        server.stop("immediate")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_dsn(postgres: PostgresServer) -> str:
    """A fresh database of the session's server."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres.dsn(name)


@pytest.fixture
def pg_query(pg_dsn: str) -> Callable[..., list[tuple[object, ...]]]:
    """Run one statement in the test's database; the rows it returns."""
    import psycopg

    def query(statement: str, *params: object) -> list[tuple[object, ...]]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            cursor = conn.execute(statement, params or None)
            return cursor.fetchall() if cursor.description else []

    return query
