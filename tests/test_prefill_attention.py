"""Grouped prefill attention (one call per group of sequences) against the per-sequence reference."""

from __future__ import annotations

import random

import pytest
import torch

from manylora.engine.layers.prefill_attention import PAD_FLOOR, attend, attend_each, build_groups, group_sequences
from manylora.engine.layers.step_batch import SequenceSlice


def _random_step(rng: random.Random, num_seqs: int, page_size: int, max_context: int, heads: int, kv_heads: int,
                 head_dim: int, layers: int = 2):
    """A pool with random keys/values, and sequences with random pages, chunk lengths and contexts."""
    num_pages = num_seqs * (max_context // page_size + 1) + 3
    # the pool's other bits are anything (adapters' page tails, freed pages): NaN, here; only the
    # sequences' cached positions get values
    storage = torch.full((num_pages, layers, 2, page_size, kv_heads, head_dim), float("nan"))
    free = list(range(num_pages))
    rng.shuffle(free)
    sequences, positions, row = [], [], 0
    for _ in range(num_seqs):
        context = rng.randint(1, max_context)
        length = rng.randint(1, context)  # a chunk ending at context: a whole prompt, a later chunk, a decode
        blocks = -(-context // page_size)
        table = torch.tensor([free.pop() for _ in range(blocks)], dtype=torch.int64)
        for p in range(context):
            storage[table[p // page_size], :, :, p % page_size] = torch.randn(layers, 2, kv_heads, head_dim)
        sequences.append(SequenceSlice(row, length, context, table))
        positions += range(context - length, context)
        row += length
    q = torch.randn(row, heads, head_dim)
    return storage, sequences, torch.tensor(positions, dtype=torch.int64), q


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 5])
def test_grouped_equals_each_sequence_alone(seed, window):
    rng = random.Random(seed)
    heads, kv_heads = rng.choice([(4, 2), (6, 3), (4, 4), (8, 1)])
    page_size = rng.choice([1, 3, 4, 16])
    storage, sequences, positions, q = _random_step(rng, rng.randint(1, 9), page_size, rng.choice([7, 40, 130]),
                                                    heads, kv_heads, rng.choice([8, 12]))
    scale = 0.3
    for layer in range(storage.shape[1]):
        want = torch.full_like(q, float("nan"))
        got = torch.full_like(q, float("nan"))
        attend_each(q, want, layer, storage, sequences, positions, scale, window)
        attend(q, got, layer, storage, build_groups(sequences, positions, page_size, window), scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # every row written (no NaN left)


def test_groups_bound_the_padding_and_keep_every_sequence():
    rng = random.Random(3)
    sequences = [SequenceSlice(i, rng.randint(1, 300), 0, torch.zeros(1, dtype=torch.int64)) for i in range(40)]
    for s in sequences:
        s.context_len = s.length + rng.choice([0, 0, 5, 2000])
    groups = group_sequences(sequences)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in sequences)
    assert 1 < len(groups) < len(sequences)
    for g in groups:
        padded = len(g) * max(s.length for s in g) * max(s.context_len for s in g)
        real = sum(s.length * s.context_len for s in g)
        assert padded <= max(2.0 * real, PAD_FLOOR)
