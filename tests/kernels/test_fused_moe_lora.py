"""Fused MoE and fused MoE-LoRA kernels against the torch references.

Every case draws fresh random data from its own seed. Adapter matrices per (slot, expert) are
written rank row by rank row into a flat pool at shuffled, gapped offsets (the gaps hold large
random garbage, so a wrong offset shows). Ranks are mixed per slot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import seed_of, token_slots_for  # noqa: E402

from manylora.kernels.fused_moe import fused_moe, fused_moe_gemm, moe_gemm_config  # noqa: E402
from manylora.kernels.fused_moe_lora import MoeLora, fused_moe_lora_forward  # noqa: E402
from manylora.kernels.moe_align import moe_align_block_size, virtual_expert_ids  # noqa: E402
from manylora.kernels.moe_lora_blocks import moe_lora_expand, moe_lora_shrink  # noqa: E402
from manylora.kernels.reference import ref_fused_moe, ref_fused_moe_lora  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-4}
RANK_CHOICES = (2, 4, 8)
MAX_RANK = 8


@dataclass
class MoeCase:
    x: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    lora: MoeLora
    dense: dict[str, torch.Tensor]  # fp32 CPU: a13 [NS,S,E,R,H], b13 [NS,S,E,W,R], a2 [S,E,R,I], b2 [S,E,H,R]


def make_case(
    seed: int,
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dist: str,
    device: str,
    *,
    num_slices13: int = 1,
    dtype: torch.dtype = torch.float32,
) -> MoeCase:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    topk_ids = topk_ids.reshape(num_tokens, top_k).to(torch.int32)
    topk_weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1).float()

    token_slots, num_slots = token_slots_for(dist, num_tokens, gen)
    choices = torch.tensor(RANK_CHOICES)
    ranks = choices[torch.randint(len(choices), (num_slots,), generator=gen)].to(torch.int32)
    scalings = (0.5 + 1.5 * torch.rand(num_slots, generator=gen)).float()
    ns, S, E, R = num_slices13, num_slots, num_experts, MAX_RANK
    w13_width = 2 * inter // ns
    rmask = (torch.arange(R)[None, :] < ranks[:, None]).float()  # [S, R]
    dense = {
        "a13": torch.randn(ns, S, E, R, hidden, generator=gen) / hidden**0.5 * rmask[None, :, None, :, None],
        "b13": torch.randn(ns, S, E, w13_width, R, generator=gen) * 0.3 * rmask[None, :, None, None, :],
        "a2": torch.randn(S, E, R, inter, generator=gen) / inter**0.5 * rmask[:, None, :, None],
        "b2": torch.randn(S, E, hidden, R, generator=gen) * 0.3 * rmask[:, None, None, :],
    }
    # every rank row of every table: (table, index into the offsets table, row data)
    tables = {
        "a13": (dense["a13"], (ns, S, E, R)),
        "b13": (dense["b13"].transpose(-1, -2), (ns, S, E, R)),  # rows of B^T
        "a2": (dense["a2"], (S, E, R)),
        "b2": (dense["b2"].transpose(-1, -2), (S, E, R)),
    }
    rows = []
    for name, (mat, shape) in tables.items():
        flat = mat.reshape(-1, mat.shape[-1])
        for j, idx in enumerate(torch.cartesian_prod(*[torch.arange(n) for n in shape]).reshape(-1, len(shape))):
            if idx[-1] < ranks[idx[-3]]:  # rank rows only; the slot index sits 3rd from the end
                rows.append((name, tuple(idx.tolist()), flat[j]))
    order = torch.randperm(len(rows), generator=gen).tolist()
    gaps = torch.randint(0, 9, (len(rows) + 1,), generator=gen).tolist()
    total = sum(r[2].numel() for r in rows) + sum(gaps)
    pool = torch.randn(total, generator=gen) * 30.0
    offsets = {name: torch.full(shape, -1, dtype=torch.int64) for name, (_, shape) in tables.items()}
    pos = gaps[-1]
    for j, ridx in enumerate(order):
        name, idx, data = rows[ridx]
        pool[pos : pos + data.numel()] = data
        offsets[name][idx] = pos
        pos += data.numel() + gaps[j]
    if ns == 1 and seed % 2:  # exercise the 3-D form of the w13 tables too
        offsets["a13"], offsets["b13"] = offsets["a13"][0], offsets["b13"][0]
    dense = {k: v.to(dtype).float() for k, v in dense.items()}

    def dev(t):
        return t.to(device)

    lora = MoeLora(
        pool=dev(pool.to(dtype)),
        a13_offsets=dev(offsets["a13"]),
        b13_offsets=dev(offsets["b13"]),
        a2_offsets=dev(offsets["a2"]),
        b2_offsets=dev(offsets["b2"]),
        ranks=dev(ranks),
        scalings=dev(scalings),
        token_slots=dev(token_slots),
    )
    return MoeCase(
        dev(x.to(dtype)), dev(w13.to(dtype)), dev(w2.to(dtype)), dev(topk_ids), dev(topk_weights), lora, dense
    )


def ref_of(case: MoeCase) -> torch.Tensor:
    lo = case.lora
    return ref_fused_moe_lora(
        case.x, case.w13, case.w2, case.topk_ids, case.topk_weights,
        lo.pool, lo.a13_offsets, lo.b13_offsets, lo.a2_offsets, lo.b2_offsets, lo.ranks, lo.scalings, lo.token_slots,
    )  # fmt: skip


def dense_moe_lora(case: MoeCase) -> torch.Tensor:
    """An independent formulation: dense per-pair einsums over the dense adapter tensors."""
    x, ids = case.x.float().cpu(), case.topk_ids.long().cpu()
    w13, w2, d = case.w13.float().cpu(), case.w2.float().cpu(), case.dense
    slots = case.lora.token_slots.long().cpu()
    scal = case.lora.scalings.cpu()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, s = int(ids[t, k]), int(slots[t])
            gu = w13[e] @ x[t]
            if s >= 0:
                gu = gu + scal[s] * torch.cat(
                    [d["b13"][i, s, e] @ (d["a13"][i, s, e] @ x[t]) for i in range(len(d["a13"]))]
                )
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            y = w2[e] @ h
            if s >= 0:
                y = y + scal[s] * (d["b2"][s, e] @ (d["a2"][s, e] @ h))
            out[t] += case.topk_weights[t, k].cpu() * y
    return out


# ----------------------------------------------------------------------------------------------
# Alignment
# ----------------------------------------------------------------------------------------------


def expected_alignment(ids: list[int], num_ids: int, block_m: int, num_pairs: int):
    sorted_ids, blocks = [], []
    for v in range(num_ids):
        pairs = [p for p, i in enumerate(ids) if i == v]
        n = -(-len(pairs) // block_m) * block_m
        sorted_ids += pairs + [num_pairs] * (n - len(pairs))
        blocks += [v] * (n // block_m)
    return sorted_ids, blocks


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m", [(1, 4, 1, 16), (5, 8, 2, 16), (33, 4, 2, 4), (0, 4, 2, 16)]
)
@pytest.mark.parametrize("dist", [None, "distinct", "some_none", "all_none"])
def test_moe_align(num_tokens, num_experts, top_k, block_m, dist):
    gen = torch.Generator().manual_seed(seed_of("align", num_tokens, num_experts, top_k, block_m, dist))
    topk_ids = torch.randint(num_experts, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    num_pairs = num_tokens * top_k
    if dist is None:
        al = moe_align_block_size(topk_ids, num_experts, block_m)
        ids, num_ids = topk_ids.flatten().tolist(), num_experts
    else:
        slots, num_slots = token_slots_for(dist, max(num_tokens, 1), gen)
        slots = slots[:num_tokens]
        al = moe_align_block_size(topk_ids, num_experts, block_m, token_slots=slots, num_slots=num_slots)
        vids = virtual_expert_ids(topk_ids, slots, num_experts).tolist()
        for p, v in enumerate(vids):  # encoding: slot * E + expert, -1 without an adapter
            s = int(slots[p // top_k])
            assert v == (-1 if s < 0 else s * num_experts + int(topk_ids.flatten()[p]))
        ids, num_ids = vids, num_slots * num_experts
    exp_sorted, exp_blocks = expected_alignment(ids, num_ids, block_m, num_pairs)
    used = int(al.num_tokens_post_padded.item())
    assert used == len(exp_sorted)
    assert al.sorted_pair_ids.dtype == torch.int32 and al.block_expert_ids.dtype == torch.int32
    assert al.sorted_pair_ids.numel() == al.max_blocks * block_m >= used
    assert al.sorted_pair_ids[:used].tolist() == exp_sorted
    assert (al.sorted_pair_ids[used:] == num_pairs).all()
    assert al.block_expert_ids[: used // block_m].tolist() == exp_blocks
    assert (al.block_expert_ids[used // block_m :] == -1).all()
    assert al.num_experts == num_ids and al.num_pairs == num_pairs


# ----------------------------------------------------------------------------------------------
# Fused MoE (no LoRA)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter", [(1, 4, 1, 48, 40), (5, 8, 2, 64, 96), (33, 4, 2, 48, 40)]
)
def test_fused_moe_matches_ref(device, num_tokens, num_experts, top_k, hidden, inter):
    case = make_case(seed_of("moe", num_tokens, num_experts, top_k), num_tokens, num_experts, top_k, hidden, inter,
                     "all_none", device)  # fmt: skip
    out = fused_moe(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights)
    ref = ref_fused_moe(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights)
    assert out.shape == (num_tokens, hidden) and out.dtype == case.x.dtype
    torch.testing.assert_close(out, ref, **TOL)


def test_fused_moe_gemm_small_blocks(device):
    """BLOCK_M = 16 with several blocks per expert, BLOCK_N/BLOCK_K smaller than the matrix."""
    case = make_case(seed_of("gemm"), 33, 4, 2, 48, 40, "all_none", device)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4}
    al = moe_align_block_size(case.topk_ids, 4, 16)
    c = torch.full((66, 80), float("nan"), device=device)
    fused_moe_gemm(case.x, case.w13, c, al, rows_div=2, topk_weights=case.topk_weights, config=cfg)
    ids = case.topk_ids.long().flatten()
    ref = torch.einsum("ph,pnh->pn", case.x.repeat_interleave(2, 0), case.w13[ids]) * case.topk_weights.reshape(-1, 1)
    torch.testing.assert_close(c, ref, **TOL)


# ----------------------------------------------------------------------------------------------
# Fused MoE-LoRA
# ----------------------------------------------------------------------------------------------

LORA_GRID = [
    # (T, E, K, H, I, dist, NS13)
    (1, 4, 1, 48, 40, "distinct", 1),
    (1, 8, 2, 64, 96, "one", 2),
    (1, 4, 2, 48, 40, "all_none", 1),
    (5, 8, 2, 48, 40, "distinct", 2),
    (5, 4, 1, 64, 96, "some_none", 1),
    (5, 4, 2, 48, 40, "one", 1),
    (33, 4, 2, 48, 40, "some_none", 2),
    (33, 8, 1, 64, 96, "distinct", 1),
    (33, 8, 2, 48, 40, "one", 1),
    (33, 4, 1, 48, 40, "all_none", 2),
]


@pytest.mark.parametrize("form", ["blocks", "pairs"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,dist,ns13", LORA_GRID)
def test_fused_moe_lora_matches_ref(device, num_tokens, num_experts, top_k, hidden, inter, dist, ns13, form):
    seed = seed_of("lora", num_tokens, num_experts, top_k, hidden, dist, ns13, form)
    case = make_case(seed, num_tokens, num_experts, top_k, hidden, inter, dist, device, num_slices13=ns13)
    out = fused_moe_lora_forward(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights, case.lora,
                                 lora_form=form)
    ref = ref_of(case)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL)
    if dist != "all_none":  # the LoRA is really there
        base = ref_fused_moe(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights)
        assert (ref - base).abs().max() > 1e-2


@pytest.mark.parametrize("dist,ns13", [("some_none", 2), ("distinct", 1)])
def test_reference_matches_dense(dist, ns13):
    case = make_case(seed_of("dense", dist, ns13), 6, 4, 2, 48, 40, dist, "cpu", num_slices13=ns13)
    torch.testing.assert_close(ref_of(case), dense_moe_lora(case), **TOL)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (33, 2)])
def test_no_lora_is_fused_moe_exactly(device, num_tokens, top_k):
    case = make_case(seed_of("exact", num_tokens), num_tokens, 8, top_k, 64, 96, "all_none", device)
    args = (case.x, case.w13, case.w2, case.topk_ids, case.topk_weights)
    base = fused_moe(*args)
    assert torch.equal(fused_moe_lora_forward(*args), base)
    assert torch.equal(fused_moe_lora_forward(*args, None), base)
    for form in ("blocks", "pairs"):  # every token has slot -1
        assert torch.equal(fused_moe_lora_forward(*args, case.lora, lora_form=form), base)


def test_lora_form_default_and_errors(device, monkeypatch):
    """Decode-sized batches take the pair form, larger ones the block form; the env var forces one; both give the
    reference's result on a batch past the threshold."""
    from manylora.kernels import fused_moe_lora as fml

    assert fml._default_form(fml.PAIR_FORM_MAX_PAIRS) == "pairs"
    assert fml._default_form(fml.PAIR_FORM_MAX_PAIRS + 1) == "blocks"
    monkeypatch.setenv("MANYLORA_MOE_LORA_FORM", "blocks")
    assert fml._default_form(1) == "blocks"
    monkeypatch.delenv("MANYLORA_MOE_LORA_FORM")
    case = make_case(seed_of("threshold"), 9, 4, 2, 48, 40, "some_none", device)
    args = (case.x, case.w13, case.w2, case.topk_ids, case.topk_weights, case.lora)
    monkeypatch.setattr(fml, "PAIR_FORM_MAX_PAIRS", 8)  # 18 pairs: past it
    torch.testing.assert_close(fused_moe_lora_forward(*args), ref_of(case), **TOL)
    with pytest.raises(ValueError, match="lora_form"):
        fused_moe_lora_forward(*args, lora_form="rows")


