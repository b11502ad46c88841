"""Next-token choice per request: greedy, or seeded temperature / top-k / top-p sampling.

Each request draws from its own torch.Generator, so a seeded request gives the same
tokens whatever else shares its batch. A temperature below GREEDY_BELOW is greedy (as in
vLLM): dividing logits by a denormal temperature overflows to inf and NaN probabilities.

A row's logits differ by a few 1e-7 with the batch it was computed in (matrix products block
differently by batch size). Two tokens whose logits tie or nearly tie at the top-k / top-p
boundary would then swap between batches, and a seeded draw would change with its neighbours.
So sampling works on the tempered logits rounded to LOGIT_GRID (2^-14, a relative change of
the probabilities below 1e-4), and ties keep token-id order: a near-tie becomes an exact tie,
broken the same way in every batch.
"""

from __future__ import annotations

import torch

from manylora.engine.requests.types import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this are greedy
LOGIT_GRID = 2.0**-14  # sampled (tempered) logits are rounded to multiples of this


def is_greedy(params: SamplingParams) -> bool:
    """Whether the request takes the argmax: temperature 0, or too small to divide by."""
    return params.temperature < GREEDY_BELOW


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def rounded(logits: torch.Tensor) -> torch.Tensor:
    """logits [V] rounded to multiples of LOGIT_GRID (those too large to scale stay as they are)."""
    grid = torch.round(logits / LOGIT_GRID) * LOGIT_GRID
    return torch.where(torch.isfinite(grid), grid, logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] with everything outside the top-k and the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)  # ties in token-id order
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep a token if the mass before it is below top_p (the first token always stays)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from float32 logits [V]; raises ValueError if the logits give no distribution
    (NaN or all -inf), which fails this request alone."""
    if is_greedy(params):
        return int(torch.argmax(logits).item())
    scaled = filter_logits(rounded(logits.float().cpu() / params.temperature), params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"no distribution to sample from at temperature {params.temperature} "
                         f"(non-finite probabilities)")
    return int(torch.multinomial(probs, 1, generator=generator).item())
