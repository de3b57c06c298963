from __future__ import annotations

from pspf.service.wording import counted


def test_counted_is_singular_for_one_only() -> None:
    assert [counted(n, "entry") for n in (0, 1, 2)] == ["0 entries", "1 entry", "2 entries"]
    assert [counted(n, "partition") for n in (1, 4)] == ["1 partition", "4 partitions"]
    assert counted(2, "key") == "2 keys" and counted(2, "day") == "2 days"
    assert counted(3, "child", "children") == "3 children"
