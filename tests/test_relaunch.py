"""manylora/kernels/relaunch.py: which kernels can skip Triton's dispatch (the check runs without a GPU).

The direct path needs every parameter after the positional ones to be a constexpr given in ``meta``; a kernel
that breaks this (a constexpr added mid-signature) silently falls back to dispatching every launch. These checks run
in a child process with TRITON_INTERPRET=0, where ``triton.jit`` gives JITFunctions (the kernel tests' interpreter
gives InterpretedFunctions, which always dispatch).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import manylora.kernels.add_rms_norm as a
import manylora.kernels.lora_expand as e
import manylora.kernels.lora_shrink as s
import manylora.kernels.paged_attention as p
import manylora.kernels.silu_mul as m
import triton
import triton.language as tl
from manylora.kernels.relaunch import Relauncher

def meta_of(fn):
    return {q.name: 1 for q in fn.params if q.is_constexpr} | {"num_warps": 4}

# (kernel, positional arguments its launcher passes)
for fn, positional in [(s._lora_shrink_bgmv_kernel, 21), (s._lora_shrink_sgmv_kernel, 22),
                       (e._lora_expand_bgmv_kernel, 21), (e._lora_expand_sgmv_kernel, 23),
                       (a._add_rms_norm_kernel, 13), (m._silu_mul_kernel, 7), (p._paged_decode_attention_kernel, 23),
                       (p._paged_attention_merge_kernel, 7)]:
    r = Relauncher(fn, meta_of(fn))
    assert r._direct, fn
    tail = r._constexpr_tail(positional)
    assert tail is not None and len(tail) == len(fn.params) - positional, fn

@triton.jit
def mid(x_ptr, N: tl.constexpr, y_ptr):
    pass

assert Relauncher(mid, {"N": 4})._constexpr_tail(2) is None          # a constexpr among the positional ones
assert Relauncher(m._silu_mul_kernel, {})._constexpr_tail(7) is None  # BLOCK not in meta
print("ok")
"""


def test_launchers_kernels_take_the_direct_path(tmp_path):
    script = tmp_path / "check_relaunch.py"  # @triton.jit wants its source in a file
    script.write_text(CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
