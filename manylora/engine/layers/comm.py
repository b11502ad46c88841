"""The collectives of a tensor-parallel rank's forward (torch.distributed), with a log of their payloads.

The model's layers call these; with size 1 (one device) nothing is sent. Imports nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommRecord:
    op: str  # "all_reduce" | "all_gather"
    kind: str  # "base" | "lora"
    elements: int  # payload: elements of the collective's result (per rank)
    bytes: int


@dataclass
class Comm:
    """torch.distributed collectives over one tensor-parallel group, logging payload sizes by kind.

    A fused collective (base and LoRA columns in one buffer) is one call, logged as one record per
    kind. With size 1 nothing is sent and nothing logged.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    log: list[CommRecord] = field(default_factory=list)

    @classmethod
    def from_default_group(cls) -> Comm:

        return cls(rank=dist.get_rank(), size=dist.get_world_size())

    def all_reduce(self, t: torch.Tensor, split: dict[str, int] | None = None) -> torch.Tensor:
        """Sum t over ranks in place. split: elements per kind in t (default all "base")."""
        if self.size == 1:
            return t

        dist.all_reduce(t, group=self.group)
        self._record("all_reduce", t, split)
        return t

    def all_gather(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """[size, *t.shape]: every rank's t, in rank order."""
        if self.size == 1:
            return t.unsqueeze(0)

        t = t.reshape(1, *t.shape).contiguous()
        out = torch.empty((self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, t, group=self.group)  # concatenates along dim 0
        self._record("all_gather", out, {kind: out.numel()})
        return out

    def _record(self, op: str, t: torch.Tensor, split: dict[str, int] | None) -> None:
        split = split or {"base": t.numel()}
        assert sum(split.values()) == t.numel(), (split, t.shape)
        for kind, n in split.items():
            if n:
                self.log.append(CommRecord(op, kind, n, n * t.element_size()))

    def total(self, kind: str, unit: str = "bytes") -> int:
        return sum(getattr(r, unit) for r in self.log if r.kind == kind)
