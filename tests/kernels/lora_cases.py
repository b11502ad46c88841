"""Random LoRA cases for the kernel tests: adapter matrices written rank row by rank row into a flat pool at
shuffled, gapped offsets (the gaps hold random values too), token-to-slot assignments of several distributions,
and the dense result to compare against. Every case draws fresh data from its own seed."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

TOL = {"rtol": 1e-4, "atol": 1e-4}
RANK_CHOICES = (1, 4, 8, 16)
DISTS = ("distinct", "one", "powerlaw", "some_none", "all_none")


def seed_of(*key: object) -> int:
    return zlib.crc32(repr(key).encode())


@dataclass
class LoraCase:
    x: torch.Tensor  # [T, in]
    pool: torch.Tensor
    a_dense: torch.Tensor  # fp32 [NS, S, R_max, in] (zero past the rank)
    b_dense: list[torch.Tensor]  # per slice fp32 [S, out_i, R_max] (zero past the rank)
    a_row_offsets: torch.Tensor  # int64 [NS, S, R_max]
    b_row_offsets: torch.Tensor
    ranks: torch.Tensor  # int32 [NS, S]
    scalings: torch.Tensor  # fp32 [NS, S]
    token_slots: torch.Tensor  # int32 [T]
    slice_bounds: list[int]  # [NS + 1]
    gen: torch.Generator


def token_slots_for(dist: str, num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(token_slots int32 [T], number of slots S)."""
    if dist == "distinct":
        num_slots = num_tokens
        slots = torch.randperm(num_tokens, generator=gen)
    elif dist == "one":
        num_slots = 4
        slots = torch.full((num_tokens,), int(torch.randint(num_slots, (1,), generator=gen)))
    elif dist in ("powerlaw", "some_none"):
        num_slots = 6
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
        slots = torch.randperm(num_slots, generator=gen)[slots]  # the popular slot is not always 0
        if dist == "some_none":
            none = torch.rand(num_tokens, generator=gen) < 0.35
            none[0] = True
            slots = torch.where(none, torch.full_like(slots, -1), slots)
    elif dist == "all_none":
        num_slots = 3
        slots = torch.full((num_tokens,), -1)
    else:
        raise ValueError(dist)
    return slots.to(torch.int32), num_slots


def make_case(
    seed: int,
    num_tokens: int,
    in_features: int,
    out_widths: list[int],
    dist: str,
    device: str,
    max_rank: int = 16,
    rank_choices: tuple[int, ...] = RANK_CHOICES,
    dtype: torch.dtype = torch.float32,
    align: int = 1,
) -> LoraCase:
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(out_widths)
    token_slots, num_slots = token_slots_for(dist, num_tokens, gen)
    choices = torch.tensor(rank_choices)
    ranks = choices[torch.randint(len(rank_choices), (num_slices, num_slots), generator=gen)].to(torch.int32)
    scalings = (0.5 + 1.5 * torch.rand(num_slices, num_slots, generator=gen)).float()

    a_dense = torch.zeros(num_slices, num_slots, max_rank, in_features)
    b_dense = [torch.zeros(num_slots, w, max_rank) for w in out_widths]
    rows = []  # (kind, slice, slot, k, length)
    for i in range(num_slices):
        for s in range(num_slots):
            r = int(ranks[i, s])
            a_dense[i, s, :r] = torch.randn(r, in_features, generator=gen) / in_features**0.5
            b_dense[i][s, :, :r] = torch.randn(out_widths[i], r, generator=gen)
            rows += [("a", i, s, k, in_features) for k in range(r)]
            rows += [("b", i, s, k, out_widths[i]) for k in range(r)]
    # paged placement: shuffled row order, random gaps of garbage between rows
    order = torch.randperm(len(rows), generator=gen).tolist()
    gaps = torch.randint(0, 9, (len(rows) + 1,), generator=gen).tolist()
    if align > 1:  # every row starts on a multiple of ``align`` elements
        gaps = [g * align + (-rows[order[j]][4] % align if j < len(order) else 0) for j, g in enumerate(gaps)]
    total = sum(r[4] for r in rows) + sum(gaps)
    pool = torch.randn(total, generator=gen) * 3.0
    a_offs = torch.full((num_slices, num_slots, max_rank), -1, dtype=torch.int64)
    b_offs = torch.full((num_slices, num_slots, max_rank), -1, dtype=torch.int64)
    pos = gaps[-1]
    for j, idx in enumerate(order):
        kind, i, s, k, length = rows[idx]
        if kind == "a":
            pool[pos : pos + length] = a_dense[i, s, k]
            a_offs[i, s, k] = pos
        else:
            pool[pos : pos + length] = b_dense[i][s, :, k]
            b_offs[i, s, k] = pos
        pos += length + gaps[j]
    # the dense copies hold exactly what the pool holds, in its dtype
    pool = pool.to(dtype)
    a_dense = a_dense.to(dtype).float()
    b_dense = [b.to(dtype).float() for b in b_dense]
    bounds = [0]
    for w in out_widths:
        bounds.append(bounds[-1] + w)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    return LoraCase(
        x=x.to(device),
        pool=pool.to(device),
        a_dense=a_dense,
        b_dense=b_dense,
        a_row_offsets=a_offs.to(device),
        b_row_offsets=b_offs.to(device),
        ranks=ranks.to(device),
        scalings=scalings.to(device),
        token_slots=token_slots.to(device),
        slice_bounds=bounds,
        gen=gen,
    )


def dense_lora(case: LoraCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(shrink [NS, T, R_max], delta [T, total]) straight from the dense matrices (CPU fp32)."""
    slots = case.token_slots.cpu().long()
    active = slots >= 0
    sel = slots.clamp(min=0)
    x = case.x.cpu().float()
    ns = case.a_dense.shape[0]
    shrink = torch.stack([torch.einsum("tri,ti->tr", case.a_dense[i, sel], x) for i in range(ns)])
    deltas = []
    for i in range(ns):
        b = case.b_dense[i][sel]  # [T, out_i, R]
        scal = case.scalings.cpu()[i, sel][:, None]
        deltas.append(scal * torch.einsum("tor,tr->to", b, shrink[i]))
    delta = torch.cat(deltas, dim=1) * active[:, None]
    return shrink, delta


def poisoned(shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
