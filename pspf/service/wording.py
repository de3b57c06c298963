"""Counts in messages, worded for their number: ``1 entry``, ``3 entries``."""

from __future__ import annotations


def counted(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1.

    The plural is ``nouns`` when given, else ``noun`` + ``s`` (``y`` after a consonant becomes
    ``ies``).
    """
    if count == 1:
        return f"{count} {noun}"
    if nouns is None:
        nouns = noun[:-1] + "ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else noun + "s"
    return f"{count} {nouns}"
