"""The base model's shape, read from a Hugging Face config.json (Llama family)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from manylora.engine.errors import ModelLoadError

# architecture -> (q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Qwen3MoeForCausalLM": (False, True),
}

# Mixture-of-experts architectures (manylora/engine/models/moe.py).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# LoRA-targetable expert parameters, as PEFT's target_parameters name them on transformers 5's fused experts:
# gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I].
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")

# LoRA-targetable projections and where they sit in a decoder layer.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    attention_bias: bool = False  # o_proj bias too (Llama's attention_bias)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str | None = None
    # Mixture of experts (0 experts: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse MoE block; the others are dense

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def expert_shape(self, parameter: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's slice of a fused expert parameter."""
        shapes = {
            "gate_up_proj": (self.hidden_size, 2 * self.moe_intermediate_size),
            "down_proj": (self.moe_intermediate_size, self.hidden_size),
        }
        if parameter not in shapes:
            raise KeyError(f"unknown expert parameter '{parameter}'; known: {list(shapes)}")
        return shapes[parameter]

    def projection_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as nn.Linear stores them."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in shapes:
            raise KeyError(f"unknown projection '{module}'; known: {list(shapes)}")
        return shapes[module]

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architectures {archs} not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act '{cfg.get('hidden_act')}' not supported (silu only)")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling")
        if legacy:
            rope = {**legacy, **rope}
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ModelLoadError(f"{source}: rope_type '{rope_type}' not supported (default, linear, llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window", False):
            window = None
        moe = _moe_fields(cfg, arch, source) if arch in MOE_ARCHITECTURES else {}
        return cls(
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            **moe,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ModelLoadError(f"{path}: not found; a base model directory needs config.json") from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(cfg, source=str(path))


def _moe_fields(cfg: dict, arch: str, source: str) -> dict:
    """The MoE fields of a Mixtral or Qwen3-MoE config.json (transformers 5 writes num_local_experts for both)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        inter = int(cfg["intermediate_size"])
        norm_topk = True  # MixtralTopKRouter always renormalises the top-k probabilities
        sparse = tuple(range(layers)) if experts else ()
    else:
        inter = int(cfg.get("moe_intermediate_size") or 0)
        norm_topk = bool(cfg.get("norm_topk_prob", False))
        only_dense = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        sparse = tuple(i for i in range(layers) if i not in only_dense and experts > 0 and (i + 1) % step == 0)
    if sparse and (not top_k or top_k > experts or not inter):
        raise ModelLoadError(
            f"{source}: MoE config inconsistent: num_experts {experts}, num_experts_per_tok {top_k}, "
            f"expert intermediate size {inter}")
    return {"num_experts": int(experts) if sparse else 0, "num_experts_per_tok": int(top_k) if sparse else 0,
            "moe_intermediate_size": inter if sparse else 0, "norm_topk_prob": norm_topk, "sparse_layers": sparse}


def eos_token_ids(model_dir: str | Path, cfg: ModelConfig) -> frozenset[int]:
    """EOS ids from generation_config.json (which wins, as in transformers) or config.json."""
    ids = set(cfg.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids = set(eos) if isinstance(eos, list) else {eos}
    return frozenset(int(i) for i in ids)
