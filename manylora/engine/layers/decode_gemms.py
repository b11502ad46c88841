"""How a captured decode step's base GEMMs share the GPU with the LoRA side stream: cuBLAS's interface and SM carveout.

In a captured decode step each LoRA shrink and deferred expand runs on a side stream beside its base GEMM
(``lora_batch.py``). A GEMM whose grid fills every SM leaves those kernels nothing to run on until its
tiles drain, and their programs, once scheduled, hold SMs the GEMM's next tiles wanted. cuBLASLt can aim a GEMM at
fewer SMs (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``, which torch sets from its experimental "SM carveout"; the
plain cuBLAS interface does not honour it): the LoRA kernels then get SMs of their own, and the shrink is captured
after its GEMM (``LoraBatch.fork``) so that the GEMM's tiles are placed first. Both settings are read when a GEMM
is captured, so they are applied around each decode graph's warm-ups and capture and restored after: prefill and
mixed steps keep torch's defaults.

Measured on the H200 (perf/results/2026-12-03-h200/8_carveout/, 9_carveout_ab/; Llama-3-8B shapes, batch 64, rank
16): a layer's four GEMMs at 64 rows alone took 0.95x of cuBLAS's time through cuBLASLt (the down projection 0.89x);
the decode step with 8 / 32 / 64 adapters took 0.95 / 0.97 / 0.96x of the previous settings' (cuBLAS, no carveout,
shrink first) with these (cuBLASLt, 32 SMs, shrink after), 4 interleaved rounds, of which cuBLASLt alone (shrink
after) gave 0.97 / 0.98 / 0.97x; base-only 0.96x (cuBLASLt). An earlier run of 3 rounds gave 0.90 / 0.91 / 0.92x.
The plain cuBLAS interface timed the same with and without a carveout. End to end (the headline at n = 5 / 100, one
sample each) the two settings served the same: 17.26 / 16.96 against 17.24 / 17.05 req/s.

Each projection group's GEMM may take its own count (``DecodeGemmSettings.group_carveouts``, set around that GEMM by
``LlamaModel._group_linear`` within the capture): the q/k/v GEMM (17 us at batch 64) is shorter than its LoRA
kernels on 32 SMs, so the RoPE + KV write waited for them; leaving it 64 (with gate/up at 16) halved that wait
without slowing the GEMM (perf/results/2026-12-03-h200/15_groups/). The step with qkv=64 took 0.981 / 0.984 / 0.987x,
0.984 / 0.978 / 0.994x and then 1.012 / 1.024 / 1.025x of 32 for every GEMM at 8 / 32 / 64 adapters in three calls
(16_groups_ab/, 17_qkv/, 18_qkv_check/), within the spread of identical base-only graphs in one call (up to 3%); the
headline did not move. Not established, so it is opt-in (EngineConfig.decode_gemm_group_carveouts, default none).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from manylora.engine.config import parse_group_carveouts

# A projection group's name (DecodeGemmSettings.group_carveouts) by the first LoRA module of the group


@dataclass(frozen=True)
class DecodeGemmSettings:
    """What one decode graph's capture runs its base GEMMs with."""

    blas: str  # torch.backends.cuda.preferred_blas_library: "cublas" or "cublaslt"
    sm_carveout: int  # SMs the GEMMs leave free (0: none; cuBLASLt only)
    # (projection group, SMs) in place of sm_carveout for that group's GEMM (PROJECTION_GROUPS' values)
    group_carveouts: tuple[tuple[str, int], ...] = ()

    @property
    def gemm_first(self) -> bool:
        """Whether the side-stream shrink is captured after its GEMM (``LoraBatch.fork``): with a carveout, so
        that the GEMM's tiles take their SMs before the shrink's programs take the rest."""
        return self.sm_carveout > 0 or any(sms > 0 for _, sms in self.group_carveouts)

    @classmethod
    def for_graph(cls, blas: str, sm_carveout: int, with_lora: bool,
                  group_carveouts: tuple[tuple[str, int], ...] = ()) -> DecodeGemmSettings:
        """A decode graph's settings: the carveout only where a LoRA side stream runs beside the GEMMs (a
        base-only step would just lose the SMs)."""
        if not with_lora:
            return cls(blas=blas, sm_carveout=0)
        return cls(blas=blas, sm_carveout=sm_carveout, group_carveouts=group_carveouts)


