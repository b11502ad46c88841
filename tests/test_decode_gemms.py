"""The decode graphs' base-GEMM settings (manylora/engine/layers/decode_gemms.py, EngineConfig.decode_gemm_blas /
decode_gemm_sm_carveout): what each graph is captured with, the configuration's checks, and (on a GPU) that torch's
cuBLAS settings hold inside a capture's context only."""

import pytest
import torch

from manylora.engine.config import EngineConfig
from manylora.engine.layers.decode_gemms import (
    DecodeGemmSettings,
    applied,
    group_carveouts_for,
    parse_carveout,
    sm_carveout_for,
)
from manylora.engine.models.llama import GATE_UP, QKV, LlamaModel


@pytest.mark.parametrize("with_lora", [True, False])
@pytest.mark.parametrize("blas, carveout", [("cublaslt", 32), ("cublaslt", 0), ("cublas", 0)])
def test_only_graphs_with_adapters_carve_out_sms(blas, carveout, with_lora):
    settings = DecodeGemmSettings.for_graph(blas, carveout, with_lora)
    assert settings.blas == blas
    assert settings.sm_carveout == (carveout if with_lora else 0)
    # the shrink goes after its GEMM exactly where the GEMM leaves it SMs
    assert settings.gemm_first == (with_lora and carveout > 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"decode_gemm_blas": "cutlass"}, "decode_gemm_blas must be one of cublas, cublaslt, got 'cutlass'"),
    ({"decode_gemm_sm_carveout": -1}, "decode_gemm_sm_carveout must be >= 0, got -1"),
    ({"decode_gemm_blas": "cublas", "decode_gemm_sm_carveout": 8},
     "decode_gemm_sm_carveout=8 needs decode_gemm_blas='cublaslt'"),
])  # fmt: skip
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model_dir="m", **kwargs)


def test_settings_come_from_strings_like_the_other_parameters():
    config = EngineConfig.from_strings({"model_dir": "m", "decode_gemm_blas": "cublas", "decode_gemm_sm_carveout": "0"})
    assert (config.decode_gemm_blas, config.decode_gemm_sm_carveout) == ("cublas", 0)
    config = EngineConfig.from_strings({"model_dir": "m", "decode_gemm_sm_carveout": "none"})
    assert config.decode_gemm_sm_carveout is None


@pytest.mark.parametrize("sm_carveout, blas, sms, expected", [
    (None, "cublaslt", 132, 32), (None, "cublaslt", 108, 26), (None, "cublaslt", 28, 6), (None, "cublas", 132, 0),
    (0, "cublaslt", 132, 0), (48, "cublaslt", 132, 48), (131, "cublaslt", 132, 131)])  # fmt: skip
def test_the_default_carveout_scales_with_the_device(sm_carveout, blas, sms, expected):
    """None: the H200's measured 32 of 132 SMs in proportion, so a smaller GPU still keeps most SMs for its GEMMs
    (a fixed 32 would take all of a 28-SM GPU's); through cuBLAS none; an explicit count is taken as given."""
    assert sm_carveout_for(sm_carveout, blas, sms) == expected


def test_a_carveout_that_leaves_no_sm_is_refused_by_name():
    with pytest.raises(ValueError, match="decode_gemm_sm_carveout=40 leaves none of the device's 40 SMs"):
        sm_carveout_for(40, "cublaslt", 40)


def test_a_cpu_device_leaves_torch_alone():
    before = torch._C._get_sm_carveout_experimental()
    with applied(DecodeGemmSettings("cublaslt", 16), "cpu"):
        assert torch._C._get_sm_carveout_experimental() == before
    assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt settings need a GPU")
