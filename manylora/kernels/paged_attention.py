"""Paged decode attention (one query token per sequence) with grouped-query attention.

The KV cache lives in the flat ``pool`` shared with the adapter rows. Page p holds, for all
layers, a contiguous block ``[num_layers, 2 (k, v), page_size, num_kv_heads, head_dim]`` that
starts at pool element ``p * page_elems`` (page_elems = num_layers*2*page_size*num_kv_heads*head_dim).
Token position t of sequence b lives in page ``block_tables[b, t // page_size]``, slot
``t % page_size``.

One program per (sequence, kv head) handles all ``group`` query heads that share the kv head,
so each K/V row is read once per sequence; online softmax in fp32, one pass over the sequence.

Split over the context (flash-decoding): batch x kv heads programs leave most of the GPU idle
when they are fewer than its SMs (one sequence of 8 kv heads: 8 programs, ~190 GB/s on the
H200). With ``SPLITS`` > 1 each (sequence, kv head) takes SPLITS programs, each over one
contiguous run of whole BLOCK_N blocks of the sequence (sized from its length in the kernel, so
any lengths share one launch, and a CUDA graph replays it for new lengths); each writes its
un-normalised partial output, running max and sum (fp32), and a second kernel merges the
SPLITS partials of each head. ``attention_splits`` picks SPLITS from the batch size and the
device's SM count alone (a captured step does not know its lengths): 1 once the batch alone
makes more programs than the GPU has SMs, so large batches run the one-pass kernel unchanged.

With ``table_rows`` a query row reads the block table of another row index: the tokens of a
prefill chunk then attend in the same launch, each as a "decode" of its own position (its
seq_len is its position + 1, its table the chunk's sequence's), so a step's attention is one
launch whatever its mix (no per-sequence gathers). Each query row reads its keys on its own;
long prompts re-read them once per token (from L2 for the most part).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_meta import FLOAT_DTYPES, check_tensor
from manylora.kernels.relaunch import relauncher

__all__ = ["paged_decode_attention", "attention_config", "attention_splits"]

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["layer", "stride_btb"])
def _paged_decode_attention_kernel(
    # pointers
    q_ptr,  # [B, H, D]
    pool_ptr,  # flat pool
    block_tables_ptr,  # int32 [S, max_blocks] (S = B without table_rows)
    table_rows_ptr,  # int32 [B]: block-table row of each query row (read only with HAS_TABLE_ROWS)
    seq_lens_ptr,  # int32 [B]
    out_ptr,  # [B, H, D] (written with SPLITS == 1)
    part_out_ptr,  # fp32 [B, H, SPLITS, BLOCK_D]: each split's un-normalised output (written with SPLITS > 1)
    part_stats_ptr,  # fp32 [B, H, SPLITS, 2]: each split's running max (log2 domain) and sum of exponentials
    # sizes
    layer,
    head_dim,
    qk_scale,  # softmax scale * log2(e)
    # strides
    stride_qb,
    stride_qh,
    stride_qd,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    stride_od,
    stride_page,  # pool elements per page (all layers)
    stride_layer,
    stride_kv,  # k -> v
    stride_slot,  # one token (all kv heads)
    # meta-parameters
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_TABLE_ROWS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLITS == 1:
        lo = 0
        hi = seq_len
    else:  # this program's run of whole blocks: cdiv(blocks, SPLITS) of them, the last runs shorter or empty
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), SPLITS) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(seq_len, lo + per_split)
    table_row = tl.load(table_rows_ptr + seq).to(tl.int64) if HAS_TABLE_ROWS else seq

    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    heads = (kv_head * GROUP + offs_g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # element offset of (layer, k, slot 0, kv_head, 0) inside any page
    head_base = layer.to(tl.int64) * stride_layer + kv_head.to(tl.int64) * head_dim

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        pages = tl.load(
            block_tables_ptr + table_row * stride_btb + (offs_n // PAGE_SIZE) * stride_btn,
            mask=n_mask,
            other=0,
        ).to(tl.int64)
        kv_offs = pages * stride_page + head_base + (offs_n % PAGE_SIZE).to(tl.int64) * stride_slot
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(pool_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pool_ptr + stride_kv + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLITS == 1:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0: output zeros, not NaN
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:  # an empty run leaves max -inf, sum 0 and a zero output: the merge gives it no weight
        part = (seq * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_stats_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _paged_attention_merge_kernel(
    part_out_ptr,  # fp32 [B, H, SPLITS, BLOCK_D]
    part_stats_ptr,  # fp32 [B, H, SPLITS, 2]
    out_ptr,  # [B, H, D]
    head_dim,
    stride_ob,
    stride_oh,
    stride_od,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits s of (b, h), M = max_s m_s."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    part = (seq * tl.num_programs(1) + head) * SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_stats_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_stats_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # all -inf (seq_len 0): no weights, a zero output
    w = tl.exp2(m - m_max)  # 0 for the empty runs' -inf
    acc = tl.load(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w * l_s, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def attention_config(group: int, head_dim: int, page_size: int) -> dict[str, int]:
    """Block sizes for ``paged_decode_attention`` (tl.dot tiles stay >= 16); the context splits are
    ``attention_splits``' (a config may name them: "SPLITS")."""
    return {
        "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "BLOCK_N": max(64, triton.next_power_of_2(page_size)),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "num_warps": 4,
    }


