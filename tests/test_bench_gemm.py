"""The GEMM benchmark times the shapes the model runs (its shapes come from the model's config)."""

from manylora.engine.model_config import ModelConfig
from perf.engine.shapes import SHAPES
from perf.kernels.bench_gemm import gemm_shapes


def test_llama3_8b_gemm_shapes():
    shapes = gemm_shapes(ModelConfig.from_dict(SHAPES["llama3-8b"]))
    # q 32 x 128 + k, v 8 x 128 each; SwiGLU 14336 wide; vocabulary 128256
    assert shapes == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}
