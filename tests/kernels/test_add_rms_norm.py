"""The fused residual add + RMSNorm kernel against the torch reference (fresh random inputs)."""

from __future__ import annotations

import pytest
import torch

from kernels.add_rms_norm import add_rms_norm
from kernels.reference import ref_add_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (7, 64), (5, 100), (2, 4096)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(device, dtype, rows, cols, with_delta):
    gen = torch.Generator().manual_seed(rows * 1000 + cols + with_delta)
    wide = torch.randn(rows, cols + 3, generator=gen).to(dtype)
    x = wide[:, 1 : cols + 1]  # a row stride that is not the row length
    delta = torch.randn(rows, cols, generator=gen).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    want_out, want_sum = ref_add_rms_norm(x, delta, weight, 1e-5)
    out, total = add_rms_norm(x.to(device), None if delta is None else delta.to(device), weight.to(device), 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(total.cpu(), want_sum, rtol=0, atol=0)
        torch.testing.assert_close(out.cpu(), want_out, rtol=1e-5, atol=1e-5)
        return
    # bf16: compiled, the sum is rounded exactly as torch's add and the norm is at most one bf16 step
    # off (rsqrt / summation order). Triton's interpreter rounds fp32 -> bf16 otherwise than torch,
    # so on the CPU one step is allowed in the sum and four in the output (three casts).
    compiled = device != "cpu"
    assert bf16_steps(total.cpu(), want_sum) <= (0 if compiled else 1)
    assert bf16_steps(out.cpu(), want_out) <= (1 if compiled else 4)


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the bf16 step at each expected value (2^-7 relative)."""
    step = want.float().abs().clamp(min=2.0**-100) * 2.0**-7
    return float(((got.float() - want.float()).abs() / step).max())

def test_add_rms_norm_refuses_bad_input(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight must have shape"):
        add_rms_norm(x, None, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        add_rms_norm(torch.randn(8, 2, device=device).t(), None, torch.ones(8, device=device), 1e-5)
