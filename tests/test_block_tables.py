"""manylora/engine/execution/block_tables.py: a step's block tables as one padded int32 tensor, equal to what the
nested lists give, on fresh random tables."""

import random

import pytest
import torch

from manylora.engine.execution.block_tables import padded_block_tables


@pytest.mark.parametrize("seed", range(6))
def test_padded_tables_equal_the_nested_lists(seed):
    rng = random.Random(seed)
    tables = [[rng.randrange(0, 2**31 - 1) for _ in range(rng.randint(1, 70))] for _ in range(rng.randint(1, 300))]
    fill = rng.randrange(0, 5000)
    width = max(map(len, tables))
    expected = torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = padded_block_tables(tables, fill)
    assert got.dtype == torch.int32 and got.shape == expected.shape and torch.equal(got, expected)


def test_one_table_and_equal_lengths():
    assert padded_block_tables([[4, 5, 6]], 0).tolist() == [[4, 5, 6]]
    assert padded_block_tables([[1, 2], [3, 4]], 9).tolist() == [[1, 2], [3, 4]]
