"""What the kernels compile to for the H200 (sm_90), checked without a GPU (perf/kernels/compile_report.py).

The LoRA and attention kernels are bound by memory bandwidth: a bf16 stream read two bytes per instruction (what
Triton emits when it cannot prove 16-byte alignment or a mask constant over a vector) costs them a large share of
the bandwidth. These tests compile the launchers' real launches at the Llama-3-8B shapes for sm_90 with Triton's
bundled ptxas, in a child process with TRITON_INTERPRET=0, and read the SASS: every kernel must read global memory
16 bytes at a time somewhere (the aligned pool path) and spill nothing to local memory.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf.kernels.compile_report import _memory_instructions

ROOT = Path(__file__).resolve().parents[1]

COMPILE = r"""
import json, sys
from dataclasses import asdict
import perf.kernels.compile_report as cr

with cr.compile_only() as reports:
    cr.lora_launches(64, 16, 16, segmented=False)
    cr.lora_launches(64, 16, 16, segmented=False, deferred=True)   # the expand beside the GEMM: overwrite, fp32
    cr.lora_launches(1024, 16, 16, segmented=True)
    cr.lora_launches(64, 16, 16, segmented="device")   # the decode step with decode_lora_kernels="sgmv"
    cr.lora_launches(33, 5, 8, segmented=False)   # odd batch, rank 8
    cr.lora_launches(1, 1, 16, segmented=False)   # one token: the BGMV expand's tile body
    cr.other_launches(batch=8, seq=256)
    cr.moe_pair_launches(tokens=8, distinct=3)
    cr.gemm_launches(64)
    cr.gemm_launches(5)   # a small eager step: 16-row tiles
    cr.gemm_launches(128)
    cr.gemm_launches(130, "float32")   # the engine tests' fp32 models: 4-byte operands
json.dump([asdict(r) for r in reports], sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _widest_read(report: dict) -> int:
    widths = [int(b) for b in report["loads"]] + [int(b) for b in report["async_loads"]]
    return max(widths, default=0)


def test_every_kernel_that_streams_memory_was_compiled(compiled):
    names = {r["name"] for r in compiled}
    assert names >= {
        "_lora_shrink_bgmv_kernel", "_lora_shrink_sgmv_kernel", "_lora_expand_bgmv_kernel",
        "_lora_expand_sgmv_kernel", "_paged_decode_attention_kernel", "_paged_attention_merge_kernel",
        "_add_rms_norm_kernel", "_silu_mul_kernel",
        "_rope_kv_write_kernel", "_skinny_gemm_kernel",
        "_moe_lora_shrink_pairs_kernel", "_moe_lora_expand_pairs_kernel",
    }  # fmt: skip


def test_kernels_read_global_memory_16_bytes_at_a_time(compiled):
    """Every kernel but the BGMV expand tile (``manylora/kernels/expand_tiles.py`` bgmv_expand_tile: the dense
    kernel's body
    for small launches, ROWS False, and the MoE-LoRA pair expand), whose 16-byte path measured ~3x slower on the
    H200; those must compile to the plain loads, not gain or lose them by accident. The dense kernel's
    row-streaming body (ROWS True) must read 16 bytes at a time."""
    kinds = {(r["name"], r["constexprs"].get("ROWS")) for r in compiled}
    assert {("_lora_expand_bgmv_kernel", True), ("_lora_expand_bgmv_kernel", False)} <= kinds
    for report in compiled:
        tile = report["name"] == "_moe_lora_expand_pairs_kernel" or (
            report["name"] == "_lora_expand_bgmv_kernel" and not report["constexprs"]["ROWS"])
        if tile:
            assert _widest_read(report) < 128, (report["name"], report["constexprs"], report["loads"])
            continue
        assert _widest_read(report) == 128, (report["name"], report["constexprs"], report["loads"])


def test_the_deferred_forms_were_compiled(compiled):
    """The expand's overwrite form and the consumers that add its term (``lora_delta``) are among the kernels the
    checks above cover."""
    kinds = {(r["name"], bool(r["constexprs"].get("OVERWRITE", r["constexprs"].get("HAS_LORA")))) for r in compiled}
    assert {("_lora_expand_bgmv_kernel", True), ("_add_rms_norm_kernel", True), ("_silu_mul_kernel", True),
            ("_rope_kv_write_kernel", True), ("_lora_expand_bgmv_kernel", False)} <= kinds


def test_every_kernel_fits_the_h200_shared_memory(compiled):
    """227 KB a program (232,448 bytes): above it the launch fails with OutOfResources, on the GPU only (the
    base GEMM's fp32 128 x 128 tiles at 4 stages asked 240 KB, perf/results/2026-12-01-h200/18_gemm)."""
    assert any(r["name"] == "_skinny_gemm_kernel" and r["constexprs"]["BLOCK_M"] == 64 for r in compiled)
    for report in compiled:
        assert report["shared_bytes"] <= 232448, (report["name"], report["constexprs"], report["shared_bytes"])


def test_no_kernel_spills_to_local_memory(compiled):
    for report in compiled:
        assert report["local_bytes"] == 0, (report["name"], report["constexprs"], report["local_bytes"])


def test_sass_memory_instructions_are_counted_by_width():
    sass = """
        /*0090*/ LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*00a0*/ LDG.E.U16 R9, desc[UR4][R6.64] ;
        /*00b0*/ LDG.E R10, desc[UR4][R6.64] ;
        /*00c0*/ LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64] ;
        /*00d0*/ STG.E.64 desc[UR4][R2.64], R8 ;
        /*00e0*/ RED.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;
        /*00f0*/ LDS.128 R12, [R3] ;
    """
    loads, async_loads, stores, atomics = _memory_instructions(sass)
    assert loads == {128: 1, 16: 1, 32: 1}
    assert async_loads == {128: 1}
    assert stores == {64: 1}
    assert atomics == 1



def test_the_split_k_gemm_streams_its_weight_through_shared_memory(compiled):
    """On sm_90 the skinny GEMM must pipeline its tiles with 16-byte asynchronous copies (LDGSTS, num_stages deep)
    and, where it splits K, reduce the partials through one counter per tile (its atomic add and its reset); with
    no split, no atomics at all. A plain load loop or a lost atomic would be a different kernel from the one
    benchmarked."""
    gemms = [r for r in compiled if r["name"] == "_skinny_gemm_kernel"]
    assert {r["constexprs"]["BLOCK_M"] for r in gemms} >= {16, 64}
    assert {r["constexprs"]["SPLIT_K"] > 1 for r in gemms} == {True, False}
    for r in gemms:
        assert int(r["async_loads"].get("128", 0)) > 0, (r["constexprs"], r["async_loads"])  # JSON: keys are str
        assert r["atomics"] == (2 if r["constexprs"]["SPLIT_K"] > 1 else 0), (r["constexprs"], r["atomics"])
