"""Build the embedded default model: tokenizer, tiny Llama base, LoRA adapters, catalogue.

Usage::

    python -m manylora.embedded.build --out build/default

Layout written under ``OUT``::

    base/            LlamaForCausalLM checkpoint + tokenizer.json + generation_config.json
    adapters/<name>/ PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors)
    catalogue.json   {"<name>": "/abs/path/to/OUT/adapters/<name>", ...}
    build.json       marker: hash of the build parameters, corpus and the build's sources (written last)

Everything is seeded and single-threaded-by-default, so a rebuild gives the same weights.
An existing complete build with the same hash is left alone.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from manylora.embedded import CORPUS_PATH
from manylora.embedded.tokenizer import save_tokenizer, token_stream, train_tokenizer
from manylora.embedded.training import make_base_model, train_adapter, train_lm
from manylora.embedded.transforms import TRANSFORMS

BUILD_FORMAT = 1
MARKER_NAME = "build.json"
SUMMARY_PROMPT = "Every Saturday there is a market"  # all adapters visibly differ on it


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelShape:
    """Shape of the tiny Llama base (vocab size comes from the tokenizer)."""

    num_hidden_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 176
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser settings for one training run (base or adapter)."""

    steps: int
    lr: float
    batch_size: int = 16
    seq_len: int = 64
    warmup_steps: int = 20
    weight_decay: float = 0.01


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter: the text transform it learns and its PEFT LoRA settings."""

    name: str
    transform: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    layers_to_transform: tuple[int, ...] | None = None
    lr: float = 1.5e-2


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

DEFAULT_ADAPTERS: tuple[AdapterSpec, ...] = (
    AdapterSpec("shout", "upper", rank=8, alpha=16, target_modules=ALL_PROJECTIONS, lr=1e-2),
    AdapterSpec("pirate", "pirate", rank=16, alpha=32, target_modules=("q_proj", "v_proj", "o_proj")),
    AdapterSpec(
        "whisper", "whisper", rank=4, alpha=8, target_modules=("gate_proj", "up_proj", "down_proj"),
        use_rslora=True,
    ),
    AdapterSpec(
        "numbers", "count_words", rank=32, alpha=48, target_modules=("k_proj", "v_proj", "up_proj"),
        layers_to_transform=(1, 2),
    ),
)


@dataclass(frozen=True)
class BuildParams:
    """Everything that determines the build's bytes (hashed into the marker)."""

    steps: int = 400
    adapter_steps: int = 200
    seed: int = 0
    vocab_size: int = 1024
    base_lr: float = 8e-3
    shape: ModelShape = field(default_factory=ModelShape)
    adapters: tuple[AdapterSpec, ...] = DEFAULT_ADAPTERS
    num_threads: int = 1

    def base_train(self) -> TrainConfig:
        """Training settings for the base model."""
        return TrainConfig(steps=self.steps, lr=self.base_lr, warmup_steps=max(1, min(20, self.steps // 10)))

    def adapter_train(self, spec: AdapterSpec) -> TrainConfig:
        """Training settings for one adapter."""
        return TrainConfig(steps=self.adapter_steps, lr=spec.lr, warmup_steps=max(1, min(10, self.adapter_steps // 10)))



def load_paragraphs(path: Path = CORPUS_PATH) -> list[str]:
    """The corpus as a list of paragraphs (blank-line separated, whitespace-normalised)."""
    blocks = path.read_text(encoding="utf-8").split("\n\n")
    return [" ".join(block.split()) for block in blocks if block.strip()]


# --------------------------------------------------------------------------- marker / layout


def build_hash(params: BuildParams, corpus_path: Path = CORPUS_PATH) -> str:
    """sha256 of the build parameters, the corpus bytes and the build's sources (this file, the tokenizer's, the
    transforms' and the training's)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": BUILD_FORMAT, "params": asdict(params)}, sort_keys=True).encode())
    digest.update(corpus_path.read_bytes())
    for source in (Path(__file__), *(Path(__file__).with_name(n) for n in ("tokenizer.py", "transforms.py",
                                                                          "training.py"))):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def expected_files(out_dir: Path, params: BuildParams) -> list[Path]:
    """Files a complete build has (the marker excluded)."""
    base = out_dir / "base"
    files = [base / name for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json")]
    for spec in params.adapters:
        files += [out_dir / "adapters" / spec.name / n for n in ("adapter_config.json", "adapter_model.safetensors")]
    return files + [out_dir / "catalogue.json"]


def is_complete(out_dir: Path, params: BuildParams) -> bool:
    """True when ``out_dir`` holds a finished build with the same hash."""
    marker = out_dir / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text()).get("hash")
    except (json.JSONDecodeError, AttributeError):
        return False
    return recorded == build_hash(params) and all(p.is_file() for p in expected_files(out_dir, params))


def _clear(out_dir: Path) -> None:
    """Remove a previous (stale or partial) build; refuse to touch a directory that is not one."""
    if not out_dir.exists():
        return
    ours = {"base", "adapters", "catalogue.json", MARKER_NAME}
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in ours)
    if foreign:
        raise FileExistsError(f"{out_dir} exists and holds files that are not an embedded build: {foreign[:5]}")
    for name in ours:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# --------------------------------------------------------------------------- build


def _log(message: str) -> None:
    """One progress line on stdout."""
    print(f"[embedded] {message}", flush=True)


@contextlib.contextmanager
def _isolated(num_threads: int) -> Iterator[None]:
    """Run with a fixed torch thread count and a forked RNG, restoring both afterwards.

    One thread by default: on a shared 2-core machine, two OpenMP threads slow down several-fold
    whenever another process competes for a core (spin-waiting), and a fixed count keeps the
    floating-point reduction order, hence the weights, reproducible.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with torch.random.fork_rng(devices=[]), _quiet():
            yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' progress bars, info logs and deprecation warnings for a while."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def build_default(
    out_dir: Path,
    *,
    steps: int = 400,
    adapter_steps: int = 200,
    seed: int = 0,
    params: BuildParams | None = None,
    summary: bool = True,
) -> Path:
    """Build (or reuse) the embedded default model under ``out_dir``; returns the absolute ``out_dir``.

    ``params`` overrides ``steps``/``adapter_steps``/``seed`` when given. ``summary`` prints the
    greedy continuation of one corpus prompt by the base and by every adapter.
    """
    params = params or BuildParams(steps=steps, adapter_steps=adapter_steps, seed=seed)
    out_dir = Path(out_dir).resolve()
    if is_complete(out_dir, params):
        _log(f"{out_dir} is up to date (hash {build_hash(params)[:12]}); skipping build")
        return out_dir
    _clear(out_dir)
    t0 = time.perf_counter()
    with _isolated(params.num_threads):
        _build(out_dir, params)
        _log(f"built {out_dir} in {time.perf_counter() - t0:.1f}s")
        if summary:
            print_summary(out_dir)
    return out_dir


def _build(out_dir: Path, params: BuildParams) -> None:
    """Train and save everything, then write the catalogue and (last) the marker."""
    paragraphs = load_paragraphs()
    base_dir = out_dir / "base"
    base_dir.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(paragraphs, params.vocab_size)
    save_tokenizer(tok, base_dir, params.shape.max_position_embeddings)

    t = time.perf_counter()
    model = make_base_model(params.shape, tok.get_vocab_size(), tok, params.seed)
    loss = train_lm(model, token_stream(tok, paragraphs), params.base_train(), params.seed)
    _save_base(model, base_dir)
    _log(f"base: vocab {tok.get_vocab_size()}, {params.steps} steps, loss {loss:.3f}, {time.perf_counter() - t:.1f}s")

    catalogue: dict[str, str] = {}
    for index, spec in enumerate(params.adapters):
        t = time.perf_counter()
        adapter_dir = out_dir / "adapters" / spec.name
        stream = token_stream(tok, [TRANSFORMS[spec.transform](p) for p in paragraphs])
        seed = params.seed + 1000 * (index + 1)
        loss = train_adapter(model, spec, stream, params.adapter_train(spec), seed, adapter_dir)
        catalogue[spec.name] = str(adapter_dir)
        _log(f"adapter {spec.name}: rank {spec.rank}, loss {loss:.3f}, {time.perf_counter() - t:.1f}s")

    (out_dir / "catalogue.json").write_text(json.dumps(catalogue, indent=2) + "\n")
    for path in out_dir.rglob("*"):  # safetensors are written 0600; a server may run as another user
        path.chmod(0o755 if path.is_dir() else 0o644)
    marker = {"hash": build_hash(params), "params": asdict(params)}
    (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _save_base(model, base_dir: Path) -> None:
    """save_pretrained the base plus a generation_config carrying the special token ids."""
    from transformers import GenerationConfig

    model.save_pretrained(str(base_dir))
    model.name_or_path = model.config._name_or_path = str(base_dir)  # recorded in adapter_config.json
    cfg = model.config
    generation = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                  pad_token_id=cfg.pad_token_id)
    generation.save_pretrained(str(base_dir))


# --------------------------------------------------------------------------- summary


def greedy_continuations(out_dir: Path, prompt: str = SUMMARY_PROMPT, max_new_tokens: int = 20) -> dict[str, str]:
    """Greedy continuation of ``prompt`` by the base ("base") and by every catalogued adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir / "base"))
    base = AutoModelForCausalLM.from_pretrained(str(out_dir / "base"), dtype=torch.float32).eval()
    input_ids = tok(prompt, return_tensors="pt").input_ids
    results = {"base": _greedy(base, tok, input_ids, max_new_tokens)}
    catalogue = json.loads((out_dir / "catalogue.json").read_text())
    for name, path in catalogue.items():
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
        results[name] = _greedy(peft_model, tok, input_ids, max_new_tokens)
    return results


def _greedy(model, tok, input_ids: torch.Tensor, max_new_tokens: int) -> str:
    """Decode ``max_new_tokens`` greedy tokens (stopping at EOS) after ``input_ids``."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def print_summary(out_dir: Path, prompt: str = SUMMARY_PROMPT) -> None:
    """Print the base's and every adapter's greedy continuation of ``prompt``."""
    print(f"[embedded] greedy continuations of {prompt!r}:", flush=True)
    with _quiet():
        continuations = greedy_continuations(out_dir, prompt)
    for name, text in continuations.items():
        print(f"  {name:>8}: {text!r}", flush=True)


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/default"), help="output directory")
    parser.add_argument("--steps", type=int, default=400, help="base model training steps")
    parser.add_argument("--adapter-steps", type=int, default=200, help="training steps per adapter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-summary", action="store_true", help="skip the greedy-continuation printout")
    args = parser.parse_args(argv)
    build_default(args.out, steps=args.steps, adapter_steps=args.adapter_steps, seed=args.seed,
                  summary=not args.no_summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
