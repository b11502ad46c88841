"""The fused SwiGLU activation kernel against the torch reference (fresh random inputs)."""

from __future__ import annotations

import pytest
import torch
from rounding import to_bf16_as_kernels_round

from manylora.kernels.reference import ref_silu_mul
from manylora.kernels.silu_mul import silu_mul


def bf16_steps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the bf16 step at each expected value (2^-7 relative)."""
    step = want.float().abs().clamp(min=2.0**-100) * 2.0**-7
    return float(((got.float() - want.float()).abs() / step).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 5), (7, 64), (5, 1000), (2, 1500), (4, 2048)])
def test_silu_mul_matches_reference(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 10_000 + width)
    wide = (3 * torch.randn(rows, 2 * width + 7, generator=gen)).to(dtype)
    gate_up = wide[:, 2 : 2 * width + 2]  # a row stride that is not the row length
    want = ref_silu_mul(gate_up)
    got = silu_mul(gate_up.to(device)).cpu()
    assert got.shape == (rows, width) and got.is_contiguous() and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # compiled: two roundings as the torch ops, exp off by at most its last bit: one bf16 step.
        # Triton's interpreter rounds fp32 -> bf16 otherwise than torch (toward zero), once per cast
        assert bf16_steps(got, want) <= (1 if device != "cpu" else 2)


def test_silu_mul_empty_and_bad_input(device):
    assert silu_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
    with pytest.raises(ValueError, match="even number of columns"):
        silu_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        silu_mul(torch.randn(8, 4, device=device).t())
    with pytest.raises(TypeError, match="dtype"):
        silu_mul(torch.ones(2, 4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 3), (5, 1000), (3, 2048)])
def test_silu_mul_adds_the_lora_term_first(device, dtype, rows, width):
    """A deferred LoRA term (fp32 [T, 2I]) is added to gate and up and rounded once before the activation: the same
    result as the kernel on the projection output with the term added and rounded as the kernel rounds (to nearest
    compiled; toward zero in the interpreter, where one step of a gate near -9 moves silu by 6%), and the reference
    on it."""
    gen = torch.Generator().manual_seed(rows * 4099 + width)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    term = torch.randn(rows, 2 * width + 4, generator=gen)[:, 1 : 2 * width + 1]
    exact = gate_up.float() + term
    with_term = to_bf16_as_kernels_round(exact, device) if dtype == torch.bfloat16 else exact
    got = silu_mul(gate_up.to(device), term.to(device)).cpu()
    torch.testing.assert_close(got, silu_mul(with_term.to(device)).cpu(), rtol=0, atol=0)
    want = ref_silu_mul(with_term)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert bf16_steps(got, want) <= (1 if device != "cpu" else 2)
    assert not torch.allclose(silu_mul(gate_up.to(device)).cpu().float(), want.float(), rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="lora_delta must have shape"):
        silu_mul(gate_up.to(device), term[:, 1:].to(device))
