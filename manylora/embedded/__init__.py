"""The embedded default model: a tiny Llama plus LoRA adapters, trained on the spot from bundled text.

``python -m manylora.embedded.build --out build/default`` makes a complete, deterministic model
directory (base checkpoint, tokenizer, adapters, catalogue) in a minute or two on one CPU core, so a
fresh machine can serve something whose adapters visibly change its behaviour per request.
"""

from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

__all__ = ["CORPUS_PATH"]
