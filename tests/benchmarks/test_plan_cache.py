"""plan_cache: the kinds of work between steps, and the table of their ratios."""

import pytest
from plan_cache import parse_between, ratios, table


def test_each_kind_parses_and_runs() -> None:
    assert parse_between("none", 1).name == "none"
    buf = parse_between("buffer:0.5", 1)
    assert buf.name == "buffer:0.5"
    buf.run()  # writes half a megabyte without error
    parse_between("json", 4).run()


@pytest.mark.parametrize("spec", ["buffer", "buffer:0", "buffer:-1", "buffer:x", "spin", ""])
def test_a_bad_kind_is_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="--between"):
        parse_between(spec, 1)


def test_ratios_are_against_the_none_kind() -> None:
    assert ratios({"none": 2.0, "json": 3.0, "buffer:4": 5.0}) == {
        "none": 1.0, "json": 1.5, "buffer:4": 2.5,
    }  # fmt: skip


def test_the_table_has_a_row_per_batch_in_milliseconds() -> None:
    rows = [(1, {"none": 0.0002, "json": 0.0003}), (16, {"none": 0.0010, "json": 0.0015})]
    assert table(rows).splitlines() == [
        "| batch | none | json |",
        "|---|---|---|",
        "| 1 | 0.200 ms (1.00x) | 0.300 ms (1.50x) |",
        "| 16 | 1.000 ms (1.00x) | 1.500 ms (1.50x) |",
    ]
