"""A checkpoint converted to bfloat16 with transformers (its tokenizer and generation files copied beside).

    python -m perf.device.bf16 DEFAULT/base BF16
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    src, dst = map(Path, (sys.argv[1:] if argv is None else argv)[:2])
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    print("checkpoint dtype:", json.loads((dst / "config.json").read_text()).get("dtype"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
