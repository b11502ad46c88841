"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face's implementation: RMSNorm in float32, rotate-half RoPE,
grouped-query attention, SwiGLU MLP; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from manylora.engine.config import PROJECTION_GROUPS
from manylora.engine.layers.decode_gemms import group_carveout
from manylora.engine.layers.lora_batch import LoraBatch, LoraDelta
from manylora.engine.layers.prefill_attention import attend, build_groups
from manylora.engine.layers.rope import RotaryEmbedding
from manylora.engine.layers.step_batch import DecodeRows, StepBatch
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.loader import load_state_dict

if TYPE_CHECKING:
    from manylora.engine.layers.comm import Comm

# base_gemm "auto": the Triton GEMM for captured steps with adapters of at most this many tokens (measured at 64)
AUTO_TRITON_MAX_ROWS = 64
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# a projection's output and, when its expand was deferred (``LoraBatch.expand_deferred``), its LoRA term: the one
# kernel that consumes the output adds it
Projected = tuple[torch.Tensor, LoraDelta | None]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: torch.Tensor  # [q_out + 2 * kv_out, hidden]: q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate_proj, up_proj stacked
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None = None  # [num_heads + num_kv_heads, head_dim]: q_norm per q head, then k_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def weight_names(cfg: ModelConfig) -> set[str]:
    """Every tensor name the model reads from a checkpoint."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.add(f"{p}self_attn.{m}.weight")
        for m in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"{p}mlp.{m}.weight")
        if cfg.qkv_bias:
            names |= {f"{p}self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")}
        if cfg.attention_bias:
            names.add(f"{p}self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names |= {f"{p}mlp.{m}.bias" for m in ("gate_proj", "up_proj", "down_proj")}
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


class LlamaModel:
    """Weights on one device and a forward pass over a flat batch of tokens.

    ``use_kernels`` (set by the engine on its kernel path) runs the residual add + RMSNorm as one
    Triton kernel unless ``fuse_add_norm`` is off, the MLP's silu(gate) * up as one unless ``fuse_silu_mul`` is
    off, and each layer's q/k norm, rotary embedding and KV-cache write as one unless ``fuse_rope_kv`` is off; the
    decode attention kernel is chosen by the batch (``StepBatch.decode``). Each of those fused kernels adds the LoRA
    term of the projection it consumes when the LoraBatch deferred that projection's expand (``_project``).
    ``base_gemm`` "triton" takes the base layers' GEMMs (and the LM head's) of steps of at most ``MAX_SKINNY_ROWS``
    tokens to ``kernels/skinny_gemm.py``; "auto" does so in CUDA-graph captures (and their warm-ups) with a LoraBatch
    of at most ``AUTO_TRITON_MAX_ROWS`` tokens, capturing each shrink after its GEMM (``_triton_gemm``).
    """

    use_kernels: bool = False
    fuse_add_norm: bool = True
    fuse_silu_mul: bool = True
    fuse_rope_kv: bool = True
    base_gemm: str = "torch"  # manylora.engine.config.BASE_GEMMS
    comm: Comm | None = None  # a tensor-parallel rank's collectives (parallel/runtime.py); None: one device
    graph_forward: bool = False  # the forwards are a CUDA-graph capture or its warm-ups (execution/cuda_graphs.py)
    lora_capture: bool = False  # this forward is one of those, with a LoraBatch (set by forward)
    lora_gemm_first: bool = False  # a capture whose base GEMMs leave SMs to the LoRA side stream: shrinks after GEMMs
    # in such a capture, the SMs a projection group's GEMM leaves in place of the capture's carveout (group name ->
    # SMs; manylora/engine/layers/decode_gemms.py PROJECTION_GROUPS)
    lora_group_carveouts: dict[str, int] | None = None
    # float32 [rows, vocab] the logits are written into (rows >= len(logits_rows)); None: a new tensor each forward.
    # Graphs that share one (the mixed-step graphs) keep no logits of their own in their memory pool.
    logits_out: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], max_len: int, device: str,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.embed = tensors["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
        self.final_norm = tensors["model.norm.weight"]
        self.layers = [self._layer(tensors, i) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg, max_len, device, dtype)
        self.scale = cfg.head_dim ** -0.5

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, max_len: int, device: str,
             dtype: torch.dtype, shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> LlamaModel:
        """Read the checkpoint's tensors for cfg; with ``shard`` (a tensor-parallel rank), cfg is the
        rank's local shape and shard(name, tensor) cuts each checkpoint tensor as it is read."""
        tensors = load_state_dict(model_dir, weight_names(cfg), dtype, device, transform=shard)
        return cls(cfg, tensors, max_len, device, dtype)

    def _layer(self, t: dict[str, torch.Tensor], i: int) -> LayerWeights:
        """Take layer i's tensors out of t, stacking projections that share an input."""
        p = f"model.layers.{i}."

        def take(name: str) -> torch.Tensor | None:
            return t.pop(name, None)

        def stacked(prefix: str, modules: tuple[str, ...], part: str) -> torch.Tensor | None:
            parts = [take(f"{prefix}{m}.{part}") for m in modules]
            return None if parts[0] is None else torch.cat(parts, dim=0)

        attn, mlp = p + "self_attn.", p + "mlp."
        w = LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            post_attention_norm=take(p + "post_attention_layernorm.weight"),
            qkv=stacked(attn, QKV, "weight"),
            qkv_bias=stacked(attn, QKV, "bias"),
            o=take(attn + "o_proj.weight"),
            o_bias=take(attn + "o_proj.bias"),
            gate_up=stacked(mlp, GATE_UP, "weight"),
            gate_up_bias=stacked(mlp, GATE_UP, "bias"),
            down=take(mlp + "down_proj.weight"),
            down_bias=take(mlp + "down_proj.bias"),
            q_norm=take(attn + "q_norm.weight"),
            k_norm=take(attn + "k_norm.weight"),
        )
        if w.q_norm is not None and w.k_norm is not None:  # one norm call over the q and k heads together
            cfg = self.cfg
            w.qk_norm = torch.cat([w.q_norm.expand(cfg.num_heads, -1), w.k_norm.expand(cfg.num_kv_heads, -1)])
        return w

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held (each counted once: tied embeddings share)."""
        seen, total = set(), 0
        tensors = [self.embed, self.lm_head, self.final_norm]
        for w in self.layers:
            tensors += [getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "qk_norm"]  # derived
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: PagedKVCache, lora: LoraBatch | None) -> torch.Tensor:
        """Run the step; returns float32 logits [len(batch.logits_rows), vocab]."""
        self.prepare_step(batch, kv)
        self.lora_capture = self.graph_forward and isinstance(lora, LoraBatch)
        if isinstance(lora, LoraBatch):
            lora.begin_forward(batch.input_ids.shape[0])
        h = self.embed[batch.input_ids]
        x, _ = self._add_norm(h, None, None, self.layers[0].input_norm)
        for i, w in enumerate(self.layers):
            x, h = self._add_norm(h, *self._attention(x, i, w, batch, kv, lora), w.post_attention_norm)
            delta, delta_lora = self._mlp(x, i, w, lora)
            if i + 1 < len(self.layers):  # the next layer's input norm, with this residual add
                x, h = self._add_norm(h, delta, delta_lora, self.layers[i + 1].input_norm)
            else:
                h = h + (delta_lora.add_into(delta) if delta_lora is not None else delta)
        h = rms_norm(h.index_select(0, batch.logits_rows), self.final_norm, self.cfg.rms_norm_eps)
        logits = self._linear(h, self.lm_head, None)
        if self.logits_out is None:
            return logits.float()
        out = self.logits_out[: logits.shape[0]]
        out.copy_(logits)  # the cast to float32, into the shared buffer
        return out

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, delta_lora: LoraDelta | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(h + delta) * weight, h + delta), delta with its deferred LoRA term delta_lora added first: one
        Triton kernel on the kernel path."""
        if self.use_kernels and self.fuse_add_norm:
            from manylora.kernels.add_rms_norm import add_rms_norm

            lora = delta_lora.ready() if delta_lora is not None else None
            return add_rms_norm(h, delta, weight, self.cfg.rms_norm_eps, lora_delta=lora)
        if delta_lora is not None:
            delta_lora.add_into(delta)
        h = h + delta if delta is not None else h
        return rms_norm(h, weight, self.cfg.rms_norm_eps), h

    def _mlp(self, x: torch.Tensor, i: int, w: LayerWeights, lora: LoraBatch | None) -> Projected:
        """Layer i's SwiGLU MLP with its LoRA, and the down projection's deferred LoRA term (subclasses replace it:
        MoeModel routes to experts)."""
        cfg = self.cfg
        fused_act = self.use_kernels and self.fuse_silu_mul
        gate_up, gate_up_lora = self._project(x, w.gate_up, w.gate_up_bias, i, lora, GATE_UP,
                                              (cfg.intermediate_size,) * 2, defer=fused_act)
        act = self._silu_mul(gate_up, gate_up_lora)
        down, down_lora = self._project(act, w.down, w.down_bias if self.comm is None else None, i, lora,
                                        ("down_proj",), (cfg.hidden_size,), defer=self._adds_row_parallel_lora())
        return self._reduce(down, w.down_bias), down_lora

    def _adds_row_parallel_lora(self) -> bool:
        """Whether the residual add + RMSNorm kernel takes o_proj's and down_proj's deferred LoRA terms: one device
        only (a tensor-parallel rank's partial sums need theirs before the all-reduce)."""
        return self.use_kernels and self.fuse_add_norm and self.comm is None

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, i: int,
                 lora: LoraBatch | None, modules: tuple[str, ...], widths: tuple[int, ...],
                 defer: bool = False) -> Projected:
        """(x @ weight^T (+ bias) with layer i's LoRA of ``modules`` added, None); or, with ``defer`` (the caller's
        consumer adds a LoraDelta) where the LoraBatch allows it, (the base output, its LoRA term computed beside
        the GEMM). On the kernel path the shrink is launched before the base GEMM (it needs only x: captured decode
        steps run it on a side stream beside the GEMM, and the deferred expand after it), or, captured with
        ``SHRINK_AFTER_GEMM``, base_gemm "auto"'s Triton GEMM or an SM carveout for the GEMMs (``lora_gemm_first``),
        right after the GEMM and from the same point (``LoraBatch.fork``)."""
        if lora is None:
            return self._linear(x, weight, bias), None
        if not lora.use_kernels:
            out = self._linear(x, weight, bias)
            lora.apply(x, out, i, modules, widths)
            return out, None
        gemm_first = self.lora_gemm_first or (self.base_gemm == "auto" and self._triton_gemm(x.shape[0]))
        fork = lora.fork(x, gemm_first=gemm_first)
        # with a fork the GEMM's node comes first and the shrink's beside it (LoraBatch.fork); else the shrink first
        out = self._group_linear(x, weight, bias, modules) if fork is not None else None
        pending = lora.shrink(x, i, modules, after=fork)
        term = lora.expand_deferred(pending, widths) if defer and lora.defers_expand(x, widths) else None
        if out is None:
            out = self._group_linear(x, weight, bias, modules)
        if term is None:
            lora.expand(pending, out, widths)
        return out, term

    def _group_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      modules: tuple[str, ...]) -> torch.Tensor:
        """``_linear``, under the SM carveout of the projection group of ``modules`` where the capture sets one."""
        if not self.lora_group_carveouts:
            return self._linear(x, weight, bias)
        with group_carveout(self.lora_group_carveouts.get(PROJECTION_GROUPS.get(modules[0], ""))):
            return self._linear(x, weight, bias)

    def _triton_gemm(self, rows: int) -> bool:
        """Whether a base GEMM of ``rows`` tokens takes the split-K Triton kernel (``base_gemm``): "triton" up to
        MAX_SKINNY_ROWS; "auto" up to AUTO_TRITON_MAX_ROWS inside a capture with a LoraBatch, where with the shrink
        captured after it the decode step measured fastest (perf/results/2026-12-02-h200/24_order), and not above
        (at 128 rows the kernel is 0.48-0.88x cuBLAS, 19_gemm) nor without adapters (cuBLAS as fast or faster)."""
        if not self.use_kernels:
            return False
        if self.base_gemm == "triton":
            from manylora.kernels.skinny_gemm import MAX_SKINNY_ROWS

            return rows <= MAX_SKINNY_ROWS
        return self.base_gemm == "auto" and self.lora_capture and rows <= AUTO_TRITON_MAX_ROWS

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T (+ bias): F.linear, or the split-K Triton GEMM for decode-sized steps (``_triton_gemm``)."""
        if self._triton_gemm(x.shape[0]):
            from manylora.kernels.skinny_gemm import skinny_linear

            return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _silu_mul(self, gate_up: torch.Tensor, gate_up_lora: LoraDelta | None = None) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up output [T, 2I] (its deferred LoRA term added first): one Triton
        kernel on the kernel path."""
        if self.use_kernels and self.fuse_silu_mul:
            from manylora.kernels.silu_mul import silu_mul

            return silu_mul(gate_up, gate_up_lora.ready() if gate_up_lora is not None else None)
        if gate_up_lora is not None:
            gate_up_lora.add_into(gate_up)
        gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
        return F.silu(gate) * up

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel projection's output (o_proj, down_proj). One device: the output itself. A
        tensor-parallel rank: its partial product, LoRA delta folded in, summed over ranks by one
        all-reduce, then the (whole) bias added once."""
        if self.comm is None:
            return partial
        self.comm.all_reduce(partial)
        return partial + bias if bias is not None else partial

    def prepare_step(self, batch: StepBatch, kv: PagedKVCache) -> None:
        """Tables every layer shares, computed once per forward (inside a graph when captured)."""
        if not (self.use_kernels and self.fuse_rope_kv):  # the fused kernel reads positions and slots itself
            batch.rope_cos, batch.rope_sin = self.rope.lookup(batch.positions)
            batch.kv_pages, batch.kv_offsets = kv.locate(batch.kv_slots)
        batch.prefill_groups = build_groups(batch.sequences, batch.positions, kv.page_size,
                                            self.cfg.sliding_window) if batch.sequences else None

    def _attention(self, x: torch.Tensor, i: int, w: LayerWeights, batch: StepBatch, kv: PagedKVCache,
                   lora: LoraBatch | None) -> Projected:
        """Layer i's attention block: o_proj's output and its deferred LoRA term."""
        cfg = self.cfg
        T = x.shape[0]
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused_rope = self.use_kernels and self.fuse_rope_kv
        qkv, qkv_lora = self._project(x, w.qkv, w.qkv_bias, i, lora, QKV, (q_out, kv_out, kv_out), defer=fused_rope)
        # q and k heads side by side ([T, nh + nkv, d], a view of qkv): one norm and one rotation for both
        qk = qkv[:, : q_out + kv_out].view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_out + kv_out:].view(T, cfg.num_kv_heads, cfg.head_dim)
        if fused_rope:
            from manylora.kernels.rope_kv import rope_kv_write

            q = rope_kv_write(qk, v, batch.positions, self.rope.cos, self.rope.sin, kv.storage, i, batch.kv_slots,
                              cfg.num_heads, w.qk_norm, cfg.rms_norm_eps,
                              lora_delta=qkv_lora.ready() if qkv_lora is not None else None)
        else:
            if w.qk_norm is not None:
                qk = rms_norm(qk, w.qk_norm, cfg.rms_norm_eps)
            table = (batch.rope_cos, batch.rope_sin) if batch.rope_cos is not None else None
            qk = self.rope.apply(qk, batch.positions, table)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
            located = (batch.kv_pages, batch.kv_offsets) if batch.kv_pages is not None else None
            kv.write(i, batch.kv_slots, k, v, located)
        out = torch.empty((T, cfg.num_heads, cfg.head_dim), dtype=q.dtype, device=q.device)
        if batch.decode is not None:
            self._decode_attention(q, out, i, batch.decode, kv)
        if batch.prefill_groups:
            attend(q, out, i, kv.storage, batch.prefill_groups, self.scale)
        attn = out.view(T, q_out)
        o, o_lora = self._project(attn, w.o, w.o_bias if self.comm is None else None, i, lora, ("o_proj",),
                                  (cfg.hidden_size,), defer=self._adds_row_parallel_lora())
        return self._reduce(o, w.o_bias), o_lora

    def _decode_attention(self, q: torch.Tensor, out: torch.Tensor, layer: int, decode: DecodeRows,
                          kv: PagedKVCache) -> None:
        """The decode rows (one new token of a sequence, or a prefill token with paged prefill), all in
        one paged-attention kernel launch."""
        from manylora.kernels.paged_attention import paged_decode_attention

        geometry = dict(layer=layer, num_layers=self.cfg.num_layers, page_size=kv.page_size,
                        num_kv_heads=self.cfg.num_kv_heads, table_rows=decode.table_rows)
        if decode.all_rows:  # every row of the step, in order: read q and write out in place
            paged_decode_attention(q, kv.pool.storage, decode.block_tables, decode.seq_lens, self.scale, out,
                                   **geometry)
            return
        rows = decode.rows
        result = torch.empty((rows.numel(), self.cfg.num_heads, self.cfg.head_dim), dtype=q.dtype, device=q.device)
        paged_decode_attention(q.index_select(0, rows), kv.pool.storage, decode.block_tables, decode.seq_lens,
                               self.scale, result, **geometry)
        out.index_copy_(0, rows, result)
