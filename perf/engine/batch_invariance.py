"""Does a request's greedy output depend on what it is batched with? The in-process engine, the same requests
submitted in several compositions, token ids compared.

    python -m perf.engine.batch_invariance --shape llama3-8b --adapters 0,100 --requests 300 --solo 8
    python -m perf.engine.batch_invariance --shape llama3-8b --adapters 100 --engine-param kernels=torch

For each adapter count, the capacity benchmark's request set (perf/capacity/requests.py: S-LoRA lengths, an
adapter drawn per request; greedy, ``ignore_eos``) runs in these compositions, each compared with ``all``:

- ``all``: every request submitted at once (the capacity benchmark's offline run);
- ``again``: the same a second time (is the engine deterministic run to run?);
- ``reversed``: submitted in reverse order (other requests share each step);
- ``solo``: the first ``--solo`` requests one at a time, alone in the engine.

Printed per composition: requests whose tokens differ from ``all``'s, and where they first differ (the token
index, and its fraction of the request's output). Float32 on the CPU should show no difference at all; bf16 on a
GPU shows how much of a difference between two runs (the server against the engine, say) is the numerics of
batched bf16 kernels rather than a defect.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from manylora.deploy.repository import parse_params
from perf.capacity.prepare import CheckpointSpec, prepare_in_child
from perf.capacity.requests import CapacityRequest, RequestSetConfig, build_requests
from perf.engine.checkpoint import SHAPES

SHAPE_DEFAULTS = {
    "llama3-8b": dict(input_range=(8, 512), output_range=(8, 512), max_num_seqs=256, max_loras=256),
    "tiny": dict(input_range=(8, 64), output_range=(8, 64), max_num_seqs=32, max_loras=8),
}


def run_composition(engine, requests: list[CapacityRequest], order: list[int], one_at_a_time: bool,
                    tag: str) -> dict[int, list[int]]:
    """Submit ``requests`` in ``order`` (all at once, or each after the one before finished); token ids by index."""
    from manylora.engine.requests.types import GenerationRequest, SamplingParams

    tokens: dict[int, list[int]] = {i: [] for i in order}
    done = threading.Semaphore(0)
    errors: list[str] = []

    def submit(i: int) -> None:
        r = requests[i]

        def emit(out, i=i) -> None:
            tokens[i].extend(out.token_ids)
            if out.finished:
                if out.error is not None:
                    errors.append(f"request {i}: {out.error}")
                done.release()

        engine.submit(GenerationRequest(request_id=f"{tag}-{i}", prompt_ids=list(r.prompt_ids), adapter=r.adapter,
                                        sampling=SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                                ignore_eos=True)), emit)

    if one_at_a_time:
        for i in order:
            submit(i)
            done.acquire()
    else:
        for i in order:
            submit(i)
        for _ in order:
            done.acquire()
    if errors:
        raise RuntimeError(f"{tag}: {len(errors)} requests failed, first: {errors[0]}")
    return tokens


def compare(reference: dict[int, list[int]], other: dict[int, list[int]]) -> dict:
    """Requests of ``other`` whose tokens differ from ``reference``'s, and where they first differ."""
    first: list[int] = []
    fractions: list[float] = []
    for i, ids in other.items():
        ref = reference[i]
        k = next((j for j, (a, b) in enumerate(zip(ref, ids, strict=False)) if a != b), None)
        if k is None and len(ref) != len(ids):
            k = min(len(ref), len(ids))
        if k is not None:
            first.append(k)
            fractions.append(k / max(1, len(ref)))
    return {
        "requests": len(other),
        "differ": len(first),
        "first_difference_median": statistics.median(first) if first else None,
        "first_difference_min": min(first) if first else None,
        "first_difference_fraction_median": round(statistics.median(fractions), 3) if fractions else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.engine.batch_invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPE_DEFAULTS), default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--adapters", default="0,100", help="comma-separated adapter counts (0: base model only)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--solo", type=int, default=8, help="requests also run alone (the first N of the set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-param", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field, e.g. kernels=torch (parsed as the generator's --param is)")
    ap.add_argument("--workdir", default="/tmp/manylora-capacity", help="where the checkpoint is written or found")
    ap.add_argument("--json", help="write the comparison here")
    args = ap.parse_args(argv)

    counts = [int(x) for x in args.adapters.split(",") if x.strip()]
    defaults = SHAPE_DEFAULTS[args.shape]
    extra = parse_params(args.engine_param)
    ckpt = prepare_in_child(CheckpointSpec(args.shape, args.device, max(counts)), Path(args.workdir))
    from manylora.engine.config import EngineConfig
    from manylora.engine.scheduling.engine import Engine

    request_set = RequestSetConfig(args.requests, defaults["input_range"], defaults["output_range"],
                                   (4, SHAPES[args.shape].vocab), args.seed)
    values = {"max_lora_rank": 16, "max_num_seqs": defaults["max_num_seqs"], "max_loras": defaults["max_loras"],
              "max_cpu_loras": max(256, defaults["max_loras"]), "max_model_len": request_set.max_model_len}
    engine = Engine(EngineConfig.from_strings({**{k: str(v) for k, v in values.items()}, **extra},
                                              model_dir=ckpt.base_dir, device=ckpt.device,
                                              adapters=json.loads(Path(ckpt.catalogue).read_text())))
    print(f"{ckpt.device_name}, {ckpt.dtype}, shape {args.shape}, {args.requests} requests, engine params {extra}",
          flush=True)
    results: dict = {"device": ckpt.device_name, "dtype": ckpt.dtype, "shape": args.shape, "engine_params": extra,
                     "command": " ".join(sys.argv), "counts": {}}
    try:
        for n in counts:
            requests = build_requests(request_set, n)
            forward = list(range(len(requests)))
            t = time.monotonic()
            reference = run_composition(engine, requests, forward, False, f"all-n{n}")
            rows = {"all_s": round(time.monotonic() - t, 1)}
            rows["again"] = compare(reference, run_composition(engine, requests, forward, False, f"again-n{n}"))
            rows["reversed"] = compare(reference, run_composition(engine, requests, forward[::-1], False,
                                                                  f"reversed-n{n}"))
            if args.solo:
                rows["solo"] = compare(reference, run_composition(engine, requests, forward[:args.solo], True,
                                                                  f"solo-n{n}"))
            results["counts"][n] = rows
            for name in ("again", "reversed", "solo"):
                if name in rows:
                    r = rows[name]
                    where = (f"; first difference at token {r['first_difference_median']} (median; min "
                             f"{r['first_difference_min']}), {r['first_difference_fraction_median']} of the output"
                             if r["differ"] else "")
                    print(f"n={n} {name:9} {r['differ']:>4} of {r['requests']} differ from 'all'{where}", flush=True)
    finally:
        engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
