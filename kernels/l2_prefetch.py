"""Prefetch part of a weight into the GPU's L2 cache ahead of the GEMM that will stream it.

A decode step's base GEMMs are streams over their weights, and between two of them run short kernels (norms, RoPE,
silu * up) and launch gaps during which HBM is mostly idle. A prefetch launched on a side stream when such a window
opens asks the memory system for the first bytes the next GEMM will read, so that they wait in L2 when the GEMM
starts. Nothing is computed and nothing is written: the kernel issues the requests and ends.

Semantics: for every row ``r`` in ``[0, rows)`` the elements ``weight[r, col_start : col_start + cols]`` are
requested into L2 (``weight`` 2-D, last dim contiguous); the tensor is unchanged. Forms (``how``):

* ``"line"``: one ``prefetch.global.L2::evict_last`` per 128-byte line, one line per lane;
* ``"bulk"``: one ``cp.async.bulk.prefetch.L2.global`` (sm_90) per row segment, one row per lane;
* ``"load"``: plain loads with the evict_last policy, reduced and never stored (for GPUs or Tritons without the
  instructions above; it keeps its SMs until the bytes arrive).

On the CPU (and under ``TRITON_INTERPRET=1``) there is no cache to fill: ``prefetch_l2`` does nothing there, and its
reference is the identity on the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_meta import cdiv
from kernels.relaunch import relauncher

__all__ = ["PREFETCH_FORMS", "prefetch_l2"]

PREFETCH_FORMS = ("line", "bulk", "load")
LINE_BYTES = 128
_LANES = {"line": 1024, "bulk": 1024, "load": 32}  # lines (rows for "bulk") per program


@triton.jit
def _prefetch_kernel(
    w_ptr,
    sink_ptr,  # int32 [1]: written only if rows < 0 (never), so that the compiler keeps the requests
    rows,
    row_stride,  # elements
    col_start,  # elements
    lines_per_row,
    seg_bytes,  # bytes of each row's segment (FORM 1)
    LINE: tl.constexpr,  # elements in a 128-byte line
    LANES: tl.constexpr,
    FORM: tl.constexpr,  # 0 line prefetch, 1 bulk prefetch per row, 2 evict_last loads
):
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    if FORM == 1:
        total = rows
        idx = tl.minimum(idx, total - 1)
        ptrs = w_ptr + idx.to(tl.int64) * row_stride + col_start
        done = tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [ptrs, tl.full([LANES], seg_bytes, tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        total = rows * lines_per_row
        idx = tl.minimum(idx, total - 1)  # lanes past the end repeat the last line: no address outside the region
        row = idx // lines_per_row
        line = idx % lines_per_row
        ptrs = w_ptr + row.to(tl.int64) * row_stride + col_start + line * LINE
        if FORM == 0:
            done = tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                "=r,l",
                [ptrs],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            vals = tl.load(ptrs[:, None] + tl.arange(0, LINE)[None, :], eviction_policy="evict_last")
            done = tl.sum(vals.to(tl.float32), axis=1).to(tl.int32)
    tl.store(sink_ptr + tl.arange(0, LANES) * 0, done, mask=tl.arange(0, LANES) < rows * 0 - 1)


_sinks: dict[torch.device, torch.Tensor] = {}


def prefetch_l2(
    weight: torch.Tensor, rows: int | None = None, col_start: int = 0, cols: int | None = None, how: str = "line"
) -> None:
    """Request ``weight[:rows, col_start:col_start + cols]`` into L2 (see the module docstring); no-op off CUDA.

    ``weight``: 2-D, last dim contiguous; rows default to all, cols to the rest of the row. Segments are rounded
    outward to whole 128-byte lines (and to 16 bytes for "bulk"), never past the row's end."""
    if how not in PREFETCH_FORMS:
        raise ValueError(f"prefetch form must be one of {PREFETCH_FORMS}, got {how!r}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"prefetch_l2 needs a 2-D weight with a contiguous last dim, got shape "
            f"{tuple(weight.shape)} strides {weight.stride()}"
        )
    n_rows, width = weight.shape
    rows = n_rows if rows is None else min(rows, n_rows)
    cols = width - col_start if cols is None else min(cols, width - col_start)
    if weight.device.type != "cuda" or rows <= 0 or cols <= 0:
        return
    elem = weight.element_size()
    line = LINE_BYTES // elem
    start = (col_start // line) * line
    lines_per_row = cdiv(col_start + cols - start, line)
    seg_bytes = min(lines_per_row * LINE_BYTES, (width - start) * elem) // 16 * 16
    form = PREFETCH_FORMS.index(how)
    sink = _sinks.get(weight.device)
    if sink is None:
        sink = _sinks[weight.device] = torch.zeros(1, dtype=torch.int32, device=weight.device)
    lanes = rows if form == 1 else rows * lines_per_row
    per_program = _LANES[how]
    relauncher(_prefetch_kernel, LINE=line, LANES=per_program, FORM=form, num_warps=4)(
        (cdiv(lanes, per_program),),
        weight,
        sink,
        rows,
        weight.stride(0),
        start,
        lines_per_row,
        seg_bytes,
    )
