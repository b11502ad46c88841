"""What the H200 would run, read without one: compile kernel launches for sm_90 on any machine.

    PYTHONPATH=. python -m perf.kernels.compile_report [--out PATH]

Inside ``compile_only()``, a Triton kernel launch made through the project's own launchers
(``lora_shrink``, ``lora_expand``, ``paged_decode_attention``, ...) is specialised by Triton exactly
as it would be on the GPU (the same arguments, ints and pointer alignments), compiled for the
target (default: CUDA sm_90, the H200) with Triton's bundled ptxas, recorded, and not run. The
tensors may live on the CPU; no driver or GPU is touched. The report per compiled kernel gives its
registers, local-memory (spill) bytes and shared memory from ``cuobjdump --dump-resource-usage``,
and the widths of its global loads and stores in the SASS (``LDG.E.128`` is a 16-byte vector load,
``LDG.E.U16`` a scalar 2-byte one): a bf16 stream read two bytes at a time costs instructions and
memory-level parallelism that a bandwidth-bound kernel cannot spare.

``main`` compiles the decode (BGMV) and prefill (SGMV) LoRA launches of the Llama-3-8B projections,
paged decode attention, the fused norm / activation kernels and the split-K base GEMM at the benchmark's shapes
and prints a table; tests use ``compile_only`` to assert properties of the compiled code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import triton
from triton.backends.compiler import GPUTarget

H200 = GPUTarget("cuda", 90, 32)
_SASS_GLOBAL = re.compile(r"\b(LDGSTS|LDG|STG|RED|ATOMG)((?:\.[A-Z0-9_]+)*)\b")
_WIDTH_SUFFIX = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel variant as compiled for the target: resources and the global memory instructions."""

    name: str
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    registers: int
    local_bytes: int  # per thread: spills and local arrays
    shared_bytes: int
    loads: dict[int, int] = field(default_factory=dict)  # access width in bits -> LDG instructions
    async_loads: dict[int, int] = field(default_factory=dict)  # width in bits -> LDGSTS (global -> shared copies)
    stores: dict[int, int] = field(default_factory=dict)  # width in bits -> STG instructions
    atomics: int = 0  # RED / ATOMG instructions
    by_line: dict[str, dict[str, int]] = field(default_factory=dict)  # "file:line" -> PTX global ld/st op -> count

    def summary(self) -> str:
        def widths(counts: dict[int, int]) -> str:
            return " ".join(f"{bits // 8}B:{n}" for bits, n in sorted(counts.items())) or "-"

        return (
            f"{self.name:34s} warps={self.num_warps} regs={self.registers:3d} local={self.local_bytes:4d} "
            f"smem={self.shared_bytes:6d} | LDG {widths(self.loads)} | LDGSTS {widths(self.async_loads)} "
            f"| STG {widths(self.stores)}" + (f" | atomics {self.atomics}" if self.atomics else "")
        )


def _tool(name: str) -> str:
    """A CUDA binary tool shipped inside the Triton wheel (cuobjdump, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _memory_instructions(sass: str) -> tuple[dict[int, int], dict[int, int], dict[int, int], int]:
    """Global loads, global->shared copies and stores by access width in bits, and the atomics, of SASS text."""
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op, suffixes in _SASS_GLOBAL.findall(sass):
        bits = 32
        for suffix in suffixes.split("."):
            bits = _WIDTH_SUFFIX.get(suffix, bits)
        by_op[op][bits] += 1
    atomics = sum(by_op["RED"].values()) + sum(by_op["ATOMG"].values())
    return dict(by_op["LDG"]), dict(by_op["LDGSTS"]), dict(by_op["STG"]), atomics


def _ptx_accesses_by_line(ptx: str) -> dict[str, dict[str, int]]:
    """PTX global loads, stores and global->shared copies ("ld.global.v4.b32", "cp.async.cg.shared.global", ...)
    counted by the source line their ``.loc`` names: which
    ``tl.load`` became which width (a kernel with an aligned and a fallback path has both)."""
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    where, found = "?", collections.defaultdict(collections.Counter)
    for line in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            where = f"{os.path.basename(files.get(loc.group(1), loc.group(1)))}:{loc.group(2)}"
            continue
        access = re.search(r"\b(?:(?:ld|st)\.global|cp\.async)(?:\.[a-z0-9]+)*", line)
        if access and not access.group(0).startswith(("cp.async.commit", "cp.async.wait")):
            size = re.search(r"\],\s*(0x[0-9a-f]+|\d+)", line) if access.group(0).startswith("cp.async") else None
            found[where][access.group(0) + (f"[{int(size.group(1), 0)}B]" if size else "")] += 1
    return {k: dict(v) for k, v in sorted(found.items())}


def _resources(cubin: bytes) -> tuple[str, dict[str, int]]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], check=True, capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return sass, {k: int(v) for k, v in found.items()}


def analyse(name: str, compiled, constexprs: dict[str, object]) -> CompiledKernel:
    """The report of a ``triton.compile`` result."""
    sass, res = _resources(compiled.asm["cubin"])
    loads, async_loads, stores, atomics = _memory_instructions(sass)
    return CompiledKernel(
        name=name,
        constexprs=constexprs,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        registers=res.get("REG", 0),
        local_bytes=res.get("LOCAL", 0) + res.get("STACK", 0),
        shared_bytes=max(res.get("SHARED", 0), int(compiled.metadata.shared)),
        loads=loads,
        async_loads=async_loads,
        stores=stores,
        atomics=atomics,
        by_line=_ptx_accesses_by_line(compiled.asm["ptx"]),
    )


class _CompileOnlyDriver:
    """Stands in for Triton's active driver: names the target, a device 0 and a null stream; nothing else is used
    before the launch hook below stops the launch."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


