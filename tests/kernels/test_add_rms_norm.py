"""The fused residual add + RMSNorm kernel against the torch reference (fresh random inputs)."""

from __future__ import annotations

import pytest
import torch
from rounding import to_bf16_as_kernels_round

from manylora.kernels.add_rms_norm import add_rms_norm
from manylora.kernels.reference import ref_add_rms_norm


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 8), (5, 100), (3, 4096)])
def test_add_rms_norm_adds_the_lora_term_first(device, dtype, rows, cols):
    """A deferred LoRA term (fp32) is added to delta and rounded once, then the residual add and the norm as
    without it: the same result as the kernel on delta with the term added and rounded as the kernel rounds
    (tests/kernels/rounding.py), and the reference on it."""
    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    delta = torch.randn(rows, cols, generator=gen).to(dtype)
    wide = torch.randn(rows, cols + 5, generator=gen)
    term = wide[:, 2 : cols + 2]  # a row stride that is not the row length
    weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    exact = delta.float() + term
    with_term = to_bf16_as_kernels_round(exact, device) if dtype == torch.bfloat16 else exact
    out, total = add_rms_norm(x.to(device), delta.to(device), weight.to(device), 1e-5, lora_delta=term.to(device))
    want_out, want_sum = add_rms_norm(x.to(device), with_term.to(device), weight.to(device), 1e-5)
    torch.testing.assert_close(total.cpu(), want_sum.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), want_out.cpu(), rtol=0, atol=0)
    ref_out, ref_sum = ref_add_rms_norm(x, with_term, weight, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(total.cpu(), ref_sum, rtol=0, atol=0)
        torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(add_rms_norm(x.to(device), delta.to(device), weight.to(device), 1e-5)[1].cpu().float(),
                              total.cpu().float(), rtol=0.01, atol=0.01), "the term must matter"


def test_add_rms_norm_lora_term_needs_delta(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="pass delta with it"):
        add_rms_norm(x, None, torch.ones(8, device=device), 1e-5, lora_delta=torch.zeros(2, 8, device=device))
    with pytest.raises(TypeError, match="lora_delta"):
        add_rms_norm(x, x, torch.ones(8, device=device), 1e-5, lora_delta=torch.zeros(2, 8, device=device).double())
    with pytest.raises(ValueError, match="lora_delta must have shape"):
        add_rms_norm(x, x, torch.ones(8, device=device), 1e-5, lora_delta=torch.zeros(2, 7, device=device))
