"""The base GEMM with the LoRA expand folded in (``skinny_linear(..., lora=GemmLora)``, decode_form "fused") against
its fp32 reference, over adapter distributions, mixed ranks, slice layouts, K splits and pool alignments; and the
step's distinct-slot table it reads (``build_step_slots``). Fresh random inputs from lora_cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lora_cases import DISTS, make_case, seed_of

from kernels.lora_meta import build_step_rows, build_step_slots
from kernels.lora_shrink import lora_shrink
from kernels.reference import ref_skinny_linear
from kernels.skinny_gemm import GemmLora, gemm_config, lora_block_n, r_block, skinny_linear

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def _gemm_case(device, dtype, num_tokens, in_features, widths, dist, align=1, bias=True, rank_choices=(1, 4, 8, 16),
               poison=True, max_rank=16, inside=False):
    """(x, weight, bias, GemmLora) with y from the real shrink kernel; poison: y past each row's rank and in the rows
    of slot -1 set to NaN, which the GEMM must never read. inside: the shrink inside the launch (its A tables given),
    y all NaN until the launch writes it."""
    case = make_case(seed_of("gemm_lora", dtype, num_tokens, in_features, widths, dist, align, rank_choices, max_rank),
                     num_tokens, in_features, list(widths), dist, device, max_rank=max_rank, rank_choices=rank_choices,
                     dtype=dtype, align=align)
    gen = case.gen
    weight = (torch.randn(sum(widths), in_features, generator=gen) / in_features**0.5).to(dtype).to(device)
    b = torch.randn(sum(widths), generator=gen).to(dtype).to(device) if bias else None
    y = torch.zeros((len(widths), num_tokens, case.a_row_offsets.shape[2]), dtype=torch.float32, device=device)
    lora_shrink(case.x, case.pool, case.a_row_offsets, case.ranks, case.token_slots, y)
    if poison:
        slots = case.token_slots.long()
        ranks = case.ranks.long()[:, slots.clamp(min=0)]  # [NS, T]
        ranks = torch.where(slots[None, :] >= 0, ranks, 0)
        past = torch.arange(y.shape[2], device=device)[None, None, :] >= ranks[:, :, None]
        y = torch.where(past, torch.full_like(y, float("nan")), y)
    num_slots = case.ranks.shape[1]
    step_slots = build_step_slots(case.token_slots, num_slots, case.b_row_offsets, 16 // case.pool.element_size())
    step_rows = build_step_rows(case.b_row_offsets, case.ranks, step_slots, r_block(max_rank))
    lora = GemmLora(y, case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots, step_slots,
                    step_rows, tuple(widths))
    if inside:
        step_slots = build_step_slots(case.token_slots, num_slots, torch.stack([case.a_row_offsets,
                                      case.b_row_offsets]), 16 // case.pool.element_size())
        lora = dataclasses.replace(
            lora, y=torch.full_like(y, float("nan")), step_slots=step_slots, a_row_offsets=case.a_row_offsets,
            step_rows=build_step_rows(case.b_row_offsets, case.ranks, step_slots, r_block(max_rank)),
            a_step_rows=build_step_rows(case.a_row_offsets, case.ranks, step_slots, r_block(max_rank)))
    return case.x, weight, b, lora


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("num_tokens, in_features, widths", [
    (1, 64, (48,)), (7, 96, (64, 16, 16)), (16, 128, (32, 32)), (33, 40, (48, 16, 16)), (64, 64, (80,)),
    (13, 72, (32, 37))])
def test_fused_lora_gemm_matches_reference(device, dist, num_tokens, in_features, widths):
    """One to three slices (q/k/v-like, gate/up-like, one projection; the last slice may end in a partial tile), every
    adapter distribution, ranks 1-16 mixed in one launch, rows of slot -1, K not a multiple of the block."""
    x, weight, b, lora = _gemm_case(device, torch.float32, num_tokens, in_features, widths, dist)
    got = skinny_linear(x, weight, b, lora=lora)
    _close(got, ref_skinny_linear(x, weight, b, lora), torch.float32)
    assert not torch.isnan(got).any()
    if dist == "all_none":  # nothing but the base GEMM
        _close(got, ref_skinny_linear(x, weight, b), torch.float32)


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("num_tokens, in_features, widths, align", [
    (1, 64, (48,), 4), (7, 96, (64, 16, 16), 1), (33, 40, (48, 16, 16), 4), (64, 200, (80,), 1),
    (13, 72, (32, 37), 4)])
def test_shrink_inside_the_launch_matches_reference(device, dist, num_tokens, in_features, widths, align):
    """The shrink's programs first in the launch, writing y for the GEMM programs' LoRA term: every distribution,
    ranks 1-16 mixed, rows of slot -1, pools with rows anywhere and on 16 bytes; a second launch (the counters reset
    by the first) gives the same output."""
    x, weight, b, lora = _gemm_case(device, torch.float32, num_tokens, in_features, widths, dist, align=align,
                                    inside=True)
    got = skinny_linear(x, weight, b, lora=lora)
    _close(got, ref_skinny_linear(x, weight, b, lora), torch.float32)
    assert not torch.isnan(got).any()
    assert torch.equal(skinny_linear(x, weight, b, lora=lora), got)


@pytest.mark.parametrize("split", [1, 3])
def test_shrink_inside_with_k_splits_and_wide_ranks(device, split):
    """Rank rows of 3 slices x R_max 32 span two shrink programs a slot; the GEMM's tiles split K."""
    x, weight, b, lora = _gemm_case(device, torch.float32, 10, 160, (32, 16, 16), "powerlaw", align=4, inside=True,
                                    max_rank=32, rank_choices=(8, 32))
    cfg = {**gemm_config(10, 64, 160), "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split}
    _close(skinny_linear(x, weight, b, config=cfg, lora=lora), ref_skinny_linear(x, weight, b, lora), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dist", ["distinct", "powerlaw", "some_none"])
def test_fused_lora_gemm_in_16_bits(device, dtype, dist):
    """Tensor-core dots: y rounded to the pool's dtype before its dot with B^T, as PEFT rounds x @ A^T."""
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); checked on GPU only")
    for inside in (False, True):
        x, weight, b, lora = _gemm_case(device, dtype, 24, 128, (64, 32, 32), dist, align=8, inside=inside)
        got = skinny_linear(x, weight, b, lora=lora)
        assert got.dtype == dtype
        _close(got, ref_skinny_linear(x, weight, b, lora), dtype)


@pytest.mark.parametrize("align", [1, 4])
def test_both_pool_alignments_take_their_path_and_agree(device, align):
    """Rows at any offset (plain loads) and rows all on 16 bytes (the paged layout: vectorised loads): step_slots[1]
    says which, and both give the reference's result."""
    x, weight, b, lora = _gemm_case(device, torch.float32, 12, 64, (32, 16, 16), "powerlaw", align=align)
    offsets = lora.b_row_offsets[lora.b_row_offsets >= 0]
    assert int(lora.step_slots[1]) == int(bool((offsets % 4 == 0).all()))
    if align == 4:
        assert int(lora.step_slots[1]) == 1
    else:
        assert int(lora.step_slots[1]) == 0, "the case should hold a row off 16 bytes"
    _close(skinny_linear(x, weight, b, lora=lora), ref_skinny_linear(x, weight, b, lora), torch.float32)


@pytest.mark.parametrize("split, block_n", [(1, 16), (2, 32), (3, 64), (8, 16)])
def test_k_splits_add_the_term_once(device, split, block_n):
    """With K split, the last split to finish adds the LoRA term after the partial sums: once, whichever it is; a
    second launch over the same workspace gives the same result (its counters were reset)."""
    x, weight, b, lora = _gemm_case(device, torch.float32, 9, 200, (32, 32), "some_none")
    cfg = {**gemm_config(9, 64, 200), "BLOCK_N": block_n, "BLOCK_K": 16, "SPLIT_K": split}
    got = skinny_linear(x, weight, b, config=cfg, lora=lora)
    _close(got, ref_skinny_linear(x, weight, b, lora), torch.float32)
    assert torch.equal(skinny_linear(x, weight, b, config=cfg, lora=lora), got)


def test_no_bias_and_rank_one_tables(device):
    x, weight, b, lora = _gemm_case(device, torch.float32, 5, 48, (16,), "distinct", bias=False, rank_choices=(1,))
    assert b is None
    _close(skinny_linear(x, weight, None, lora=lora), ref_skinny_linear(x, weight, None, lora), torch.float32)


@pytest.mark.parametrize("max_rank, rank_choices", [(12, (3, 12)), (5, (1, 5)), (32, (8, 32))])
def test_tables_of_any_max_rank(device, max_rank, rank_choices):
    """R_max not a power of two (y read through a wider block, masked at each row's rank), and larger than 16 (one
    slot per chunk of 32 pairs)."""
    x, weight, b, lora = _gemm_case(device, torch.float32, 11, 48, (32, 16), "powerlaw", rank_choices=rank_choices,
                                    max_rank=max_rank)
    _close(skinny_linear(x, weight, b, lora=lora), ref_skinny_linear(x, weight, b, lora), torch.float32)


def test_column_block_keeps_tiles_within_one_slice():
    assert lora_block_n((4096, 1024, 1024), 64) == 64
    assert lora_block_n((14336, 14336), 128) == 128
    assert lora_block_n((48, 16, 16), 64) == 16
    assert lora_block_n((32, 37), 64) == 32  # the last slice may end anywhere
    assert lora_block_n((24, 24), 64) == 0  # 24 columns: no block of 16 or more stays inside


def test_unfusable_slices_are_refused_by_name(device):
    x, weight, b, lora = _gemm_case(device, torch.float32, 4, 32, (40, 8), "one")
    with pytest.raises(ValueError, match=r"widths \(40, 8\)"):
        skinny_linear(x, weight, b, lora=lora)


def test_mismatched_tables_are_refused(device):
    x, weight, b, lora = _gemm_case(device, torch.float32, 4, 32, (32, 16), "one")
    with pytest.raises(ValueError, match="lora.widths"):
        skinny_linear(x, weight, b, lora=dataclasses.replace(lora, widths=(16, 16)))
    with pytest.raises(ValueError, match="lora.y must have shape"):
        skinny_linear(x[:3], weight, b, lora=lora)


@pytest.mark.parametrize("seed", range(4))
def test_step_slots_list_the_distinct_slots_first(device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = int(torch.randint(1, 12, (1,), generator=gen))
    slots = torch.randint(-1, num_slots, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
    offsets = torch.randint(0, 1000, (2, num_slots, 4), generator=gen) * 8
    offsets[0, 0, 3] = -1
    got = build_step_slots(slots.to(torch.int32).to(device), num_slots, offsets.to(device), 8).cpu().tolist()
    present = sorted(set(slots.tolist()) - {-1})
    assert got[0] == len(present)
    assert got[1] == 1
    assert got[2:2 + len(present)] == present
    assert sorted(got[2:]) == list(range(num_slots))
    offsets[1, -1, 0] += 3
    assert int(build_step_slots(slots.to(torch.int32).to(device), num_slots, offsets.to(device), 8)[1]) == 0


def test_step_rows_list_each_distinct_slots_rank_rows_in_order(device):
    """build_step_rows: slot u's rows at u * r_block + k, -1 past its rank and in the padding; every layer at once."""
    gen = torch.Generator().manual_seed(11)
    num_slots, max_rank = 6, 12
    offsets = torch.randint(0, 10**6, (3, 2, num_slots, max_rank), generator=gen)
    ranks = torch.randint(1, max_rank + 1, (3, 2, num_slots), generator=gen).to(torch.int32)
    slots = torch.tensor([4, -1, 1, 4, 0], dtype=torch.int32)
    step_slots = build_step_slots(slots.to(device), num_slots, offsets.to(device), 8)
    got = build_step_rows(offsets.to(device), ranks.to(device), step_slots, 16).cpu()
    assert got.shape == (3, 2, num_slots * 16)
    order = step_slots.cpu()[2:].tolist()
    for u, slot in enumerate(order):
        for k in range(16):
            want = offsets[..., slot, k] if k < max_rank else torch.full((3, 2), -1)
            want = torch.where(k < ranks[..., slot], want, -1) if k < max_rank else want
            assert torch.equal(got[..., u * 16 + k], want), (u, slot, k)
    with pytest.raises(ValueError, match="r_block 8"):
        build_step_rows(offsets, ranks, step_slots.cpu(), 8)
