"""Which base GEMM a step's projections take (LlamaModel._triton_gemm, EngineConfig.base_gemm): "auto" is the Triton
kernel only inside a CUDA-graph capture with adapters and up to 64 tokens; "triton" up to 128 tokens; "torch" never.
On a GPU the capture flag is what forward sets; here it is set by hand, and the Triton GEMM's calls are counted."""

import pytest
import torch

import manylora.kernels.skinny_gemm as skinny_gemm
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import AUTO_TRITON_MAX_ROWS
from perf.engine.bench_decode_step import random_model
from perf.engine.shapes import SHAPES


@pytest.mark.parametrize("base_gemm, capture, rows, triton", [
    ("torch", True, 8, False), ("triton", False, 8, True), ("triton", False, 128, True), ("triton", True, 129, False),
    ("auto", False, 8, False), ("auto", True, 8, True), ("auto", True, AUTO_TRITON_MAX_ROWS, True),
    ("auto", True, AUTO_TRITON_MAX_ROWS + 1, False)])  # fmt: skip
def test_the_base_gemm_is_chosen_by_knob_capture_and_rows(monkeypatch, base_gemm, capture, rows, triton):
    cfg = ModelConfig.from_dict(SHAPES["tiny"])
    model = random_model(cfg, 32, "cpu", torch.float32)
    model.use_kernels, model.base_gemm, model.lora_capture = True, base_gemm, capture
    calls = []
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, w, b=None, config=None: calls.append(x.shape[0])
                        or torch.nn.functional.linear(x, w, b))
    x = torch.randn(rows, cfg.hidden_size)
    out = model._linear(x, model.layers[0].o, None)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, model.layers[0].o))
    assert calls == ([rows] if triton else [])
    model.use_kernels = False
    model._linear(x, model.layers[0].o, None)
    assert len(calls) == (1 if triton else 0), "off the kernel path: torch"

