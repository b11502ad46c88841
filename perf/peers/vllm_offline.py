"""vLLM as a peer: offline throughput on the capacity benchmark's requests, one max_loras per child process.

    python -m perf.peers.vllm_offline PLAN.json  # the child, run by perf/capacity/command.py with the vLLM interpreter

Each child builds ``LLM(model=DIR, enable_lora=True, max_loras=K, ...)`` (the settings
that ran on the H200: max_lora_rank 16, skip_tokenizer_init, bfloat16), warms it up, then
for each adapter count sends the same requests as the other targets at once: TokensPrompt inputs,
``SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False)`` and one LoRARequest
per request (adapter lora-XXXX has int id XXXX + 1 and the catalogue's directory; none at n = 0).
vLLM holds the GPU until its process ends, so every K is a process of its own. Only where
``import vllm`` works (on the H200: vLLM 0.26.0, whose pins match its torch 2.11,
installed from its wheel into the image's python3).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from perf.capacity.metrics import OfflineResult, digest
from perf.capacity.requests import RequestSetConfig, build_requests

REPO = Path(__file__).resolve().parents[2]
# vLLM's req/s fell 2.7x from 100 to 1000 adapters at max_loras 8 (H200, 2026-12-04): a run whose guessed length
# (this factor x the previous count's time) passes the deadline is not started
SLOWDOWN_GUESS = 3.0


@dataclass
class VllmPlan:
    """One child: one max_loras, every adapter count. Written as JSON by the parent."""

    base_dir: str
    catalogue: str
    requests: dict
    adapters: list[int]
    max_loras: int
    max_num_seqs: int
    max_model_len: int
    max_lora_rank: int
    max_cpu_loras: int
    gpu_memory_utilization: float
    dtype: str
    results: str
    runs_dir: str
    deadline: float  # time.monotonic(): no adapter count starts after it


def target_name(max_loras: int) -> str:
    return f"vllm_k{max_loras}"


def _lora_id(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) + 1


def execute(plan: VllmPlan) -> dict:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not installed on the H200
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    results: dict = {"vllm": vllm.__version__, "max_loras": plan.max_loras, "offline": [], "skipped": []}
    out = Path(plan.results)
    catalogue = json.loads(Path(plan.catalogue).read_text())
    t = time.monotonic()
    llm = LLM(
        model=plan.base_dir,
        enable_lora=True,
        max_loras=plan.max_loras,
        max_lora_rank=plan.max_lora_rank,
        max_cpu_loras=max(plan.max_cpu_loras, plan.max_loras),
        max_num_seqs=plan.max_num_seqs,
        gpu_memory_utilization=plan.gpu_memory_utilization,
        max_model_len=plan.max_model_len,
        skip_tokenizer_init=True,
        dtype=plan.dtype,
    )
    results["start_s"] = round(time.monotonic() - t, 1)

    def save() -> None:  # after each run or skip, so a child stopped later still leaves what it did
        out.write_text(json.dumps(results, indent=1) + "\n")

    save()

    def generate(requests) -> tuple[list, float]:
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0, detokenize=False)
                  for r in requests]
        loras = [LoRARequest(r.adapter, _lora_id(r.adapter), catalogue[r.adapter]) if r.adapter else None
                 for r in requests]
        t0 = time.monotonic()
        outputs = llm.generate(prompts, params, lora_request=loras if any(loras) else None, use_tqdm=False)
        return outputs, time.monotonic() - t0

    config = RequestSetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan.requests.items()})
    warm = build_requests(config, max(plan.adapters))[:8]
    generate([r for r in warm])
    last_rate = None  # req/s of the previous adapter count: a run cannot be stopped, so its length is guessed
    for n in plan.adapters:
        requests = build_requests(config, n)
        guess = 0.0 if last_rate is None else SLOWDOWN_GUESS * len(requests) / last_rate
        if time.monotonic() + guess > plan.deadline:
            results["skipped"].append(f"vllm max_loras={plan.max_loras} n={n}: the time budget was spent "
                                      f"(about {guess:.0f} s needed)")
            save()
            continue
        started = time.time()
        outputs, wall = generate(requests)
        window = [started, time.time()]  # epoch seconds (perf/capacity/gpu_clock.py)
        rows, tokens, exact = [], 0, 0
        for r, o in zip(requests, outputs, strict=True):
            ids = list(o.outputs[0].token_ids) if o.outputs else []
            tokens += len(ids)
            exact += len(ids) == r.output_len
            rows.append({"request": r.index, "adapter": r.adapter, "output_tokens_requested": r.output_len,
                         "output_tokens": len(ids), "output_digest": digest(ids)})
        name = target_name(plan.max_loras)
        result = OfflineResult(target=name, adapters=n, requests=len(requests), completed=len(rows),
                               exact_length=exact, failed=0, wall_s=wall, req_per_s=len(rows) / wall,
                               output_tok_per_s=tokens / wall, output_tokens=tokens, capped=False,
                               meta={"vllm": vllm.__version__, "max_loras": plan.max_loras, "window": window})
        runs = Path(plan.runs_dir)
        runs.mkdir(parents=True, exist_ok=True)
        with open(runs / f"{name}_n{n}_offline.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        last_rate = result.req_per_s
        results["offline"].append(asdict(result))
        save()
        print(f"[vllm max_loras={plan.max_loras}] n={n}: {result.req_per_s:.2f} req/s, "
              f"{result.output_tok_per_s:.0f} tok/s in {wall:.1f} s", flush=True)
    return results


def _site_interpreters() -> list[str]:
    """The interpreters of the virtual environments on sys.path (<env>/lib/pythonX.Y/site-packages), this one's
    last: on the H200 the image's python3 (/opt/torch/.venv) reaches the server's venv through a .pth file."""
    found = []
    for entry in sys.path:
        path = Path(entry)
        if path.name == "site-packages" and len(path.parents) > 2:
            python = path.parents[2] / "bin" / "python3"
            if python.is_file() and str(python) not in found:
                found.append(str(python))
    own = str(Path(sys.prefix) / "bin" / "python3")
    return sorted(found, key=lambda p: p == own)


def find_vllm_python(explicit: str | None = None) -> tuple[str | None, str]:
    """An interpreter where ``import vllm`` works, and why not when none does.

    The H200's vLLM is installed into the image's python3 (/opt/torch/.venv), while the benchmark runs in the
    server's venv (perf/device/server_env.py: numpy 1.26 for the stub, which vLLM would then see first): so the other
    environments on sys.path and the system's python3 are tried before this interpreter.
    """
    candidates = [explicit] if explicit else [*_site_interpreters(), "/usr/bin/python3", sys.executable,
                                              shutil.which("python3")]
    seen, reasons = set(), []
    for python in candidates:
        # one try per folder: bin/python and bin/python3 of a venv are one interpreter (their targets may be
        # shared by several venvs, so the links are not resolved)
        if not python or str(Path(python).parent) in seen or not Path(python).exists():
            continue
        seen.add(str(Path(python).parent))
        probe = "import importlib.metadata as m; m.version('vllm')"
        found = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
        if found.returncode != 0:
            reasons.append(f"{python}: no vllm package")
            continue
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
        imported = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True, timeout=300, env=env)
        if imported.returncode == 0:
            return python, imported.stdout.strip().splitlines()[-1]
        reasons.append(f"{python}: import vllm failed ({imported.stderr.strip().splitlines()[-1:]})")
    return None, "; ".join(reasons) or "no interpreter to try"


def run_child(python: str, plan: VllmPlan, log: Path, timeout_s: float) -> dict:
    """One max_loras in its own process; its results (what it finished, if it failed)."""
    plan_path = Path(plan.results).with_suffix(".plan.json")
    plan_path.write_text(json.dumps(asdict(plan), indent=1))
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    error = None
    with open(log, "w") as f:
        try:
            proc = subprocess.run([python, "-m", "perf.peers.vllm_offline", str(plan_path)], cwd=REPO, env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
            if proc.returncode != 0:
                error = f"exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"killed after {timeout_s:.0f} s"
    results = json.loads(Path(plan.results).read_text()) if Path(plan.results).is_file() else {"offline": []}
    if error:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        results["error"] = f"vLLM max_loras={plan.max_loras} {error}; log {log}:\n{tail}"
    return results


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    execute(VllmPlan(**json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
