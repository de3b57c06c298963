"""Session windows: a key's entries at most ``gap`` apart; an entry that bridges two merges them.

Beside its accumulators a session aggregation keeps each key's open sessions in order (to find
those an entry touches) and a marker ("c" in the store) of each closed session until no entry
that could bridge it is on time any more: an entry that would extend or bridge a closed session
is late.
"""

from __future__ import annotations

import bisect
from datetime import timedelta
from typing import Any

from pspf.errors import ConfigError
from pspf.keys import WindowKey
from pspf.windows.kinds.base import Change, Folding, WindowKind, WindowSpec, ms


class Session(WindowKind):
    """``[start, end]``: ``end`` is the last entry's time, and the session grows until ``end + gap``."""

    name = "session"

    def __init__(self, window: str, spec: WindowSpec, folding: Folding) -> None:
        super().__init__(window, spec, folding)
        #: each key's open sessions, and its closed ones that an entry could still bridge
        self.sessions: dict[str, list[tuple[int, int]]] = {}
        self.closed_ones: dict[str, list[tuple[int, int]]] = {}

    @classmethod
    def last_ms(cls, spec: WindowSpec, start: int, end: int) -> int:
        return end + spec.size_ms

    @classmethod
    def check(cls, spec: WindowSpec, where: str, merge: object) -> None:
        if merge is None:
            raise ConfigError(
                f"{where}: session windows need merge=(a, b) -> accumulator, "
                "to combine two sessions an entry bridges"
            )

    @classmethod
    def example(cls, unit_ms: int, grace_ms: int) -> WindowSpec:
        return WindowSpec(cls.name, unit_ms, 0, grace_ms)

    def forget_at(self, end: int) -> int:
        """When a closed session's marker can go: no entry that could bridge it is on time then."""
        spec = self.spec
        return end + 2 * spec.size_ms + spec.grace_ms + 1

    def change(self, key: str, ts: int, value: Any, entry_id: bytes, now: int) -> Change:
        """The session ``value`` joins (merging those it bridges), or late.

        Every test is against ``now``, not against what the last batch's close swept: a session
        that stream time closed counts as closed before it is swept, so results never depend on
        where batches begin and end (a replay after a crash batches differently).
        """
        gap = self.spec.size_ms
        touched = []
        late = False
        for s, e in self.sessions.get(key, ()):
            if s - gap <= ts <= e + gap:
                if self.close_at(s, e) > now:
                    touched.append((s, e))
                elif self.forget_at(e) > now:
                    late = True
        late = late or any(
            s - gap <= ts <= e + gap and self.forget_at(e) > now for s, e in self.closed_ones.get(key, ())
        )
        start = min([ts, *(s for s, _ in touched)])
        end = max([ts, *(e for _, e in touched)])
        if late or self.close_at(start, end) <= now:
            return Change(self.window, key, ts, entry_id, [], [], None, True)
        accs = [self.accs[(key, s, e)] for s, e in touched]
        folding = self.folding
        base = None if not accs else accs[0] if len(accs) == 1 else folding.merged(accs)
        acc = folding.fold(base, value)
        return Change(self.window, key, ts, entry_id, [(start, end, acc)], touched, None, False)

    def opened(self, key: str, start: int, end: int) -> None:
        bisect.insort(self.sessions.setdefault(key, []), (start, end))

    def dropped(self, key: str, start: int, end: int) -> None:
        sessions = self.sessions[key]
        sessions.remove((start, end))
        if not sessions:
            del self.sessions[key]

    def closed(self, key: str, start: int, end: int) -> None:
        bisect.insort(self.closed_ones.setdefault(key, []), (start, end))
        self.remember(self.forget_at(end), "c", key, start, end)
        self.write("c", key, start, end, b"")

    def restored(self, found: WindowKey, value: bytes) -> None:
        if found.kind != "c":
            super().restored(found, value)
            return
        key, start, end = found.key, found.a, int(found.b)
        bisect.insort(self.closed_ones.setdefault(key, []), (start, end))
        self.forget.append((self.forget_at(end), "c", key, start, end))

    def forgotten(self, letter: str, key: str, a: int, b: Any) -> None:
        closed = self.closed_ones[key]
        closed.remove((a, b))
        if not closed:
            del self.closed_ones[key]
        self.write("c", key, a, b, None)


def session(gap: timedelta, grace: timedelta = timedelta(0)) -> WindowSpec:
    """A key's bursts of activity: entries at most ``gap`` apart share a session."""
    return WindowSpec("session", ms("gap", gap), 0, ms("grace", grace, 0))
