"""A store engine of the tests: the memory engine's dictionaries, written to one JSON file.

It exists to show that an engine is one module plus one ``register_engine`` line: the state
store conformance suite registers it and runs it like the engines PSPF ships. Each commit
rewrites the whole file in place (not crash-safe: a test engine, not one to run apps on).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path

from pspf.errors import NotFound, StateError, StoreLocked
from pspf.keys import StreamId
from pspf.state_stores.base import Durability
from pspf.state_stores.memory import MemoryStore


class JsonStore(MemoryStore):
    """State of one (group, partition) in one JSON file, locked by a ``.lock`` file beside it."""

    def __init__(self, path: Path, durability: Durability = "normal", readonly: bool = False) -> None:
        super().__init__()
        self.path = path
        self._fsync = durability == "fsync"
        self._lock_fd: int | None = None
        try:
            if readonly:
                if not path.exists():
                    raise NotFound(f"state store {path} holds no state yet")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._lock_fd = _lock(path)
                if not path.exists():
                    self._save()
                self._remember_identity()
            self._read()
        except (OSError, ValueError) as exc:
            self.close()
            raise StateError(f"cannot open state store {path}: {exc}") from exc

    def _read(self) -> None:
        assert self.path is not None
        data = json.loads(self.path.read_text())
        self._values = {(ns, key): base64.b64decode(value) for ns, key, value in data["values"]}
        self._checkpoints = {topic: StreamId(ms, seq) for topic, (ms, seq) in data["checkpoints"].items()}

    def _save(self) -> None:
        """Rewrite the file in place: its inode stays, as ``check_in_place`` expects of a writer."""
        assert self.path is not None
        values = [[ns, key, base64.b64encode(value).decode()] for (ns, key), value in self._values.items()]
        checkpoints = {topic: [cp.ms, cp.seq] for topic, cp in self._checkpoints.items()}
        with open(self.path, "w") as file:
            json.dump({"values": values, "checkpoints": checkpoints}, file)
            if self._fsync:
                file.flush()
                os.fsync(file.fileno())

    def write(
        self, updates: Mapping[tuple[str, str], bytes | None], checkpoints: Mapping[str, StreamId]
    ) -> None:
        super().write(updates, checkpoints)
        self._save()

    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        super().rewind(clear, checkpoints, values)
        self._save()

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _lock(path: Path) -> int:
    """An exclusive lock the kernel drops with the process, or StoreLocked naming its holder."""
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLocked(f"state store {path} is in use by process {holder}") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd
