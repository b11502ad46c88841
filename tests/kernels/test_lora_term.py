"""The consumers' own LoRA expand (kernels/lora_term.LoraFactors): residual add + RMSNorm, silu * up and RoPE + KV
write given a projection's LoRA term as its factors give what they give with the term written out by the BGMV
expand's overwrite form, on fresh random paged adapters (mixed ranks, tokens without an adapter, rows on 16 bytes or
not)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import DISTS, make_case, seed_of

from kernels.add_rms_norm import add_rms_norm
from kernels.lora_expand import lora_expand
from kernels.lora_term import LoraFactors
from kernels.rope_kv import rope_kv_write
from kernels.silu_mul import silu_mul


def _factors(case, dtype):
    """The case's factors, y random where the shrink would write it and NaN where nothing may read it (past each
    slot's rank, rows of tokens without an adapter)."""
    num_slices, num_slots, max_rank = case.b_row_offsets.shape
    num_tokens = case.token_slots.shape[0]
    y = torch.randn(num_slices, num_tokens, max_rank, generator=case.gen)
    slots = case.token_slots.cpu().long()
    ranks = case.ranks.cpu()
    for i in range(num_slices):
        for t in range(num_tokens):
            live = int(ranks[i, slots[t]]) if slots[t] >= 0 else 0
            y[i, t, live:] = float("nan")
    widths = tuple(e - b for b, e in zip(case.slice_bounds, case.slice_bounds[1:], strict=False))
    device = case.pool.device
    return LoraFactors(y.to(device), case.pool, case.b_row_offsets, case.ranks, case.scalings, case.token_slots,
                       widths)


def _written_out(f: LoraFactors) -> torch.Tensor:
    """The term as the deferred expand writes it (the BGMV kernel's overwrite form)."""
    out = torch.full((f.num_tokens, sum(f.widths)), float("nan"), device=f.y.device)
    bounds = [0]
    for w in f.widths:
        bounds.append(bounds[-1] + w)
    return lora_expand(f.y, f.pool, f.b_row_offsets, f.ranks, f.scalings, f.token_slots, out, bounds, overwrite=True)


def _assert_same(got, want, device):
    """Interpreted: equal. Compiled, the consumer may fuse the scaling's product into its add (one fp32 rounding
    fewer than the buffer's store and add): within one step of the output dtype."""
    if device == "cpu":
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0)
    else:
        step = 2.0**-7 if got.dtype == torch.bfloat16 else 2.0**-20
        diff = (got.float() - want.float()).abs().cpu()
        assert float((diff / (want.float().abs().cpu().clamp(min=1e-30) * step)).max()) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("tokens, width, align", [(1, 64, 8), (7, 100, 1), (13, 256, 8), (5, 4096, 8)])
