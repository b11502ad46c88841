# Sourced by the H200 server scripts: writes random weights of $SHAPE (a base and a catalogue of 100
# rank-16 adapters, 8 distinct weight files) under $CKPT unless they are there, and sets VOCAB, MAX_LEN
# and the workload's IN_LO IN_HI OUT_LO OUT_HI for that shape. Needs SHAPE, CKPT, DEVICE, PYTHON.
read -r VOCAB MAX_LEN IN_LO IN_HI OUT_LO OUT_HI < <("$PYTHON" - "$SHAPE" "$CKPT" "$DEVICE" <<'PY'
import sys
from pathlib import Path
from perf.checkpoint import SHAPES, write_adapter_catalogue, write_base
from perf.headline import DEFAULTS
from perf.workload import adapter_name
shape, ckpt = SHAPES[sys.argv[1]], sys.argv[2]
dev = "cuda" if sys.argv[3].startswith("cuda") else "cpu"  # random weights drawn on the GPU are quick
if not (Path(ckpt) / "adapters" / "catalogue.json").exists():
    write_base(f"{ckpt}/base", shape, device=dev)
    write_adapter_catalogue(f"{ckpt}/adapters", shape, [adapter_name(i) for i in range(100)], distinct=8, device=dev)
d = DEFAULTS[sys.argv[1]]
print(shape.vocab, d["input_range"][1] + d["output_range"][1] + 8, *d["input_range"], *d["output_range"])
PY
)