# Context splits: (sequence, kv head, split) programs up to PROGRAMS_PER_SM on every SM, at most MAX_SPLITS splits.
# On the H200 (132 SMs, 8 kv heads) the fastest count of 1-32 at 512-32,768 tokens was the one that made ~256
# programs, at every batch of 1-32 sequences (perf/results/2026-12-03-h200/1_splits/)
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
# MANYLORA_ATTENTION_SPLITS=n: n splits at every batch size (1: never split; perf/engine/bench_decode_step.py
# --attention-splits times the choices); unset or "auto": attention_splits' choice
_SPLITS_ENV = os.environ.get("MANYLORA_ATTENTION_SPLITS", "auto").strip().lower()
if not (_SPLITS_ENV in ("", "auto") or (_SPLITS_ENV.isdigit() and int(_SPLITS_ENV) >= 1)):
    raise ValueError(f"MANYLORA_ATTENTION_SPLITS must be 'auto' or a positive count, got {_SPLITS_ENV!r}")
SPLITS_OVERRIDE: int | None = None if _SPLITS_ENV in ("", "auto") else int(_SPLITS_ENV)
_SM_COUNTS: dict[torch.device, int] = {}


def attention_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The context splits of a launch of ``batch`` query rows: the largest power of two that keeps batch x
    num_kv_heads x splits programs within PROGRAMS_PER_SM per SM, up to MAX_SPLITS; 1 where the batch alone comes
    within a factor of two of that (and on the CPU). A function of the batch alone, so that a CUDA graph captured
    for a batch-size bucket suits any lengths (short ones lose up to ~1 us a launch to the merge)."""
    if SPLITS_OVERRIDE is not None:
        return max(1, SPLITS_OVERRIDE)
    if device.type != "cuda":
        return 1
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    ratio = PROGRAMS_PER_SM * _SM_COUNTS[device] // (batch * num_kv_heads)
    return 1 if ratio < 2 else min(MAX_SPLITS, 1 << (ratio.bit_length() - 1))


def paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    layer: int,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    table_rows: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged KV cache (GQA).

    Semantics (``t = table_rows[b]`` when given, else ``t = b``)::

        kv = pool[: num_pages * page_elems].view(num_pages, num_layers, 2, page_size, num_kv_heads, d)
        group = n_heads // num_kv_heads
        for b in range(B):
            n = seq_lens[b]
            pages = block_tables[t, : cdiv(n, page_size)]
            K = kv[pages, layer, 0].reshape(-1, num_kv_heads, d)[:n]      # [n, n_kv, d]
            V = kv[pages, layer, 1].reshape(-1, num_kv_heads, d)[:n]
            for h in range(n_heads):
                w = softmax(scale * K[:, h // group].float() @ q[b, h].float())   # fp32
                out[b, h] = w @ V[:, h // group].float()

    Args:
        q: [B, n_heads, d], dtype of ``pool`` (fp16/bf16/fp32), any strides.
        pool: [P], 1-D contiguous flat pool; KV page p starts at element p * page_elems.
        block_tables: int32 [B, max_blocks] (or [S, max_blocks] with ``table_rows``): page of each
            block of page_size positions; entries past cdiv(seq_lens[b], page_size) are not read.
        seq_lens: int32 [B]: tokens in the cache per sequence (the new token included), any
            mix of lengths; 0 gives a zero output row.
        scale: softmax scale (usually d ** -0.5).
        out: [B, n_heads, d], fp16/bf16/fp32, any strides. Modified in place (fully written).
        layer: the layer to read (0 <= layer < num_layers); not specialised on, no recompiles.
        num_layers, page_size, num_kv_heads: the KV page geometry (head_dim is q's last dim).
        table_rows: optional int32 [B]: the block-table row each query row uses (several query
            rows of one prefill chunk share their sequence's table; causality comes from seq_lens).
        config: optional block-size and split override (keys as returned by ``attention_config``;
            without SPLITS: ``attention_splits``).

    Returns:
        ``out``.
    """
    check_tensor("q", q, dtype=FLOAT_DTYPES, dims=3)
    device = q.device
    batch, num_heads, head_dim = q.shape
    check_tensor("pool", pool, dtype=q.dtype, dims=1, device=device)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    check_tensor("block_tables", block_tables, dtype=torch.int32, dims=2, device=device)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, dims=1, device=device)
    check_tensor("out", out, dtype=FLOAT_DTYPES, dims=3, device=device)
    if table_rows is None:
        if block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must have {batch} rows (batch of q), got shape {tuple(block_tables.shape)}")
    else:
        check_tensor("table_rows", table_rows, dtype=torch.int32, dims=1, device=device)
        if table_rows.shape[0] != batch:
            raise ValueError(f"table_rows must have shape ({batch},), got {tuple(table_rows.shape)}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape ({batch},), got {tuple(seq_lens.shape)}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out must have the shape of q {tuple(q.shape)}, got {tuple(out.shape)}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"n_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    stride_slot = num_kv_heads * head_dim
    stride_kv = page_size * stride_slot
    stride_layer = 2 * stride_kv
    stride_page = num_layers * stride_layer
    cfg = dict(config or attention_config(group, head_dim, page_size))
    splits = cfg.setdefault("SPLITS", attention_splits(batch, num_kv_heads, device))
    if splits < 1:
        raise ValueError(f"SPLITS must be positive, got {splits}")
    if splits == 1:  # no partials: any tensor stands in for the pointers the kernel does not read
        part_out = part_stats = seq_lens
    else:  # one allocation a launch (eager steps pay each on the host): the outputs, then the (max, sum) pairs
        out_elems = batch * num_heads * splits * cfg["BLOCK_D"]
        partials = torch.empty(out_elems + batch * num_heads * splits * 2, dtype=torch.float32, device=device)
        part_out, part_stats = partials[:out_elems], partials[out_elems:]
    launch = relauncher(_paged_decode_attention_kernel, PAGE_SIZE=page_size, GROUP=group, DOT_PRECISION="ieee",
                        HAS_TABLE_ROWS=table_rows is not None, **cfg)
    launch(
        (batch, num_kv_heads, splits), q, pool, block_tables, seq_lens if table_rows is None else table_rows,
        seq_lens, out, part_out, part_stats,
        layer, head_dim, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        stride_page, stride_layer, stride_kv, stride_slot,
    )  # fmt: skip
    if splits > 1:
        merge = relauncher(_paged_attention_merge_kernel, SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                           BLOCK_D=cfg["BLOCK_D"], num_warps=1)
        merge((batch, num_heads), part_out, part_stats, out, head_dim, out.stride(0), out.stride(1), out.stride(2))
    return out