def test_add_rms_norm_expands_the_factors_as_the_expand_writes_them(device, dtype, dist, tokens, width, align):
    case = make_case(seed_of("norm", dtype, dist, tokens, width, align), tokens, 8, [width], dist, device,
                     dtype=dtype, align=align)
    f = _factors(case, dtype)
    gen = case.gen
    x = torch.randn(tokens, width, generator=gen).to(dtype).to(device)
    delta = torch.randn(tokens, width, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype).to(device)
    got_out, got_sum = add_rms_norm(x, delta, weight, 1e-5, lora_delta=f)
    buffer = _written_out(f)
    want_out, want_sum = add_rms_norm(x, delta, weight, 1e-5, lora_delta=buffer)
    _assert_same(got_sum, want_sum, device)
    _assert_same(got_out, want_out, device)
    # and the factors' torch form is that term
    torch.testing.assert_close(f.materialize().cpu(), buffer.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffer.cpu(), dense_term(case, f), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("tokens, width, align", [(1, 24, 8), (6, 1000, 1), (4, 1536, 8), (3, 1030, 8)])
def test_silu_mul_expands_the_factors_as_the_expand_writes_them(device, dtype, dist, tokens, width, align):
    case = make_case(seed_of("silu", dtype, dist, tokens, width, align), tokens, 8, [width, width], dist, device,
                     dtype=dtype, align=align)
    f = _factors(case, dtype)
    gate_up = (3 * torch.randn(tokens, 2 * width, generator=case.gen)).to(dtype).to(device)
    got = silu_mul(gate_up, f)
    buffer = _written_out(f)
    _assert_same(got, silu_mul(gate_up, buffer), device)
    torch.testing.assert_close(f.materialize().cpu(), buffer.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffer.cpu(), dense_term(case, f), rtol=1e-4, atol=1e-4)
    if bool((case.token_slots >= 0).any()):  # the term moved the result
        assert not torch.equal(got.cpu(), silu_mul(gate_up).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dist", ["distinct", "powerlaw", "some_none"])
@pytest.mark.parametrize("tokens, num_q, num_kv, head_dim, norm, align", [
    (3, 4, 2, 8, False, 8), (5, 3, 1, 24, True, 1), (2, 6, 6, 10, False, 8), (4, 32, 8, 128, False, 8)])
def test_rope_kv_write_expands_the_factors_as_the_expand_writes_them(device, dtype, dist, tokens, num_q, num_kv,
                                                                     head_dim, norm, align):
    """q's, k's and v's terms from slices 0, 1, 2 (heads of widths that are not powers of two included: padded
    columns must not read the next head's), rotated q and the cache's k and v as with the written-out term."""
    widths = [num_q * head_dim, num_kv * head_dim, num_kv * head_dim]
    case = make_case(seed_of("rope", dtype, dist, tokens, num_q, head_dim, align), tokens, 8, widths, dist, device,
                     dtype=dtype, align=align)
    f = _factors(case, dtype)
    gen = case.gen
    qkv = torch.randn(tokens, sum(widths), generator=gen).to(dtype)
    max_len, pages, page_size, layers = 20, 4, 4, 2
    cos = torch.randn(max_len, head_dim, generator=gen).to(dtype).to(device)
    sin = torch.randn(max_len, head_dim, generator=gen).to(dtype).to(device)
    kv = torch.randn(pages, layers, 2, page_size, num_kv, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].long().to(device)
    positions = torch.randint(0, max_len, (tokens,), generator=gen).to(device)
    weight = (1 + 0.3 * torch.randn(num_q + num_kv, head_dim, generator=gen)).to(dtype).to(device) if norm else None
    split = (num_q + num_kv) * head_dim

    def run(term):
        out, cache = qkv.clone().to(device), kv.clone().to(device)
        q = rope_kv_write(out[:, :split].view(tokens, num_q + num_kv, head_dim),
                          out[:, split:].view(tokens, num_kv, head_dim), positions, cos, sin, cache, 1, slots, num_q,
                          weight, 1e-6, lora_delta=term)  # fmt: skip
        return q.cpu(), cache.cpu()

    got_q, got_kv = run(f)
    want_q, want_kv = run(_written_out(f))
    _assert_same(got_q, want_q, device)
    _assert_same(got_kv, want_kv, device)
    if bool((case.token_slots >= 0).any()):
        assert not torch.equal(got_kv, run(None)[1])


def dense_term(case, f: LoraFactors) -> torch.Tensor:
    """The term from the case's dense B matrices and the factors' y (CPU fp32)."""
    slots = case.token_slots.cpu().long()
    parts = []
    for i, b_dense in enumerate(case.b_dense):
        term = torch.zeros(len(slots), b_dense.shape[1])
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                r = int(case.ranks[i, s])
                term[t] = float(case.scalings[i, s]) * (b_dense[s, :, :r] @ f.y[i, t, :r].cpu())
        parts.append(term)
    return torch.cat(parts, dim=1)


def test_factors_of_another_shape_are_refused(device):
    case = make_case(seed_of("refuse"), 4, 8, [32, 32], "powerlaw", device)
    f = _factors(case, torch.float32)
    with pytest.raises(ValueError, match="widths"):
        silu_mul(torch.randn(4, 2 * 40, device=device), f)
    with pytest.raises(ValueError, match="lora y must have shape"):
        add_rms_norm(torch.randn(4, 32, device=device), torch.randn(4, 32, device=device),
                     torch.ones(32, device=device), 1e-5, lora_delta=f)
