"""Block sizes and K splits of the LoRA shrink / expand launches: the launchers' heuristics, in one place.

``shrink_config`` and ``expand_config`` return a fresh dict (callers may change it) from an LRU-cached choice; the
tests and benchmarks call them to know what the launchers will pick. ``grid_split`` and ``shrink_meta`` turn a shrink
config into the launch's grid split and the kernel's compile-time parameters.
"""

from __future__ import annotations

import functools

import triton

from manylora.kernels.lora_meta import cdiv, sgmv_block_m

__all__ = ["NUM_SMS", "bgmv_tile_expand_config", "expand_config", "grid_split", "shrink_config", "shrink_meta"]

NUM_SMS = 132  # H200; the heuristics only need the order of magnitude
_TARGET_PROGRAMS = 4 * NUM_SMS


def _split_k(in_features: int, block_k: int, base_programs: int, target: int = _TARGET_PROGRAMS) -> int:
    """K splits so that ``base_programs * split`` reaches ``target``: the smallest divisor of the
    number of K blocks that does (all splits then get the same number of K blocks)."""
    num_k_blocks = cdiv(in_features, block_k)
    want = cdiv(target, max(1, base_programs))
    return next((d for d in range(1, num_k_blocks + 1) if num_k_blocks % d == 0 and d >= want), num_k_blocks)


