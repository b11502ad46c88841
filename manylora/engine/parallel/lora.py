"""LoRA under tensor parallelism: how A and B are split, and how the per-token delta is applied.

delta = scaling * (x A^T) B^T, A [r, in], B [out, r]. Two schemes per projection kind
(docs/tensor-parallel.md derives them and their communication volumes):

Column-parallel base (q/k/v/gate/up; x replicated, output split by features):
* ``"replicated_a"`` (default): A whole on every rank, B split by output rows like W. Each
  rank computes the full shrink x A^T [T, r] locally and its output shard; no communication.
* ``"gather"`` (S-LoRA): A split along r (padded to a multiple of tp), B split by output rows.
  Each rank shrinks to [T, r/tp]; one all-gather (fused over the layer's q/k/v, or gate/up)
  makes the [T, r] every rank needs. Saves A memory and shrink FLOPs by tp; costs T*r traffic.

Row-parallel base (o/down; x split along its features, partial outputs all-reduced):
* ``"fold"`` (default): A split by input columns like W, B whole. x_i A_i^T is a partial sum of
  x A^T, and delta is linear in it, so each rank adds (x_i A_i^T) B^T into its partial output
  before the base all-reduce: the base collective carries the delta; no extra traffic.
* ``"reduce"`` (S-LoRA's A2 row-split + all-reduce): the [T, r] partials ride in the base
  all-reduce as extra columns (one fused collective), then B (whole) expands the reduced [T, r].
  Extra payload T*r per projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from manylora.engine.adapters.spec import LoraWeights
from manylora.engine.layers.comm import Comm
from manylora.engine.model_config import ModelConfig
from manylora.engine.parallel.sharding import COLUMN_PARALLEL, check_tp, feature_slice

ColumnMode = Literal["replicated_a", "gather"]
RowMode = Literal["fold", "reduce"]


@dataclass
class ShardedLora:
    """One (layer, projection) of one adapter on one rank."""

    a: torch.Tensor  # [r_local, in_local]
    b: torch.Tensor  # [out_local, r_b]
    scaling: float
    rank: int  # the module's full rank


def shard_lora(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], cfg: ModelConfig,
               tp_rank: int, tp_size: int, column_mode: ColumnMode = "replicated_a",
               row_mode: RowMode = "fold") -> dict[tuple[int, str], ShardedLora]:
    """Rank tp_rank's part of an adapter; weights as LoraWeights.weights: (layer, proj) -> (A, B, scaling)."""
    check_tp(cfg, tp_size)
    if column_mode not in ("replicated_a", "gather") or row_mode not in ("fold", "reduce"):
        raise ValueError(f"unknown modes {column_mode!r}, {row_mode!r}")
    out = {}
    for (layer, module), (a, b, scaling) in weights.items():
        r = a.shape[0]
        s = feature_slice(cfg, module, tp_rank, tp_size)
        if module in COLUMN_PARALLEL:
            b_loc = b[s]
            if column_mode == "gather":
                padded = -(-r // tp_size) * tp_size
                c = padded // tp_size
                a_pad = torch.cat([a, a.new_zeros(padded - r, a.shape[1])])
                b_loc = torch.cat([b_loc, b_loc.new_zeros(b_loc.shape[0], padded - r)], dim=1)
                a_loc = a_pad[tp_rank * c:(tp_rank + 1) * c]
            else:
                a_loc = a
        else:
            a_loc, b_loc = a[:, s], b
        out[(layer, module)] = ShardedLora(a_loc.contiguous(), b_loc.contiguous(), float(scaling), r)
    return out


def shard_lora_weights(weights: LoraWeights, cfg: ModelConfig, tp_rank: int, tp_size: int) -> LoraWeights:
    """Rank tp_rank's part of a loaded adapter in the engine's layout ("replicated_a" and "fold"):
    column-parallel projections keep A whole and B's rows of the rank's output features;
    row-parallel ones keep A's columns of the rank's input features and B whole. The shard's
    shapes are those of ``local_config(cfg, tp_size)``, and every module keeps its full rank, so
    every rank packs an adapter into the same number of pages at the same offsets."""
    check_tp(cfg, tp_size)
    if weights.expert_weights:
        raise ValueError(f"adapter '{weights.spec.name}': tensor parallelism does not support expert (MoE) LoRA")
    out = {}
    for (layer, module), (a, b, scaling) in weights.weights.items():
        s = feature_slice(cfg, module, tp_rank, tp_size)
        if module in COLUMN_PARALLEL:
            out[(layer, module)] = (a, b[s].contiguous(), scaling)
        else:
            out[(layer, module)] = (a[:, s].contiguous(), b, scaling)
    return LoraWeights(weights.spec, out)


class TPLoraBatch:
    """Which adapter serves each token of a flat batch (-1: none), on one tensor-parallel rank."""

    def __init__(self, token_slots: list[int], adapters: list[dict[tuple[int, str], ShardedLora]], comm: Comm,
                 column_mode: ColumnMode = "replicated_a", row_mode: RowMode = "fold", device: str = "cpu") -> None:
        self.adapters = adapters
        self.comm = comm
        self.column_mode = column_mode
        self.row_mode = row_mode
        self.num_tokens = len(token_slots)
        self.rows = [torch.tensor([t for t, s in enumerate(token_slots) if s == slot], dtype=torch.int64,
                                  device=device) for slot in range(len(adapters))]

    def _active(self, layer: int, module: str):
        for slot, rows in enumerate(self.rows):
            mod = self.adapters[slot].get((layer, module))
            if mod is not None and rows.numel():
                yield rows, mod

    # ------------------------------------------------------------------------------------ column-parallel
    def column(self, x: torch.Tensor, out: torch.Tensor, layer: int, modules: tuple[str, ...],
               widths: tuple[int, ...]) -> None:
        """out[:, module's local columns] += delta, for projections sharing the replicated input x."""
        bounds = [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        if self.column_mode == "replicated_a":
            for i, module in enumerate(modules):
                cols = out[:, bounds[i]:bounds[i + 1]]
                for rows, mod in self._active(layer, module):
                    delta = (x.index_select(0, rows) @ mod.a.t()) @ mod.b.t()
                    cols.index_add_(0, rows, delta, alpha=mod.scaling)
            return
        # S-LoRA: shrink to this rank's r/tp, all-gather (one fused call for the group), expand.
        # Every rank sees the same batch and adapters, so all agree on width (and on skipping).
        width = max([mod.a.shape[0] for m in modules for _, mod in self._active(layer, m)], default=0)
        if width == 0:
            return
        y = x.new_zeros((len(modules), x.shape[0], width))
        for i, module in enumerate(modules):
            for rows, mod in self._active(layer, module):
                y[i].index_copy_(0, rows, torch.nn.functional.pad(x.index_select(0, rows) @ mod.a.t(),
                                                                  (0, width - mod.a.shape[0])))
        gathered = self.comm.all_gather(y, "lora")  # [tp, n_modules, T, width]
        for i, module in enumerate(modules):
            cols = out[:, bounds[i]:bounds[i + 1]]
            for rows, mod in self._active(layer, module):
                c = mod.a.shape[0]
                y_full = gathered[:, i].index_select(1, rows)[:, :, :c]  # [tp, n, c]
                y_full = y_full.permute(1, 0, 2).reshape(rows.numel(), -1)  # A's padded row order
                cols.index_add_(0, rows, y_full @ mod.b.t(), alpha=mod.scaling)

    # --------------------------------------------------------------------------------------- row-parallel
    def row(self, x_shard: torch.Tensor, partial: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """partial: this rank's x_shard W_shard^T [T, H]. Returns the all-reduced output with LoRA."""
        if self.row_mode == "fold":
            for rows, mod in self._active(layer, module):
                delta = (x_shard.index_select(0, rows) @ mod.a.t()) @ mod.b.t()
                partial.index_add_(0, rows, delta, alpha=mod.scaling)
            return self.comm.all_reduce(partial)
        active = list(self._active(layer, module))
        width = max([mod.rank for _, mod in active], default=0)  # the same on every rank
        T, H = partial.shape
        buf = partial.new_zeros((T, H + width))
        buf[:, :H] = partial
        for rows, mod in active:
            buf[:, H:H + mod.rank].index_copy_(0, rows, x_shard.index_select(0, rows) @ mod.a.t())
        self.comm.all_reduce(buf, {"base": T * H, "lora": T * width})
        out = buf[:, :H].contiguous()
        for rows, mod in active:
            out.index_add_(0, rows, buf[:, H:H + mod.rank].index_select(0, rows) @ mod.b.t(), alpha=mod.scaling)
        return out


def lora_comm_elements_per_layer(num_tokens: int, max_rank: int, tp_size: int, column_mode: ColumnMode,
                                 row_mode: RowMode, column_groups: tuple[int, ...] = (3, 2),
                                 row_projections: int = 2) -> int:
    """LoRA payload per layer (elements of the collectives' results), all 7 projections adapted.

    gather: one all-gather per column group (q/k/v: 3, gate/up: 2) of [tp, n, T, ceil(r/tp)];
    reduce: r extra columns on each row-parallel projection's [T, H] all-reduce.
    """
    if tp_size == 1:
        return 0
    total = 0
    if column_mode == "gather":
        total += sum(column_groups) * num_tokens * tp_size * -(-max_rank // tp_size)
    if row_mode == "reduce":
        total += row_projections * num_tokens * max_rank
    return total
