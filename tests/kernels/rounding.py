"""How the kernels round fp32 to bf16 where the tests run them: to nearest even compiled on a GPU (as torch does),
toward zero in Triton's interpreter (the low 16 bits dropped). Tests that compare a fused kernel with the same
kernel on inputs rounded on the host round those inputs the kernel's way, so that they can ask for equality."""

from __future__ import annotations

import torch


def to_bf16_as_kernels_round(x: torch.Tensor, device: str) -> torch.Tensor:
    """fp32 x rounded to bf16 as the kernels round on ``device`` (the interpreter's on "cpu")."""
    if device != "cpu":
        return x.to(torch.bfloat16)
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
