"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): Llama attention, sparse SwiGLU experts.

Numerics follow transformers 5 (MixtralTopKRouter / Qwen3MoeTopKRouter, *Experts):
router logits = x @ gate^T; probabilities = softmax in float32 over all experts; top-k;
Mixtral always renormalises the k probabilities to sum 1, Qwen3-MoE only when norm_topk_prob.
Each routed expert is a SwiGLU over its slice of the fused gate_up [E, 2I, H] (gate rows, then
up rows) and down [E, H, I]; the outputs are summed weighted by the k probabilities.
Qwen3-MoE layers outside the sparse pattern (mlp_only_layers, decoder_sparse_step) are dense.

Checkpoints: transformers 5 saves (and older checkpoints hold) one tensor per expert:
Mixtral ``block_sparse_moe.experts.{e}.w1|w3|w2`` (gate, up, down) and ``block_sparse_moe.gate``,
Qwen3-MoE ``mlp.experts.{e}.gate_proj|up_proj|down_proj`` and ``mlp.gate``. The fused layout
(``mlp.experts.gate_up_proj`` / ``down_proj``, router ``mlp.gate``) loads too.

LoRA on the experts (PEFT target_parameters, see manylora/engine/adapters/spec.py) is applied per
(token, routed expert) pair with the token's adapter, through LoraBatch.apply_expert.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from manylora.engine.errors import ModelLoadError
from manylora.engine.layers.lora_batch import LoraBatch
from manylora.engine.layers.step_batch import StepBatch
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import LayerWeights, LlamaModel, Projected, weight_names
from manylora.engine.models.loader import checkpoint_files, load_state_dict

GATE_UP_PARAM, DOWN_PARAM = 0, 1  # expert parameter index (EXPERT_PARAMETERS order)


@dataclass
class MoeLayerWeights(LayerWeights):
    router: torch.Tensor | None = None  # [E, hidden]
    experts_gate_up: torch.Tensor | None = None  # [E, 2 * I, hidden]
    experts_down: torch.Tensor | None = None  # [E, hidden, I]