@contextlib.contextmanager
def compile_only(target: GPUTarget = H200) -> Iterator[list[CompiledKernel]]:
    """Launches inside compile their kernel for ``target`` and return without running; yields the reports, one per
    compiled variant, in launch order (a launch whose variant was compiled before adds none).

    Needs compiled Triton (TRITON_INTERPRET unset when the kernels' modules were imported), in a process that has
    launched none of these kernels for real (a variant already in Triton's cache would be launched, not compiled).
    Afterwards the kernels' per-device caches are dropped, so that later real launches bind to the real target.
    """
    from triton import knobs
    from triton.runtime import driver

    reports: list[CompiledKernel] = []
    seen: set[tuple] = set()
    kernels: list = []

    def compile_and_skip(*, key, fn, compile, **_) -> bool:
        jit_fn = fn.jit_function
        kernels.append(jit_fn)
        options = {k: compile[k] for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")}
        ident = (jit_fn.__name__, repr(key))
        if ident not in seen:
            seen.add(ident)
            src = triton.compiler.ASTSource(jit_fn, compile["signature"], compile["constants"], compile["configs"][0])
            constexprs = {path[0] if len(path) == 1 else path: v for path, v in compile["constants"].items()}
            named = {jit_fn.arg_names[p]: v for p, v in constexprs.items() if isinstance(p, int)}
            reports.append(analyse(jit_fn.__name__, triton.compile(src, target=target, options=options), named))
        return True  # the launch stops here: nothing is run

    saved_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_CompileOnlyDriver(target))
    knobs.runtime.jit_cache_hook = compile_and_skip
    try:
        yield reports
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        driver.reset_active() if driver._default is not None else setattr(driver, "_active", None)
        for jit_fn in kernels:
            getattr(jit_fn, "device_caches", {}).clear()


# --- the benchmark's launches -------------------------------------------------------------------------------------

MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}  # fmt: skip