@functools.lru_cache(maxsize=4096)
def _shrink_config_cached(
    num_tokens: int,
    in_features: int,
    max_rank: int,
    segmented: bool,
    max_seg_len: int = 0,
    num_slices: int = 1,
    num_segments: int = 0,
) -> dict[str, int]:
    """Block sizes and K split for ``lora_shrink`` (a plain heuristic; tl.dot tiles stay >= 16).

    BGMV: one [BLOCK_R, BLOCK_K] tile of adapter rows is about 4096 elements; SPLIT_K splits
    ``in_features`` so the grid (tokens x K splits x slices x rank blocks) has several programs per
    SM. SGMV: tl.dot tiles of BLOCK_M tokens; SPLIT_K likewise when there are few tiles.
    """
    k_cap = max(16, triton.next_power_of_2(in_features))
    if not segmented:
        block_r = min(64, triton.next_power_of_2(max(1, max_rank)))
        block_k = min(k_cap, max(128, min(512, 4096 // block_r)))
        base = num_tokens * num_slices * cdiv(max_rank, block_r)
        # too few programs even with one K block each: smaller tiles, more programs
        while block_k > 128 and base * cdiv(in_features, block_k) < _TARGET_PROGRAMS:
            block_k //= 2
        block_k = min(block_k, k_cap)
        split = _split_k(in_features, block_k, base)
        return {"BLOCK_R": block_r, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4}
    # measured on the H200 (perf/kernels/bench_sgmv_prefill.py --sweep, T = 4096, 8 adapters, rank 16): 32-row
    # tiles and 64-wide K blocks without a K split beat 64 x 128 with 4 splits by 1.6x (q/k/v) and
    # 1.1x (gate/up); atomics cost more than the extra programs gain once there are ~NUM_SMS tiles
    block_m = sgmv_block_m(max_seg_len)
    block_r = min(64, max(16, triton.next_power_of_2(max(1, max_rank))))
    block_k = min(k_cap, 64)
    # tiles: at most one partial tile per segment beyond the rows' own
    tiles = cdiv(num_tokens, block_m) + (num_segments or 1)
    base = tiles * num_slices * cdiv(max_rank, block_r)
    split = _split_k(in_features, block_k, base, target=NUM_SMS)
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4}


def shrink_config(*args, **kwargs) -> dict[str, int]:
    """A fresh copy of the cached heuristic's choice (see ``_shrink_config_cached``): callers may change it."""
    return dict(_shrink_config_cached(*args, **kwargs))


# BGMV expand launches of at most this many output elements (tokens x slices x widest slice) take the tile body:
# measured on the H200 (perf/results/2026-12-01-h200/9_rows, perf/kernels/bench_kernels.py --sweep-expand, rank 16)
# the tile was 0.5-0.7 us faster at 1 token (2.3-3.6 against 2.9-4.3 us) and for o / down at 16 tokens (3.8-4.0
# against 4.4-4.6), the row body faster from q/k/v and gate/up at 16 tokens (4.7 / 6.6 against 4.8 / 8.7 us) up
_BGMV_EXPAND_TILE_MAX_ELEMENTS = 131072


def bgmv_tile_expand_config(num_tokens: int, max_out: int, max_rank: int, num_slices: int) -> dict[str, object]:
    """The BGMV expand's tile body (ROWS False: a [BLOCK_R, BLOCK_N] tile of B^T rows, about 4096 elements, reduced
    over the rank, plain loads); BLOCK_N shrinks (down to 64) while the grid (tokens x N blocks x slices) of a wide
    layer has fewer than ~4 programs per SM."""
    block_r = min(32, triton.next_power_of_2(max(1, max_rank)))
    block_n = max(128, min(512, 4096 // block_r))
    while block_n > 64 and max_out >= 1024 and num_tokens * num_slices * cdiv(max_out, block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    return {"ROWS": False, "BLOCK_R": block_r, "BLOCK_N": min(block_n, max(16, triton.next_power_of_2(max_out))),
            "num_warps": 4}  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _expand_config_cached(
    num_tokens: int, max_out: int, max_rank: int, segmented: bool, max_seg_len: int = 0, num_slices: int = 1
) -> dict[str, object]:
    """Block sizes for ``lora_expand`` (a plain heuristic; tl.dot tiles stay >= 16).

    BGMV: small launches take the tile body (``bgmv_tile_expand_config``); the others stream B^T row by row
    (``bgmv_expand_rows``, ROWS True) with BLOCK_R rank rows unrolled per chunk, 256 columns in one warp (8 bf16 =
    16 bytes a thread) below 128 tokens and 1024 in 4 warps from there (the H200 sweep's best or within 4% of it
    at 16-256 tokens, every projection).
    """
    n_cap = max(16, triton.next_power_of_2(max_out))
    if not segmented:
        if num_tokens * num_slices * max_out <= _BGMV_EXPAND_TILE_MAX_ELEMENTS:
            return bgmv_tile_expand_config(num_tokens, max_out, max_rank, num_slices)
        block_n, warps = (256, 1) if num_tokens < 128 else (1024, 4)
        return {"ROWS": True, "BLOCK_R": min(16, triton.next_power_of_2(max(1, max_rank))),
                "BLOCK_N": min(block_n, n_cap), "num_warps": warps}  # fmt: skip
    # H200 sweep (perf/kernels/bench_sgmv_prefill.py --sweep, T = 4096, 8 adapters): 32 x 128 tiles, 4 warps
    block_m = sgmv_block_m(max_seg_len)
    return {"BLOCK_M": block_m, "BLOCK_R": 16, "BLOCK_N": min(128, n_cap), "num_warps": 4}


def expand_config(*args, **kwargs) -> dict[str, object]:
    """A fresh copy of the cached heuristic's choice (see ``_expand_config_cached``): callers may change it."""
    return dict(_expand_config_cached(*args, **kwargs))


def shrink_meta(cfg: dict[str, int], always_atomic: bool = False) -> dict[str, int]:
    """The kernel's compile-time parameters of a config: SPLIT_K becomes the ATOMIC flag (the split
    itself is a runtime argument). The SGMV form always adds atomically into its zeroed output, so
    that whether a step happens to need no split does not compile a second variant."""
    meta = {k: v for k, v in cfg.items() if k != "SPLIT_K"}
    meta["ATOMIC"] = always_atomic or cfg["SPLIT_K"] > 1
    return meta


def grid_split(cfg: dict[str, int], in_features: int, max_rank: int) -> tuple[int, int, int]:
    """(rank blocks, K elements per split, number of splits) for a config; fixes cfg["SPLIT_K"]."""
    block_k = cfg["BLOCK_K"]
    num_k_blocks = cdiv(in_features, block_k)
    blocks_per_split = cdiv(num_k_blocks, max(1, min(int(cfg.get("SPLIT_K", 1)), num_k_blocks)))
    split_k = cdiv(num_k_blocks, blocks_per_split)
    cfg["SPLIT_K"] = split_k
    return cdiv(max_rank, cfg["BLOCK_R"]), blocks_per_split * block_k, split_k
