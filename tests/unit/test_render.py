"""The CLI's shared output: the exact text of tables, record fields, ages and table cells."""

from __future__ import annotations

import msgspec
import pytest

from pspf.cli.render import age_text, first_line, json_text, print_fields, print_json, print_table


class Row(msgspec.Struct):
    name: str
    count: int
    note: str | None = None
    traceback: str = ""


def test_table_aligns_columns_and_shows_none_as_dash(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(["NAME", "COUNT", "NOTE"], [["a", 1, None], ["longer", 22, "x"]])
    assert capsys.readouterr().out == "NAME    COUNT  NOTE\na       1      -\nlonger  22     x\n"


def test_table_without_rows_prints_its_headers(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(["MEMBER", "HOST"], [])
    assert capsys.readouterr().out == "MEMBER  HOST\n"


def test_fields_print_one_json_value_per_line_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    print_fields(Row("a", 2, traceback="tb"), skip=("traceback",))
    assert capsys.readouterr().out == 'name: "a"\ncount: 2\nnote: null\n'


def test_json_is_compact_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_json([Row("a", 2)])
    assert capsys.readouterr().out == '[{"name":"a","count":2,"note":null,"traceback":""}]\n'
    assert json_text({"k": [1, None]}) == '{"k":[1,null]}'


def test_age_is_seconds_then_minutes_then_hours() -> None:
    ages = [None, 0.4, 119.4, 120.0, 7199.0, 7200.0, 90_000.0]
    assert [age_text(s) for s in ages] == [None, "0s", "119s", "2m", "120m", "2.0h", "25.0h"]


def test_first_line_is_cut_to_the_width() -> None:
    assert first_line("") == ""
    assert first_line("boom\nat line 2") == "boom"
    assert first_line("x" * 60) == "x" * 60
    assert first_line("x" * 61) == "x" * 57 + "..."
    assert first_line("abcdef", width=5) == "ab..."