def lora_launches(num_tokens: int, distinct: int, rank: int, segmented: bool | str, deferred: bool = False) -> None:
    """``lora_shrink`` + ``lora_expand`` over every Llama-3-8B projection group (bf16 pool, rows on 16 bytes).
    segmented: False (BGMV), True (segments built on the host) or "device" (``build_segments_on_device``);
    deferred (BGMV): the expand's overwrite form into an fp32 buffer, as a captured decode step defers it."""
    import torch

    from manylora.kernels.lora_expand import lora_expand
    from manylora.kernels.lora_meta import build_segments
    from manylora.kernels.lora_shrink import lora_shrink

    gen = torch.Generator().manual_seed(0)
    slots = (torch.arange(num_tokens) % distinct)[torch.randperm(num_tokens, generator=gen)].to(torch.int32)
    if segmented == "device":
        from manylora.kernels.lora_meta import build_segments_on_device

        segments = build_segments_on_device(slots, distinct)
    else:
        segments = build_segments(slots, device="cpu") if segmented else None
    for in_f, widths in MODULES.values():
        ns = len(widths)
        a_rows = torch.arange(distinct * rank, dtype=torch.int64).view(distinct, rank) * in_f
        b_rows = torch.arange(distinct * rank, dtype=torch.int64).view(distinct, rank) * max(widths)
        a_offs = torch.stack([a_rows + i * distinct * rank * in_f for i in range(ns)])
        b_offs = torch.stack([b_rows + i * distinct * rank * max(widths) for i in range(ns)])
        pool = torch.empty(ns * distinct * rank * max(in_f, max(widths)), dtype=torch.bfloat16)
        ranks = torch.full((ns, distinct), rank, dtype=torch.int32)
        scalings = torch.full((ns, distinct), 0.5)
        x = torch.empty(num_tokens, in_f, dtype=torch.bfloat16)
        y = torch.zeros(ns, num_tokens, rank)
        base = torch.empty(num_tokens, sum(widths), dtype=torch.float32 if deferred else torch.bfloat16)
        bounds = [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        lora_shrink(x, pool, a_offs, ranks, slots, y, segments=segments)
        lora_expand(y, pool, b_offs, ranks, scalings, slots, base, bounds, segments=segments, overwrite=deferred)


def moe_pair_launches(tokens: int = 64, distinct: int = 8, rank: int = 16) -> None:
    """The MoE-LoRA decode kernels (one program per (token, expert) pair) at the Qwen3-30B-A3B shape: hidden 2048,
    128 experts of intermediate 768, top-8; gate_up (two slices) and down, bf16 pool with rows on 16 bytes."""
    import torch

    from manylora.kernels.moe_lora_pairs import moe_lora_expand_pairs, moe_lora_shrink_pairs

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.randint(experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    slots = (torch.arange(tokens) % distinct).to(torch.int32)
    ranks, scalings = torch.full((distinct,), rank, dtype=torch.int32), torch.full((distinct,), 0.5)
    pairs = tokens * top_k
    for num_slices, k_dim, width, rows_div in ((2, hidden, inter, top_k), (1, inter, hidden, 1)):
        rows = torch.arange(num_slices * distinct * experts * rank, dtype=torch.int64)
        a_offsets = (rows * k_dim).view(num_slices, distinct, experts, rank)
        b_offsets = (rows * width).view(num_slices, distinct, experts, rank)
        pool = torch.empty(rows.numel() * max(k_dim, width), dtype=torch.bfloat16)
        a_in = torch.empty(pairs // rows_div, k_dim, dtype=torch.bfloat16)
        y = torch.empty(num_slices, pairs, rank)
        out = torch.empty(pairs, num_slices * width, dtype=torch.bfloat16)
        moe_lora_shrink_pairs(a_in, pool, a_offsets, ranks, topk_ids, slots, y, rows_div=rows_div)
        moe_lora_expand_pairs(y, pool, b_offsets, ranks, scalings, topk_ids, slots, out)


def other_launches(batch: int = 64, seq: int = 1024) -> None:
    """Paged decode attention (32 q / 8 kv heads, d 128, page 16; also split over the context), add+RMSNorm,
    silu*mul and RoPE + KV write at the 8B shapes; the last three also with a deferred LoRA term (``lora_delta``) to
    add."""
    import torch

    from manylora.kernels.add_rms_norm import add_rms_norm
    from manylora.kernels.paged_attention import attention_config, paged_decode_attention
    from manylora.kernels.rope_kv import rope_kv_write
    from manylora.kernels.silu_mul import silu_mul

    num_layers, page, nkv, d = 32, 16, 8, 128
    pages_per = seq // page
    pool = torch.empty(batch * pages_per * num_layers * 2 * page * nkv * d, dtype=torch.bfloat16)
    tables = torch.arange(batch * pages_per, dtype=torch.int32).view(batch, pages_per)
    lens = torch.full((batch,), seq, dtype=torch.int32)
    q = torch.empty(batch, 4 * nkv, d, dtype=torch.bfloat16)
    paged_decode_attention(q, pool, tables, lens, d**-0.5, torch.empty_like(q), layer=5, num_layers=num_layers,
                           page_size=page, num_kv_heads=nkv)  # fmt: skip
    # a small batch's launch, split over the context (what attention_splits gives 2 sequences on the H200), + merge
    paged_decode_attention(q[:2], pool, tables[:2], lens[:2], d**-0.5, torch.empty_like(q[:2]), layer=5,
                           num_layers=num_layers, page_size=page, num_kv_heads=nkv,
                           config={**attention_config(4, d, page), "SPLITS": 16})  # fmt: skip
    hidden = torch.empty(batch, 4096, dtype=torch.bfloat16)
    qkv = torch.empty(batch, (32 + 2 * nkv) * d, dtype=torch.bfloat16)
    cos = torch.empty(seq, d, dtype=torch.bfloat16)
    gate_up = torch.empty(batch, 2 * 14336, dtype=torch.bfloat16)

    def term(t: torch.Tensor, deferred: bool) -> torch.Tensor | None:
        """The fp32 LoRA term of output t, or none."""
        return torch.empty(t.shape, dtype=torch.float32) if deferred else None

    for deferred in (False, True):
        add_rms_norm(hidden, torch.empty_like(hidden), torch.empty(4096, dtype=torch.bfloat16), 1e-5,
                     lora_delta=term(hidden, deferred))
        silu_mul(gate_up, term(gate_up, deferred))
        rope_kv_write(qkv[:, : 40 * d].view(batch, 40, d), qkv[:, 40 * d:].view(batch, nkv, d),
                      torch.zeros(batch, dtype=torch.int64), cos, torch.empty_like(cos),
                      pool.view(-1, num_layers, 2, page, nkv, d), 5, torch.arange(batch, dtype=torch.int64), 32,
                      lora_delta=term(qkv, deferred))


def gemm_launches(rows: int = 64, dtype: str = "bfloat16") -> None:
    """The base GEMM (``skinny_linear``, base_gemm="triton") of every Llama-3-8B projection group and the LM head at
    ``rows`` tokens of ``dtype``."""
    import torch

    from manylora.engine.model_config import ModelConfig
    from manylora.kernels.skinny_gemm import skinny_linear
    from perf.engine.shapes import SHAPES
    from perf.kernels.bench_gemm import gemm_shapes

    for out_features, in_features in gemm_shapes(ModelConfig.from_dict(SHAPES["llama3-8b"])).values():
        skinny_linear(torch.empty(rows, in_features, dtype=getattr(torch, dtype)),
                      torch.empty(out_features, in_features, dtype=getattr(torch, dtype)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON lines of the reports")
    parser.add_argument("--tokens", type=int, default=64, help="decode batch (BGMV launches)")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="prefill tokens (SGMV launches)")
    parser.add_argument("--distinct", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--by-line", action="store_true", help="also each kernel's PTX global accesses by source line")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the report compiles the kernels")
    rows: list[tuple[str, CompiledKernel]] = []
    for label, launch in (
        (f"decode T={args.tokens} d={args.distinct} r={args.rank}",
         lambda: lora_launches(args.tokens, args.distinct, args.rank, segmented=False)),
        (f"decode, device-built segments T={args.tokens} d={args.distinct} r={args.rank}",
         lambda: lora_launches(args.tokens, args.distinct, args.rank, segmented="device")),
        (f"prefill T={args.prefill_tokens} d={args.distinct} r={args.rank}",
         lambda: lora_launches(args.prefill_tokens, args.distinct, args.rank, segmented=True)),
        ("MoE-LoRA decode pairs, Qwen3-30B-A3B shape, T=64 d=8 r=16", moe_pair_launches),
        ("decode attention / norm / silu*mul", other_launches),
        (f"base GEMMs (split-K, base_gemm=triton) T={args.tokens}", lambda: gemm_launches(args.tokens)),
    ):  # fmt: skip
        with compile_only() as reports:
            launch()
        rows += [(label, r) for r in reports]
    if args.out:
        with open(args.out, "w") as f:
            for label, r in rows:
                f.write(json.dumps({"launches": label, **asdict(r)}, default=str) + "\n")
    print(f"Compiled for {H200.backend} sm_{H200.arch} (Triton {triton.__version__}); global access widths in bytes")
    last = None
    for label, r in rows:
        if label != last:
            print(f"\n{label}")
            last = label
        print("  " + r.summary())
        if args.by_line:
            for where, ops in r.by_line.items():
                print(f"      {where:24s} " + " ".join(f"{op}:{n}" for op, n in sorted(ops.items())))


if __name__ == "__main__":
    main()
