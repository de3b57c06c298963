"""Windowed aggregations on event time, and the other work time does in a partition.

``@app.window(topic, spec, ...)`` folds each entry into the windows its event time falls in; a
window closes when the partition's stream time (the largest event time applied there; it never
goes back) passes its last millisecond plus the grace period. Its result is emitted to
``emit_to`` and its state deleted in the batch's commit, so a crash can neither lose nor repeat
a result.

Kinds (the bounds a result carries: ``start`` inclusive; ``end`` as noted):

- ``tumbling(size)``: ``[start, start + size)`` aligned to the epoch, ``end`` exclusive;
- ``hopping(size, step)``: windows of ``size`` every ``step``, ``end`` exclusive;
- ``sliding(size)`` (Kafka Streams' meaning): ``[t - size, t]`` for each entry at ``t`` and the
  window just after it, ``[t + 1, t + 1 + size]``, when some entry falls in it; ``end`` inclusive.
  An entry joins every open window it falls in; a window that an entry creates starts from the
  entries already there, folded in arrival order;
- ``tumbling_count(n)``, ``hopping_count(n, step)`` (streams only: ``Stream.window``): a key's
  entries ``n`` at a time, closed when full; ``start`` and ``end`` are its first and last entry's
  times (``kinds.counted``);
- ``session(gap)``: a key's entries at most ``gap`` apart; an entry that bridges
  two sessions merges them (``merge=`` combines their accumulators); ``end`` is the last entry's
  time, inclusive, and the session can grow until stream time passes ``end + gap``.

An entry is late when every window it falls in has closed (or, for a session, when it would
extend or bridge a closed one): it is not applied, only counted, or dead-lettered with
``late="dlq"``. Closed sessions leave a marker until stream time passes their end + 2 x gap +
grace (an entry that could bridge one after that is late by its own session's close anyway).
Every such test is against stream time, never against what was swept at the end of the last
batch, so the results do not depend on where batches begin and end.

A topic may have several windows (and a handler): each entry is one attempt for all of them
(``pspf.app``). Each window is known by its name, in the store, the backup, the metrics and the
CLI. Stream time is the partition's, shared by all its windows.

The rooms (this package is the app's API too: ``from pspf import windows; windows.tumbling(...)``):

- ``kinds``: the window kinds, one module each (``tumbling``, ``hopping``, ``sliding``,
  ``session``), behind one protocol (``kinds.base.WindowKind``: which windows an entry falls in,
  until when a window can change, what the kind keeps beside its windows and when it forgets
  it) and registered in one place (``kinds/__init__.py``);
- ``aggregation``: one ``@app.window`` and one partition's open windows of every one of them,
  whatever their kind: applying changes, closing on stream time, the store layout;
- ``functions``: what a window declares, read once: its function's types, its event time;
- ``timers``: the other work time does in a partition: scheduled callbacks, timers, state expiry.

To add a kind: write a ``WindowKind`` subclass and the function that makes its ``WindowSpec``
in a module of ``kinds/``, and register it with one line in ``kinds/__init__.py`` (outside PSPF:
``pspf.windows.kinds.register(MyKind)`` before declaring windows of it); the conformance suite
``tests/conformance/test_window_kinds.py`` runs every registered kind, and docs/how-to/time.md
("Adding a window kind") says what each method answers.

This face re-exports the kinds only: the open windows name ``Context`` (their functions take one)
and ``pspf.context`` uses the timers, so loading them here would close a circle through it. The
cycle and the partition import ``PartitionWindows``, ``Aggregation`` and the timers from their rooms.
"""

from __future__ import annotations

from pspf.windows.kinds import (
    Kind,
    LatePolicy,
    WindowId,
    WindowKind,
    WindowSpec,
    hopping,
    hopping_count,
    register,
    session,
    sliding,
    tumbling,
    tumbling_count,
)

__all__ = [
    "Kind",
    "LatePolicy",
    "WindowId",
    "WindowKind",
    "WindowSpec",
    "hopping",
    "hopping_count",
    "register",
    "session",
    "sliding",
    "tumbling",
    "tumbling_count",
]
