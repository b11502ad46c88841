"""Random-weight checkpoints of a named shape and random rank-r adapters, written as a user's would be.

The base is a Hugging Face Llama directory (config.json, sharded safetensors with an index,
a word-level tokenizer.json covering the whole vocabulary) that loads through the engine's
real loader and through transformers. Adapters are PEFT directories (adapter_config.json +
adapter_model.safetensors). For catalogues of thousands of 8B-shape adapters only a few
distinct adapter directories are written (2000 x 84 MB would not fit on disk) and the
catalogue points many names at each: names stay distinct to the engine (its caches key
on the name), but sha256s repeat and the OS page cache holds only the distinct files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_position_embeddings: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def projection_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features)."""
        q, kv, h, m = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, m),
            "up_proj": (h, m),
            "down_proj": (m, h),
        }[module]


SHAPES: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "tiny": ModelShape(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, max_position_embeddings=2048
    ),
}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer: id 0 "<s>", 1 "</s>", 2 "<unk>", 3 "Hello", then "w4", "w5", ..."""
    words = ["<s>", "</s>", "<unk>", "Hello"] + [f"w{i}" for i in range(4, vocab)]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": w,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, w in enumerate(words[:3])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "<unk>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))


def _tensors(shape: ModelShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor, in file order; init "normal" or "ones"."""
    out = [("model.embed_tokens.weight", (shape.vocab, shape.hidden), "normal")]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        for m in PROJECTIONS:
            part = "self_attn" if m in PROJECTIONS[:4] else "mlp"
            n_in, n_out = shape.projection_shape(m)
            out.append((f"{p}.{part}.{m}.weight", (n_out, n_in), "normal"))
        out += [
            (f"{p}.input_layernorm.weight", (shape.hidden,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (shape.hidden,), "ones"),
        ]
    out += [("model.norm.weight", (shape.hidden,), "ones"), ("lm_head.weight", (shape.vocab, shape.hidden), "normal")]
    return out


def write_config(out: str | Path, shape: ModelShape, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json of ``shape`` (Llama architecture) in ``out``: enough for adapters to be checked against."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": shape.vocab,
                "hidden_size": shape.hidden,
                "intermediate_size": shape.intermediate,
                "num_hidden_layers": shape.layers,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-5,
                "rope_theta": 500000.0,
                "max_position_embeddings": shape.max_position_embeddings,
                "bos_token_id": 0,
                "eos_token_id": 1,
                "tie_word_embeddings": False,
                "torch_dtype": _DTYPE_NAMES[dtype],
                "attention_bias": False,
                "mlp_bias": False,
            },
            indent=1,
        )
    )
    return out


def write_base(
    out: str | Path,
    shape: ModelShape,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    shard_bytes: int = 2 << 30,
    std: float = 0.02,
    seed: int = 0,
) -> Path:
    """A random checkpoint of ``shape``: sharded safetensors + index, config.json, tokenizer.json."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_files: list[list[str]] = [[]]
    size = 0
    total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"part-{len(shard_files):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            for key in shard:
                weight_map[key] = name
            shard_files.append([])
            shard, size = {}, 0

    for name, dims, init in _tensors(shape):
        if init == "ones":
            t = torch.ones(dims, dtype=dtype)
        else:
            t = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            flush()
        shard[name] = t
        size += nbytes
        total += nbytes
    flush()
    count = len(shard_files) - 1
    final = {}
    for i in range(1, count + 1):  # rename to the usual model-0000i-of-0000n names
        src, dst = out / f"part-{i:05d}.safetensors", out / f"model-{i:05d}-of-{count:05d}.safetensors"
        src.rename(dst)
        final[src.name] = dst.name
    weight_map = {k: final[v] for k, v in weight_map.items()}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    write_config(out, shape, dtype)
    write_tokenizer(out, shape.vocab)
    return out


def write_adapter(
    out: str | Path,
    shape: ModelShape,
    *,
    rank: int = 16,
    targets: tuple[str, ...] = PROJECTIONS,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 1,
    base_dir: str = "",
) -> Path:
    """A random PEFT LoRA adapter (nonzero A and B) for ``shape``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = 0.3 / rank**0.5
    tensors = {}
    for layer in range(shape.layers):
        for m in targets:
            part = "self_attn" if m in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            n_in, n_out = shape.projection_shape(m)
            for suffix, dims in (("lora_A", (rank, n_in)), ("lora_B", (n_out, rank))):
                t = torch.randn(dims, generator=gen, device=device) * scale
                tensors[f"{key}.{suffix}.weight"] = t.to(dtype).cpu().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(targets),
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "base_model_name_or_path": base_dir,
                "inference_mode": True,
            }
        )
    )
    return out


def write_adapter_catalogue(
    root: str | Path,
    shape: ModelShape,
    names: list[str],
    *,
    distinct: int = 8,
    rank: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    base_dir: str = "",
) -> dict[str, str]:
    """``distinct`` adapter directories under root; names[i] -> directory i % distinct. Writes catalogue.json."""
    root = Path(root)
    dirs = [
        str(
            write_adapter(
                root / f"distinct-{k:02d}",
                shape,
                rank=rank,
                dtype=dtype,
                device=device,
                seed=100 + k,
                base_dir=base_dir,
            )
        )
        for k in range(min(distinct, max(1, len(names))))
    ]
    catalogue = {name: dirs[i % len(dirs)] for i, name in enumerate(names)}
    (root / "catalogue.json").write_text(json.dumps(catalogue, indent=1))
    return catalogue
