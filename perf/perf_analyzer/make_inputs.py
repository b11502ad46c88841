"""perf_analyzer --input-data files from S-LoRA's workload: token ids for `generator`, text for `llm`.

    python perf/perf_analyzer/make_inputs.py --adapters shout pirate --vocab-range 4 256 --out-dir DIR

Each entry is one batch-1 request (shapes without the batch dimension, which Triton adds:
both models have max_batch_size > 0). Adapters follow the power law over the names given
(the first name is the most popular when alpha < 1); --base-fraction leaves some on the base model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.workload import WorkloadConfig, generate_trace  # noqa: E402


def entries(
    adapters: list[str],
    count: int,
    vocab_range: tuple[int, int],
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    alpha: float,
    base_fraction: float,
    seed: int,
) -> tuple[list, list]:
    trace = generate_trace(
        WorkloadConfig(
            num_adapters=max(1, len(adapters)),
            alpha=alpha,
            rate=1.0,
            duration_s=float(count),
            input_range=input_range,
            output_range=output_range,
            base_fraction=base_fraction if adapters else 1.0,
            seed=seed,
            vocab_range=vocab_range,
        )
    )
    gen, llm = [], []
    for r in trace:
        adapter = adapters[int(r.adapter.split("-")[-1])] if (r.adapter and adapters) else ""
        common = {"max_tokens": [r.output_len], "stream": [True], "lora_name": [adapter]}
        gen.append({"input_ids": {"content": r.prompt_ids, "shape": [r.prompt_len]}, **common})
        llm.append({"text_input": [r.prompt_text().strip()], **common})
    return gen, llm


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", nargs="*", default=[])
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--vocab-range", type=int, nargs=2, default=(4, 256))
    p.add_argument("--input-range", type=int, nargs=2, default=(8, 128))
    p.add_argument("--output-range", type=int, nargs=2, default=(8, 128))
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--base-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(Path(__file__).parent))
    a = p.parse_args(argv)
    gen, llm = entries(
        a.adapters,
        a.count,
        tuple(a.vocab_range),
        tuple(a.input_range),
        tuple(a.output_range),
        a.alpha,
        a.base_fraction,
        a.seed,
    )
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generator_input.json").write_text(json.dumps({"data": gen}) + "\n")
    (out / "llm_input.json").write_text(json.dumps({"data": llm}) + "\n")
    print(f"wrote {len(gen)} requests to {out}/generator_input.json and {out}/llm_input.json")


if __name__ == "__main__":
    main()
