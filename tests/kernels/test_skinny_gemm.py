"""The decode-sized base GEMM (split-K, last split reduces) against its fp32 reference, fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from manylora.kernels.reference import ref_skinny_linear
from manylora.kernels.skinny_gemm import gemm_config, skinny_linear


def _inputs(gen, rows, out_features, in_features, dtype, bias, row_pad=0):
    """x as a view with a wider row than its features when row_pad (as the model's activations can be)."""
    x = torch.randn(rows, in_features + row_pad, generator=gen)[:, :in_features].to(dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    return x, weight, b


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: accumulation order only; 16-bit: one rounding of the output (2^-8 relative for bf16) and the order
    tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, out_features, in_features, bias, row_pad", [
    (1, 40, 64, False, 0), (3, 70, 300, True, 5), (16, 128, 256, True, 0), (33, 96, 512, False, 7),
    (64, 192, 1024, True, 0), (130, 64, 128, False, 0)])
def test_skinny_linear_matches_reference(device, dtype, rows, out_features, in_features, bias, row_pad):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); checked on GPU only")
    gen = torch.Generator().manual_seed(rows * 7919 + out_features * 31 + in_features)
    x, weight, b = _inputs(gen, rows, out_features, in_features, dtype, bias, row_pad)
    want = ref_skinny_linear(x, weight, b)
    xd, wd = x.to(device), weight.to(device)
    bd = b.to(device) if b is not None else None
    got = skinny_linear(xd, wd, bd)
    assert got.shape == (rows, out_features) and got.dtype == dtype and got.is_contiguous()
    _close(got.cpu(), want, dtype)
    # a second launch of the same shape reuses the workspace: its counters must have been reset by the first
    again = skinny_linear(xd, wd, bd)
    assert torch.equal(again, got), "a repeated launch differs: the split sum is not deterministic or a counter stuck"


@pytest.mark.parametrize("split", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("block_n, block_k", [(16, 16), (32, 64), (64, 128)])
def test_every_k_split_and_block_shape_gives_the_same_product(device, split, block_n, block_k):
    """Splits that do not divide the K blocks (the last split gets fewer), more splits than K blocks, K not a
    multiple of the block."""
    gen = torch.Generator().manual_seed(split * 100 + block_n + block_k)
    x, weight, b = _inputs(gen, 9, 100, 200, torch.float32, True)
    cfg = {**gemm_config(9, 100, 200), "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split}
    got = skinny_linear(x.to(device), weight.to(device), b.to(device), config=cfg)
    _close(got.cpu(), ref_skinny_linear(x, weight, b), torch.float32)


def test_shapes_of_one_model_launch_after_each_other_without_mixing_their_counters(device):
    """Two shapes interleaved (as q/k/v and o are in every layer), each split, and batches of 12, 9 and 16 rows (one
    row bucket: they share a workspace, as eager steps of changing sizes do)."""
    from manylora.kernels import skinny_gemm

    gen = torch.Generator().manual_seed(5)
    cases = [_inputs(gen, rows, *shape, torch.float32, bias)
             for rows in (12, 9, 16) for shape, bias in (((96, 512), False), ((64, 768), True))]
    before = len(skinny_gemm._WORKSPACES)
    for _ in range(2):
        for x, w, bias in cases:
            got = skinny_linear(x.to(device), w.to(device), bias.to(device) if bias is not None else None)
            _close(got.cpu(), ref_skinny_linear(x, w, bias), torch.float32)
    assert len(skinny_gemm._WORKSPACES) - before <= 2  # one per GEMM shape, whatever the batch in the bucket


def test_heuristic_covers_the_batch_and_splits_k_only_where_the_partials_are_cheap():
    from manylora.kernels.skinny_gemm import MAX_PARTIAL_TRAFFIC

    for rows in (1, 7, 16, 64, 128):
        for out_features, in_features in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            cfg = gemm_config(rows, out_features, in_features)
            assert cfg["BLOCK_M"] >= min(rows, 64) and cfg["BLOCK_M"] >= 16
            assert in_features // cfg["BLOCK_K"] % cfg["SPLIT_K"] == 0, cfg  # every split the same K range
            partial_bytes = 2 * 4 * cfg["SPLIT_K"] * cfg["BLOCK_M"] * cfg["BLOCK_N"] if cfg["SPLIT_K"] > 1 else 0
            assert partial_bytes <= MAX_PARTIAL_TRAFFIC * cfg["BLOCK_N"] * in_features * 2, (rows, cfg)
            programs = -(-out_features // cfg["BLOCK_N"]) * -(-rows // cfg["BLOCK_M"]) * cfg["SPLIT_K"]
            assert programs >= 2 * 132 // 3, (rows, out_features, in_features, cfg)
    # few rows: partials are cheap, so the narrow layers split K to fill the SMs; 64 rows: they are not
    assert gemm_config(16, 4096, 4096)["SPLIT_K"] > 1
    assert gemm_config(64, 4096, 4096)["SPLIT_K"] == 1 and gemm_config(64, 6144, 4096)["SPLIT_K"] == 1


def test_heuristic_pipeline_fits_the_shared_memory():
    """The H200 refused 4 stages of 128 x 128 fp32 tiles (240 KB of 227): the stage count follows the operand size."""
    from manylora.kernels.skinny_gemm import PIPELINE_SHARED_BYTES, pipeline_stages

    for element_size in (2, 4):
        for rows in (1, 64, 128, 130, 300):
            for out_features, in_features in ((64, 128), (6144, 4096), (4096, 14336)):
                cfg = gemm_config(rows, out_features, in_features, element_size)
                buffers = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * element_size * cfg["num_stages"]
                assert cfg["num_stages"] == 2 or buffers <= PIPELINE_SHARED_BYTES, (element_size, rows, cfg)
    assert pipeline_stages(128, 32, 128, 4) == 2 and pipeline_stages(128, 32, 128, 2) == 4  # the refused launch's tile


def test_empty_and_degenerate_shapes(device):
    x = torch.randn(0, 32).to(device)
    assert skinny_linear(x, torch.randn(8, 32).to(device)).shape == (0, 8)
    bias = torch.randn(8).to(device)
    got = skinny_linear(torch.randn(3, 0).to(device), torch.randn(8, 0).to(device), bias)
    assert torch.equal(got.cpu(), bias.cpu().expand(3, 8))


def test_bad_input_is_refused_naming_the_tensor(device):
    x = torch.randn(4, 32).to(device)
    with pytest.raises(ValueError, match="weight is \\[8, 31\\]; x has 32"):
        skinny_linear(x, torch.randn(8, 31).to(device))
    with pytest.raises(TypeError, match="weight must have dtype"):
        skinny_linear(x, torch.randn(8, 32, dtype=torch.float64).to(device))
    with pytest.raises(ValueError, match="unit column strides"):
        skinny_linear(x, torch.randn(32, 8).to(device).T)
    with pytest.raises(ValueError, match="bias must be a contiguous \\[8\\]"):
        skinny_linear(x, torch.randn(8, 32).to(device), torch.randn(9).to(device))