@pytest.mark.parametrize("split_k,block_k", [(1, 16), (3, 16), (2, 32), (8, 16)])
def test_shrink_split_k(device, split_k, block_k):
    """Split-K parts add up (atomic_add into zeros); more splits than K chunks is harmless."""
    case = make_case(seed_of("split", split_k, block_k), 5, 4, 2, 48, 40, "some_none", device, num_slices13=2)
    lo = case.lora
    num_slots = lo.ranks.numel()
    al = moe_align_block_size(case.topk_ids, 4, 16, token_slots=lo.token_slots, num_slots=num_slots)
    cfg = {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4}
    y = torch.zeros(2, 10, MAX_RANK, device=device)
    moe_lora_shrink(case.x, lo.pool, lo.a13_offsets, lo.ranks, al, y, rows_div=2, config=cfg)
    ids, slots = case.topk_ids.long().flatten().cpu(), lo.token_slots.long().cpu().repeat_interleave(2)
    exp = torch.zeros(2, 10, MAX_RANK)
    for p in range(10):
        if slots[p] >= 0:
            exp[:, p] = case.dense["a13"][:, slots[p], ids[p]] @ case.x[p // 2].float().cpu()
    torch.testing.assert_close(y.cpu(), exp, **TOL)

    # expand with a small N tile: columns are split into slices and tiles; slot -1 rows untouched
    out = torch.randn(10, 80, device=device)
    before = out.clone()
    ecfg = {"BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_N": 16, "num_warps": 4}
    moe_lora_expand(y, lo.pool, lo.b13_offsets, lo.ranks, lo.scalings, al, out, config=ecfg)
    for p in range(10):
        s = int(slots[p])
        if s < 0:
            assert torch.equal(out[p], before[p])
            continue
        d = torch.cat([case.dense["b13"][i, s, ids[p]] @ exp[i, p] for i in range(2)]) * lo.scalings[s].cpu()
        torch.testing.assert_close(out[p].cpu(), before[p].cpu() + d, **TOL)


@pytest.mark.parametrize("split_k,block_k", [(1, 16), (3, 16), (8, 16)])
def test_pair_shrink_split_k_and_untouched_rows(device, split_k, block_k):
    """The pair form: split-K parts add up (zeroed by the launcher), one split overwrites garbage; slot -1 pairs
    and entries past a slot's rank are left as they were, and the expand leaves slot -1 rows alone."""
    from manylora.kernels.moe_lora_pairs import moe_lora_expand_pairs, moe_lora_shrink_pairs

    case = make_case(seed_of("pairs", split_k, block_k), 5, 4, 2, 48, 40, "some_none", device, num_slices13=2)
    lo = case.lora
    y = torch.full((2, 10, MAX_RANK), 7.0, device=device)  # garbage where nothing is written
    cfg = {"BLOCK_R": 16, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4}
    moe_lora_shrink_pairs(case.x, lo.pool, lo.a13_offsets, lo.ranks, case.topk_ids, lo.token_slots, y, rows_div=2,
                          config=cfg)  # fmt: skip
    ids, slots = case.topk_ids.long().flatten().cpu(), lo.token_slots.long().cpu().repeat_interleave(2)
    ranks = lo.ranks.cpu()
    assert (slots < 0).any() and (slots >= 0).any()
    for p in range(10):
        s = int(slots[p])
        if s < 0:
            if split_k == 1:
                assert torch.equal(y[:, p].cpu(), torch.full((2, MAX_RANK), 7.0))
            continue
        r = int(ranks[s])
        exp = case.dense["a13"][:, s, ids[p]] @ case.x[p // 2].float().cpu()
        torch.testing.assert_close(y[:, p, :r].cpu(), exp[:, :r], **TOL)
    out = torch.randn(10, 80, device=device)
    before = out.clone()
    moe_lora_expand_pairs(y, lo.pool, lo.b13_offsets, lo.ranks, lo.scalings, case.topk_ids, lo.token_slots, out,
                          config={"BLOCK_R": 16, "BLOCK_N": 16, "num_warps": 4})  # fmt: skip
    for p in range(10):
        s = int(slots[p])
        if s < 0:
            assert torch.equal(out[p], before[p])
            continue
        r = int(ranks[s])
        d = torch.cat([case.dense["b13"][i, s, ids[p]][:, :r] @ y[i, p, :r].cpu() for i in range(2)])
        torch.testing.assert_close(out[p].cpu(), before[p].cpu() + d * lo.scalings[s].cpu(), **TOL)


def test_gemm_config_block_m_drives_alignment(device):
    case = make_case(seed_of("cfg"), 33, 4, 2, 48, 40, "some_none", device)
    cfg = moe_gemm_config(66, 4, 80, 48)
    assert cfg["BLOCK_M"] == 32
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4}
    out = fused_moe_lora_forward(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights, case.lora, config=small)
    torch.testing.assert_close(out, ref_of(case), **TOL)


@pytest.mark.parametrize("form", ["blocks", "pairs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device, dtype, form):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); checked on GPU only")
    case = make_case(seed_of("half", str(dtype)), 5, 4, 2, 48, 40, "some_none", device, dtype=dtype)
    out = fused_moe_lora_forward(case.x, case.w13, case.w2, case.topk_ids, case.topk_weights, case.lora,
                                 lora_form=form)
    assert out.dtype == dtype
    ref = ref_of(case).float()
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_empty_batch(device):
    case = make_case(seed_of("empty"), 1, 4, 2, 48, 40, "one", device)
    lo = case.lora
    empty = MoeLora(lo.pool, lo.a13_offsets, lo.b13_offsets, lo.a2_offsets, lo.b2_offsets, lo.ranks, lo.scalings,
                    lo.token_slots[:0])  # fmt: skip
    out = fused_moe_lora_forward(case.x[:0], case.w13, case.w2, case.topk_ids[:0], case.topk_weights[:0], empty)
    assert out.shape == (0, 48)


def test_argument_errors(device):
    case = make_case(seed_of("errors"), 5, 4, 2, 48, 40, "some_none", device)
    args = (case.x, case.w13, case.w2, case.topk_ids, case.topk_weights)
    lo = case.lora
    with pytest.raises(ValueError, match="w2"):
        fused_moe(case.x, case.w13, case.w2[:, :, :-1], case.topk_ids, case.topk_weights)
    with pytest.raises(TypeError, match="topk_weights"):
        fused_moe(*args[:4], case.topk_weights.double())
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(*args[:3], case.topk_ids[:-1], case.topk_weights)
    bad = MoeLora(lo.pool, lo.a13_offsets, lo.b13_offsets, lo.a2_offsets[:, :3], lo.b2_offsets, lo.ranks,
                  lo.scalings, lo.token_slots)  # fmt: skip
    with pytest.raises(ValueError, match="experts|a2_offsets"):
        fused_moe_lora_forward(*args, bad)
    bad = MoeLora(lo.pool, lo.a13_offsets, lo.b13_offsets, lo.a2_offsets, lo.b2_offsets, lo.ranks,
                  lo.scalings, lo.token_slots[:-1])  # fmt: skip
    with pytest.raises(ValueError, match="token_slots"):
        fused_moe_lora_forward(*args, bad)
    bad = MoeLora(lo.pool, lo.a13_offsets, lo.b13_offsets, lo.a2_offsets, lo.b2_offsets, lo.ranks.long(),
                  lo.scalings, lo.token_slots)  # fmt: skip
    with pytest.raises(TypeError, match="ranks"):
        fused_moe_lora_forward(*args, bad)
    al = moe_align_block_size(case.topk_ids, 4, 16)  # not a virtual-expert alignment
    y = torch.zeros(1, 10, MAX_RANK, device=device)
    with pytest.raises(ValueError, match="virtual"):
        moe_lora_shrink(case.x, lo.pool, lo.a2_offsets, lo.ranks, al, y, rows_div=2)
    with pytest.raises(ValueError, match="num_slots"):
        moe_align_block_size(case.topk_ids, 4, 16, token_slots=lo.token_slots)


def test_lengths_not_specialised():
    """Token counts must not be compile-time specialised (one compile serves every batch size)."""
    import inspect

    from manylora.kernels import fused_moe as fm
    from manylora.kernels import fused_moe_lora as fml
    from manylora.kernels import moe_lora_blocks as blocks
    from manylora.kernels import moe_lora_pairs as pairs

    for mod in (fm, fml, blocks, pairs):
        src = inspect.getsource(mod)
        for line in src.splitlines():
            if line.startswith("@triton.jit"):
                assert 'do_not_specialize=["num_pairs"]' in line, line
