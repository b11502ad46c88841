"""Tensor parallelism (Megatron) for the Llama-family base model, with per-token LoRA.

Rank ``tp_rank`` of ``tp_size`` holds:

* q/k/v (column-parallel, split by heads): q heads ``[rank * nh/tp, (rank+1) * nh/tp)`` and
  KV heads ``[rank * nkv/tp, ...)``; with GQA each local q head's KV head is local too, because
  nh/tp is a multiple of the group size nh/nkv exactly when nkv % tp == 0.
* o_proj (row-parallel): the input columns of its local heads; the partial [T, H] outputs are
  summed by one all-reduce.
* gate/up (column-parallel, split by intermediate features), down (row-parallel, the same
  features of its input); one all-reduce.
* Embedding, norms, lm_head: replicated (every rank computes the same logits).

So the base needs two all-reduces of T * H elements per layer. The LoRA partition is in
manylora/engine/parallel/lora.py; docs/tensor-parallel.md has the derivation and communication volumes.

The forward here is a CPU/gloo proof of the partitioning: a flat batch of whole sequences
(prefill from position 0) with contiguous causal attention, no paged KV cache.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from manylora.engine.layers.comm import Comm
from manylora.engine.layers.prefill_attention import visible
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import GATE_UP, QKV, LlamaModel, rms_norm

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Raise ValueError unless heads, KV heads and intermediate features divide evenly over tp_size."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    problems = []
    if cfg.num_heads % tp_size:
        problems.append(f"num_attention_heads={cfg.num_heads}")
    if cfg.num_kv_heads % tp_size:
        problems.append(f"num_key_value_heads={cfg.num_kv_heads}")
    if cfg.intermediate_size % tp_size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor parallelism over {tp_size} GPUs needs {', '.join(problems)} divisible by {tp_size} "
            f"(KV heads are split, not replicated); choose a tp_size dividing "
            f"gcd(heads={cfg.num_heads}, kv_heads={cfg.num_kv_heads}, intermediate={cfg.intermediate_size})")


def local_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape one rank sees: its heads, KV heads and intermediate features (head_dim, hidden unchanged)."""
    check_tp(cfg, tp_size)
    return replace(cfg, num_heads=cfg.num_heads // tp_size, num_kv_heads=cfg.num_kv_heads // tp_size,
                   intermediate_size=cfg.intermediate_size // tp_size)


def feature_slice(cfg: ModelConfig, module: str, tp_rank: int, tp_size: int) -> slice:
    """The features of ``module`` rank tp_rank owns: output rows of a column-parallel weight, input
    columns of a row-parallel one (o_proj's inputs are q heads, down_proj's the intermediate features)."""
    check_tp(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    q_out = cfg.num_heads * cfg.head_dim
    kv_out = cfg.num_kv_heads * cfg.head_dim
    total = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out, "o_proj": q_out,
             "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
             "down_proj": cfg.intermediate_size}[module]
    n = total // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def _module_of(name: str) -> tuple[str | None, str]:
    """('q_proj', 'weight') for 'model.layers.3.self_attn.q_proj.weight'; (None, ...) if not a projection."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in COLUMN_PARALLEL + ROW_PARALLEL:
        return parts[-2], parts[-1]
    return None, parts[-1]


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank tp_rank's part of checkpoint tensor ``name`` (works tensor by tensor, e.g. while streaming
    a checkpoint). Row-parallel biases stay whole: they are added once, after the all-reduce."""
    module, part = _module_of(name)
    if module is None:
        return t
    s = feature_slice(cfg, module, tp_rank, tp_size)
    if module in COLUMN_PARALLEL:
        return t[s].contiguous()  # weight [out, in] rows, or bias [out]
    if part == "bias":
        return t
    return t[:, s].contiguous()


def shard_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig, tp_rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """shard_tensor over a whole state dict."""
    check_tp(cfg, tp_size)
    return {name: shard_tensor(name, t, cfg, tp_rank, tp_size) for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------- communication
# ---------------------------------------------------------------------------------------------------- forward
class TensorParallelLlama:
    """One tensor-parallel rank of a Llama-family decoder (CPU-provable: plain causal attention)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], comm: Comm, max_len: int = 256,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.cfg = cfg
        self.comm = comm
        self.local = local_config(cfg, comm.size)
        shards = shard_state_dict(tensors, cfg, comm.rank, comm.size)
        # LlamaModel stacks q/k/v and gate/up from the (sharded) names with the local shape.
        self.inner = LlamaModel(self.local, shards, max_len, device, dtype)

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: list[int], lora=None) -> torch.Tensor:
        """input_ids [T]: whole sequences back to back (each from position 0); float32 logits [T, vocab].

        lora: a manylora.engine.parallel.lora.TPLoraBatch for this rank (per-token adapters), or None.
        """
        cfg, loc, m = self.cfg, self.local, self.inner
        if sum(seq_lens) != input_ids.numel():
            raise ValueError(f"seq_lens sum {sum(seq_lens)} != {input_ids.numel()} tokens")
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens])
        q_loc, kv_loc = loc.num_heads * loc.head_dim, loc.num_kv_heads * loc.head_dim
        h = m.embed[input_ids]
        for i, w in enumerate(m.layers):
            # attention: column-parallel q/k/v, local heads, row-parallel o + all-reduce
            x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias)
            if lora is not None:
                lora.column(x, qkv, i, QKV, (q_loc, kv_loc, kv_loc))
            attn = self._attention(qkv, positions, seq_lens, w)
            h = h + self._row_parallel(attn, w.o, w.o_bias, i, "o_proj", lora)
            # MLP: column-parallel gate/up, row-parallel down + all-reduce
            x = rms_norm(h, w.post_attention_norm, cfg.rms_norm_eps)
            gate_up = F.linear(x, w.gate_up, w.gate_up_bias)
            if lora is not None:
                lora.column(x, gate_up, i, GATE_UP, (loc.intermediate_size,) * 2)
            gate, up = gate_up.split(loc.intermediate_size, dim=-1)
            act = F.silu(gate) * up
            h = h + self._row_parallel(act, w.down, w.down_bias, i, "down_proj", lora)
        h = rms_norm(h, m.final_norm, cfg.rms_norm_eps)
        return F.linear(h, m.lm_head).float()

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int,
                      module: str, lora) -> torch.Tensor:
        """A row-parallel projection: local partial product, its LoRA folded into the one all-reduce,
        the (whole, unsplit) bias added once after it."""
        out = F.linear(x, weight)
        out = lora.row(x, out, layer, module) if lora is not None else self.comm.all_reduce(out)
        return out + bias if bias is not None else out

    def _attention(self, qkv: torch.Tensor, positions: torch.Tensor, seq_lens: list[int], w) -> torch.Tensor:
        loc = self.local
        T = qkv.shape[0]
        q_loc, kv_loc = loc.num_heads * loc.head_dim, loc.num_kv_heads * loc.head_dim
        q, k, v = qkv.split((q_loc, kv_loc, kv_loc), dim=-1)
        q = q.reshape(T, loc.num_heads, loc.head_dim)
        k = k.reshape(T, loc.num_kv_heads, loc.head_dim)
        v = v.reshape(T, loc.num_kv_heads, loc.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, loc.rms_norm_eps)
            k = rms_norm(k, w.k_norm, loc.rms_norm_eps)
        q = self.inner.rope.apply(q, positions)
        k = self.inner.rope.apply(k, positions)
        out = torch.empty_like(q)
        start = 0
        for n in seq_lens:
            rows = slice(start, start + n)
            pos = positions[rows]
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                                               v[rows].transpose(0, 1), attn_mask=visible(pos, pos, loc.sliding_window),
                                               scale=self.inner.scale, enable_gqa=True)
            out[rows] = o.transpose(0, 1)
            start += n
        return out.reshape(T, q_loc)


def base_comm_elements_per_layer(num_tokens: int, hidden: int, tp_size: int) -> int:
    """Base all-reduce payload per layer: o_proj and down_proj outputs, T x H each."""
    return 0 if tp_size == 1 else 2 * num_tokens * hidden
