"""The server parts' model: random weights of a named shape and 100 rank-16 adapters on all 7 projections (8
distinct weight files), written once under a folder; prints what the workload needs as one JSON line.

    python -m perf.device.checkpoint llama3-8b /tmp/ckpt_llama3-8b cuda

Run in a child process of ``python -m perf.device`` with the image's python3, so that neither torch nor the
CUDA context of drawing the weights stays in the process that then starts the server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ADAPTERS = 100


def main(argv: list[str] | None = None) -> int:
    shape_name, folder, device = (sys.argv[1:] if argv is None else argv)[:3]
    from perf.engine.checkpoint import SHAPES, write_adapter_catalogue, write_base
    from perf.engine.headline import DEFAULTS
    from perf.workload.trace import adapter_name

    shape, ckpt = SHAPES[shape_name], Path(folder)
    dev = "cuda" if device.startswith("cuda") else "cpu"  # random weights drawn on the GPU are quick
    if not (ckpt / "adapters" / "catalogue.json").exists():
        write_base(ckpt / "base", shape, device=dev)
        write_adapter_catalogue(ckpt / "adapters", shape, [adapter_name(i) for i in range(ADAPTERS)], distinct=8,
                                device=dev)
    d = DEFAULTS[shape_name]
    print(json.dumps({"vocab": shape.vocab, "max_model_len": d["input_range"][1] + d["output_range"][1] + 8,
                      "input_range": list(d["input_range"]), "output_range": list(d["output_range"]),
                      "adapters": ADAPTERS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
