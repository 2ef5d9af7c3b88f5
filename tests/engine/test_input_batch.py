"""BlockTables: the persistent padded block tables equal a fresh padding after any change."""

from __future__ import annotations

import random

import numpy as np

from tandem.engine.input_batch import BlockTables, padded


def _check(bt: BlockTables, tables: list[list[int]]) -> np.ndarray:
    width = max(map(len, tables))
    got = bt.build(tables, width)
    np.testing.assert_array_equal(got, padded(tables, width))
    assert got.dtype == np.int32 and got.flags.c_contiguous
    return got


def test_padded_rows_then_zeros() -> None:
    out = padded([[3, 1], [7], [4, 5, 6]], 4)
    np.testing.assert_array_equal(out, [[3, 1, 0, 0], [7, 0, 0, 0], [4, 5, 6, 0]])


def test_random_table_changes_match_a_fresh_build() -> None:
    """Appends (a decode crossing a block), replaced tables (preemption, swap), rows added,
    removed and reordered, widths growing past the capacity: every step equals padded()."""
    rng = random.Random(0)
    bt = BlockTables()
    tables = [[rng.randrange(1000) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    for _ in range(300):
        op = rng.random()
        i = rng.randrange(len(tables))
        if op < 0.5:  # allocate_slots: a new list, the old blocks plus new ones
            tables[i] = tables[i] + [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
        elif op < 0.6:  # freed and re-admitted: a different, possibly shorter table
            tables[i] = [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
        elif op < 0.7 and len(tables) > 1:
            tables.pop(i)
        elif op < 0.8:
            tables.insert(i, [rng.randrange(1000)])
        elif op < 0.85:
            rng.shuffle(tables)
        # else: nothing changed this step
        _check(bt, list(tables))


def test_returned_array_is_not_overwritten_by_the_next_step() -> None:
    bt = BlockTables()
    tables = [[1, 2], [3]]
    first = _check(bt, tables)
    tables[1] = [3, 4]
    _check(bt, tables)
    np.testing.assert_array_equal(first, [[1, 2], [3, 0]])


def test_unchanged_lists_are_reused_row_for_row() -> None:
    """Only rows whose list object changed are rewritten; a same-content new list is fine too."""
    bt = BlockTables()
    tables = [[i, i + 1] for i in range(16)]
    _check(bt, tables)
    tables = list(tables)
    tables[5] = [5, 6, 99]
    tables[9] = list(tables[9])
    _check(bt, tables)
