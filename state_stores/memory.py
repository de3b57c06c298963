"""In-memory engine with the same semantics as the file engines, for tests and examples."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

from pspf.keys import StreamId
from pspf.state_stores.base import StateStore, apply_checkpoints


class MemoryStore(StateStore):
    """State held in dictionaries; gone when the object is."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], bytes] = {}
        self._checkpoints: dict[str, StreamId] = {}

    def get(self, namespace: str, key: str) -> bytes | None:
        return self._values.get((namespace, key))

    def get_many(self, namespace: str, keys: Iterable[str]) -> dict[str, bytes]:
        values = self._values
        return {key: values[(namespace, key)] for key in keys if (namespace, key) in values}

    def items(self, namespace: str, prefix: str = "") -> Iterator[tuple[str, bytes]]:
        selected = [
            (key, value)
            for (ns, key), value in self._values.items()
            if ns == namespace and key.startswith(prefix)
        ]
        return iter(sorted(selected))

    def checkpoints(self) -> dict[str, StreamId]:
        return dict(self._checkpoints)

    def write(
        self,
        updates: Mapping[tuple[str, str], bytes | None],
        checkpoints: Mapping[str, StreamId],
    ) -> None:
        for name, value in updates.items():
            if value is None:
                self._values.pop(name, None)
            else:
                self._values[name] = value
        self._checkpoints.update(checkpoints)

    def rewind(
        self,
        clear: Collection[str],
        checkpoints: Mapping[str, StreamId | None],
        values: Mapping[tuple[str, str], bytes] | None = None,
    ) -> None:
        kept = {name: value for name, value in self._values.items() if name[0] not in clear}
        self._values = {**kept, **(values or {})}
        apply_checkpoints(self._checkpoints, checkpoints)

    def dump(self) -> tuple[dict[str, StreamId], Iterator[tuple[str, str, bytes]]]:
        rows = sorted((ns, key, value) for (ns, key), value in self._values.items())
        return dict(self._checkpoints), iter(rows)

    def integrity_check(self) -> str:
        return "ok"

    def close(self) -> None:
        """Nothing to release."""