def _checkpoint_keys(model_dir: str | Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys.update(f.keys())
        except (OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from e
    return keys


def _expert_layout(cfg: ModelConfig, keys: set[str], layer: int) -> tuple[str, dict[str, str]]:
    """('fused' | 'per_expert', names): where layer's router and experts sit in the checkpoint."""
    p = f"model.layers.{layer}."
    fused = {"router": p + "mlp.gate.weight", "gate_up": p + "mlp.experts.gate_up_proj",
             "down": p + "mlp.experts.down_proj"}
    if fused["gate_up"] in keys:
        return "fused", fused
    if cfg.architecture == "MixtralForCausalLM":
        block = p + "block_sparse_moe."
        if block + "gate.weight" in keys:
            return "per_expert", {"router": block + "gate.weight", "experts": block + "experts.{e}.",
                                  "gate": "w1", "up": "w3", "down": "w2"}
    return "per_expert", {"router": p + "mlp.gate.weight", "experts": p + "mlp.experts.{e}.",
                          "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def moe_weight_names(cfg: ModelConfig, keys: set[str]) -> set[str]:
    """Every tensor name the MoE model reads, given the names the checkpoint holds."""
    names = {n for n in weight_names(cfg) if not _is_dense_mlp_name(cfg, n)}
    for i in cfg.sparse_layers:
        kind, where = _expert_layout(cfg, keys, i)
        if kind == "fused":
            names |= set(where.values())
            continue
        names.add(where["router"])
        for e in range(cfg.num_experts):
            prefix = where["experts"].format(e=e)
            names |= {f"{prefix}{where[m]}.weight" for m in ("gate", "up", "down")}
    return names


def _is_dense_mlp_name(cfg: ModelConfig, name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 4 and parts[3] == "mlp" and cfg.is_sparse_layer(int(parts[2]))


class MoeModel(LlamaModel):
    """LlamaModel's attention and paged KV cache with sparse MoE MLPs.

    With ``use_kernels`` (set by the engine on its kernel path) the experts and their LoRA run in the
    fused MoE-LoRA Triton kernels; otherwise, and for adapters those kernels cannot express, as a
    torch loop over experts.
    """

    use_kernels: bool = False

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], max_len: int, device: str,
                 dtype: torch.dtype) -> None:
        self._keys = set(tensors)
        super().__init__(cfg, tensors, max_len, device, dtype)

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, max_len: int, device: str,
             dtype: torch.dtype) -> MoeModel:
        tensors = load_state_dict(model_dir, moe_weight_names(cfg, _checkpoint_keys(model_dir)), dtype, device)
        return cls(cfg, tensors, max_len, device, dtype)

    def _layer(self, t: dict[str, torch.Tensor], i: int) -> MoeLayerWeights:
        base = super()._layer(t, i)
        w = MoeLayerWeights(**{f.name: getattr(base, f.name) for f in fields(LayerWeights)})
        if not self.cfg.is_sparse_layer(i):
            return w
        kind, where = _expert_layout(self.cfg, self._keys, i)
        w.router = t.pop(where["router"])
        if kind == "fused":
            w.experts_gate_up, w.experts_down = t.pop(where["gate_up"]), t.pop(where["down"])
        else:
            gate_up, down = [], []
            for e in range(self.cfg.num_experts):
                prefix = where["experts"].format(e=e)
                gate_up.append(torch.cat([t.pop(f"{prefix}{where['gate']}.weight"),
                                          t.pop(f"{prefix}{where['up']}.weight")], dim=0))
                down.append(t.pop(f"{prefix}{where['down']}.weight"))
            w.experts_gate_up, w.experts_down = torch.stack(gate_up), torch.stack(down)
        E, I, H = self.cfg.num_experts, self.cfg.moe_intermediate_size, self.cfg.hidden_size
        for name, got, want in (("router", w.router, (E, H)), ("experts gate_up", w.experts_gate_up, (E, 2 * I, H)),
                                ("experts down", w.experts_down, (E, H, I))):
            if tuple(got.shape) != want:
                raise ModelLoadError(f"layer {i} {name}: shape {list(got.shape)}, config implies {list(want)}")
        return w

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: PagedKVCache, lora: LoraBatch | None) -> torch.Tensor:
        """LlamaModel.forward. Inside a CUDA-graph capture only the fused expert kernels can run (static shapes; the
        torch loop over experts has data-dependent ones), with a graph-mode LoraBatch (``from_tables(...,
        graph_experts=True)``) or none."""
        capturing = self.device.startswith("cuda") and torch.cuda.is_current_stream_capturing()
        if capturing and (not self.use_kernels or (lora is not None and not lora.has_static_expert_path())):
            raise RuntimeError("an MoE decode step is captured in a CUDA graph only on the kernel path, with a "
                               "graph-mode LoraBatch (the torch expert loop has data-dependent shapes)")
        return super().forward(batch, kv, lora)

    def _mlp(self, x: torch.Tensor, i: int, w: MoeLayerWeights, lora: LoraBatch | None) -> Projected:
        """Sparse layers route to experts (no deferred LoRA term); dense ones (Qwen3-MoE's mlp_only_layers) are
        LlamaModel's MLP."""
        return (self._sparse_mlp(x, i, w, lora), None) if w.router is not None else super()._mlp(x, i, w, lora)

    def _fused_experts(self, x: torch.Tensor, i: int, w: MoeLayerWeights, lora: LoraBatch | None,
                       top_w: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor | None:
        """The experts (and their LoRA) through kernels.fused_moe_lora; None where it cannot express the batch."""
        from manylora.kernels.fused_moe_lora import fused_moe_lora_forward

        moe_lora = None
        if lora is not None and lora.has_expert_lora(i):
            moe_lora = lora.moe_lora(i)
            if moe_lora is None:
                return None
        out = fused_moe_lora_forward(x, w.experts_gate_up, w.experts_down, top_ids.to(torch.int32),
                                     top_w.float(), moe_lora)
        return out.to(x.dtype)

    def route(self, x: torch.Tensor, w: MoeLayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k] float32, top-k expert ids [T, k]) as transformers' routers compute them."""
        cfg = self.cfg
        probs = torch.softmax(F.linear(x, w.router).float(), dim=-1)
        top_w, top_ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if cfg.architecture != "MixtralForCausalLM":
            top_w = top_w.to(x.dtype)  # Qwen3MoeTopKRouter casts back to the logits' dtype; Mixtral keeps float32
        return top_w, top_ids

    def _sparse_mlp(self, x: torch.Tensor, i: int, w: MoeLayerWeights, lora: LoraBatch | None) -> torch.Tensor:
        top_w, top_ids = self.route(x, w)
        if self.use_kernels:
            fused = self._fused_experts(x, i, w, lora, top_w, top_ids)
            if fused is not None:
                return fused
        out = torch.zeros_like(x)
        expert_lora = lora is not None and lora.has_expert_lora(i)
        for e in torch.unique(top_ids).tolist():
            tokens, k = torch.where(top_ids == e)
            xe = x.index_select(0, tokens)
            gate_up = F.linear(xe, w.experts_gate_up[e])
            if expert_lora:
                lora.apply_expert(xe, gate_up, tokens, i, e, GATE_UP_PARAM)
            act = self._silu_mul(gate_up)
            y = F.linear(act, w.experts_down[e])
            if expert_lora:
                lora.apply_expert(act, y, tokens, i, e, DOWN_PARAM)
            out.index_add_(0, tokens, (y * top_w[tokens, k, None]).to(out.dtype))
        return out