def parse_carveout(spec: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """``"32"`` or ``"32/qkv=48/gate_up=16"``: the SMs every base GEMM leaves free, then per projection group the
    count that replaces it for that group's GEMM (``parse_group_carveouts``). Raises a ValueError naming the spec."""
    default, _, groups = spec.partition("/")
    if not default.isdigit():
        raise ValueError(f"SM carveout {spec!r}: expected N or N/group=N/..., e.g. 32/qkv=48/gate_up=16")
    return int(default), parse_group_carveouts(groups)


@contextmanager
def group_carveout(sms: int | None) -> Iterator[None]:
    """Within: torch's SM carveout set to ``sms`` for the GEMMs launched (None: unchanged); restored after."""
    if sms is None:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


# The carveout measured on the H200 (32 of its 132 SMs); EngineConfig.decode_gemm_sm_carveout None scales it to the
# device's SM count
MEASURED_CARVEOUT, MEASURED_SMS = 32, 132


def sm_carveout_for(sm_carveout: int | None, blas: str, device_sms: int) -> int:
    """The SMs a decode graph with adapters leaves to the LoRA kernels on a device of ``device_sms`` SMs:
    ``sm_carveout``, or for None 32 of every 132 (the H200's measured setting; 0 through cuBLAS, which ignores a
    target). Raises a ValueError naming the setting when it would leave the GEMMs no SM."""
    if sm_carveout is None:
        return device_sms * MEASURED_CARVEOUT // MEASURED_SMS if blas == "cublaslt" else 0
    if sm_carveout >= device_sms:
        raise ValueError(f"EngineConfig.decode_gemm_sm_carveout={sm_carveout} leaves none of the device's "
                         f"{device_sms} SMs to the GEMMs")
    return sm_carveout


def group_carveouts_for(spec: str, device_sms: int) -> tuple[tuple[str, int], ...]:
    """The (projection group, SMs) pairs a decode graph with adapters runs those groups' GEMMs with in place of its
    carveout: ``spec`` parsed (``parse_group_carveouts``; "": none). Raises a ValueError naming the setting when a
    count would leave the GEMMs no SM."""
    groups = parse_group_carveouts(spec, "EngineConfig.decode_gemm_group_carveouts")
    for group, sms in groups:
        if sms >= device_sms:
            raise ValueError(f"EngineConfig.decode_gemm_group_carveouts {group}={sms} leaves none of the device's "
                             f"{device_sms} SMs to the GEMMs")
    return groups


def device_sm_carveout(sm_carveout: int | None, blas: str, device: str) -> int:
    """``sm_carveout_for`` on CUDA device ``device``'s SM count."""
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return sm_carveout_for(sm_carveout, blas, sms)


def device_group_carveouts(spec: str, device: str) -> tuple[tuple[str, int], ...]:
    """``group_carveouts_for`` on CUDA device ``device``'s SM count."""
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return group_carveouts_for(spec, sms)


@contextmanager
def applied(settings: DecodeGemmSettings | None, device: str) -> Iterator[None]:
    """Within: torch's cuBLAS interface and SM carveout as ``settings`` say (CUDA devices only; None or a CPU
    device: unchanged); torch's previous values restored after."""
    if settings is None or not str(device).startswith("cuda"):
        yield
        return
    blas_before = torch.backends.cuda.preferred_blas_library()
    carveout_before = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library(settings.blas)
    torch._C._set_sm_carveout_experimental(settings.sm_carveout or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout_before)
        torch.backends.cuda.preferred_blas_library(blas_before)