def test_settings_hold_inside_the_context_and_are_restored():
    blas, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    with applied(DecodeGemmSettings("cublaslt", 16), "cuda"):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert torch._C._get_sm_carveout_experimental() == 16
        with applied(DecodeGemmSettings("cublaslt", 0), "cuda"):  # a base-only graph: no carveout
            assert torch._C._get_sm_carveout_experimental() is None
        assert torch._C._get_sm_carveout_experimental() == 16
    assert torch.backends.cuda.preferred_blas_library() == blas
    assert torch._C._get_sm_carveout_experimental() == carveout


@pytest.mark.parametrize("spec, expected", [
    ("32", (32, ())), ("0", (0, ())), ("32/qkv=48/gate_up=16", (32, (("qkv", 48), ("gate_up", 16)))),
    ("0/down=8", (0, (("down", 8),)))])  # fmt: skip
def test_a_carveout_spec_gives_the_default_and_each_groups_count(spec, expected):
    assert parse_carveout(spec) == expected


@pytest.mark.parametrize("spec, bad", [("32/mlp=16", "'mlp=16'"), ("32/qkv=-1", "'qkv=-1'"), ("x", "'x'"),
                                       ("32/qkv", "'qkv'")])
def test_a_bad_carveout_spec_is_refused_by_its_part(spec, bad):
    with pytest.raises(ValueError, match=bad):
        parse_carveout(spec)


def test_group_carveouts_come_from_the_engine_config_and_need_cublaslt():
    config = EngineConfig.from_strings({"model_dir": "m", "decode_gemm_group_carveouts": "qkv=48/o=0"})
    assert config.decode_gemm_group_carveouts == "qkv=48/o=0"
    assert group_carveouts_for(config.decode_gemm_group_carveouts, 132) == (("qkv", 48), ("o", 0))
    assert group_carveouts_for(EngineConfig(model_dir="m").decode_gemm_group_carveouts, 132) == ()  # default: none
    with pytest.raises(ValueError, match="decode_gemm_group_carveouts='qkv=48' needs decode_gemm_blas='cublaslt'"):
        EngineConfig(model_dir="m", decode_gemm_blas="cublas", decode_gemm_sm_carveout=0,
                     decode_gemm_group_carveouts="qkv=48")
    with pytest.raises(ValueError, match="decode_gemm_group_carveouts 'gate=4'"):
        EngineConfig(model_dir="m", decode_gemm_group_carveouts="gate=4")
    with pytest.raises(ValueError, match="qkv=40 leaves none of the device's 40 SMs"):
        group_carveouts_for("qkv=40", 40)


@pytest.mark.parametrize("default, groups, with_lora, gemm_first", [
    (0, (("qkv", 48),), True, True), (0, (("qkv", 0),), True, False), (32, (("qkv", 48),), False, False)])
def test_group_carveouts_apply_to_graphs_with_adapters_only(default, groups, with_lora, gemm_first):
    settings = DecodeGemmSettings.for_graph("cublaslt", default, with_lora, groups)
    assert settings.group_carveouts == (groups if with_lora else ())
    assert settings.gemm_first == gemm_first


def test_each_projection_groups_gemm_runs_under_its_own_carveout():
    """LlamaModel._group_linear sets the group's count around its GEMM (the capture's count elsewhere) and restores
    torch's setting after; torch reads it when the GEMM is launched, so recording it there is what cuBLASLt sees."""
    seen = []

    class Recorder:
        def _linear(self, x, weight, bias):
            seen.append(torch._C._get_sm_carveout_experimental())
            return x

    model = Recorder()
    outside = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(16)  # the capture's own count (``applied``)
    try:
        for carveouts in ({"qkv": 48, "gate_up": 0}, None):
            model.lora_group_carveouts = carveouts
            for modules in (QKV, ("o_proj",), GATE_UP, ("down_proj",)):
                LlamaModel._group_linear(model, torch.zeros(1), torch.zeros(1), None, modules)
        assert torch._C._get_sm_carveout_experimental() == 16
    finally:
        torch._C._set_sm_carveout_experimental(outside)
    assert seen == [48, 16, None, 16] + [16] * 4
