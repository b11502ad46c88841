"""The parts of ``python -m perf.device`` that need no server: compiled tests, the kernel benchmarks, the decode
step, the engine's profile, the headline workload, tensor parallelism on two GPUs. Each runs its steps with the
image's python3 (torch, triton) and summarises them (perf/device/part.py)."""

from __future__ import annotations

from perf.device.part import REPO, Part, grep

# the headline's workload on the Llama-3-8B shape: S-LoRA's, 288 requests offered at 24 req/s for 12 s, drained
HEADLINE_ARGS = ["--shape", "llama3-8b", "--rate", "24", "--duration", "12", "--drain", "15", "--skip-peft",
                 "--max-num-seqs", "128", "--admit-every-steps", "4"]
STEP_LINES = r"^ *[0-9]+ +[0-9.]+ |copy_bandwidth|^-- |per step:|waited"
KERNEL_TESTS = ["tests/kernels/test_lora_kernels.py", "tests/kernels/test_lora_segments.py",
                "tests/kernels/test_lora_batch.py"]


def gpu_tests(part: Part, pytest_args: list[str]) -> None:
    """The tests compiled on the GPU (``TRITON_INTERPRET=0``): PYTEST_ARGS, by default tests/kernels/."""
    part.compiled_tests(pytest_args or ["tests/kernels"])
    part.add("failures", grep(part.work / "gpu_tests.txt", r"^(FAILED|ERROR) ", head=40))


def kernels(part: Part, tests: bool, attention: bool, gemm: bool) -> None:
    """The LoRA kernels' compiled tests, then their benchmark (BGMV and SGMV forms, rank 16, CUDA-graph
    medians) against the bytes floor and gather + bmm; optionally the attention splits and the base GEMMs."""
    if tests:
        part.compiled_tests(KERNEL_TESTS, 200)
    part.python_step("bench_kernels", "perf.kernels.bench_kernels",
                     ["--quick", "--rep-ms", "5", "--out", str(part.work / "kernels.jsonl")], "kernels.txt", 200)
    if attention:
        part.python_step("bench_attention", "perf.kernels.bench_attention",
                         ["--out", str(part.work / "attention.jsonl")], "attention.txt", 200)
    if gemm:
        part.python_step("bench_gemm", "perf.kernels.bench_gemm", ["--out", str(part.work / "gemm.jsonl")],
                         "gemm.txt", 150)
    part.python_step("kernel table", "perf.kernels.kernel_table",
                     [f"this={part.work / 'kernels.jsonl'}", "--tokens", "16", "64"], "kernel_table.txt", 60)
    part.add("LoRA kernels, T = 16 / 64: us (x floor) [vs bmm]", grep(part.work / "kernel_table.txt", "."))
    if attention:
        text = (part.work / "attention.txt").read_text(errors="replace") if (part.work / "attention.txt").is_file() \
            else ""
        table = text.split("\nbatch ", 1)[-1].split("\n\n", 1)[0] if "\nbatch " in text else ""
        part.add("attention splits", ("batch " + table if table else "") + "\n"
                 + grep(part.work / "attention.txt", r"SMs|copy bandwidth"))
    if gemm:
        text = (part.work / "gemm.txt").read_text(errors="replace") if (part.work / "gemm.txt").is_file() else ""
        part.add("base GEMMs", text.split("\nshape ", 1)[-1].split("\n\n", 1)[0] if "\nshape " in text else "")


def decode_step(part: Part, args: list[str]) -> None:
    """The whole-model decode step (perf/engine/bench_decode_step.py; ARGS after ``--rounds 3``): variants captured
    in one process, timed in interleaved rounds, against the bytes floor."""
    part.python_step("decode step", "perf.engine.bench_decode_step",
                     ["--rounds", "3", *args, "--out", str(part.work / "step")], "step.txt")
    part.add("decode step", grep(part.work / "step.txt", STEP_LINES, cut=220))


def profile(part: Part) -> None:
    """Where the engine's time goes on the headline's workload: step phases at n = 5 and n = 2000 (synchronising
    timers), then n = 2000 under cProfile with torch.profiler tables of a few eager steps."""
    workload = ["--shape", "llama3-8b", "--rate", "24", "--duration", "12", "--drain", "15", "--max-num-seqs", "128",
                "--admit-every-steps", "4"]
    part.python_step("profile phases", "perf.engine.profile_engine",
                     [*workload, "--adapters", "5", "2000", "--out", str(part.work / "phases")], "phases.txt", 230)
    part.python_step("profile cProfile + trace", "perf.engine.profile_engine",
                     [*workload, "--adapters", "2000", "--python-profile", "--trace-steps", "3",
                      "--out", str(part.work / "cprofile")], "cprofile.txt")
    part.add("phases", grep(part.work / "phases.txt", r"^==|phase|graph:|eager:|idle|upload|load", head=40))
    part.add("cProfile top", grep(part.work / "cprofile" / "python_profile.txt", ".", cut=150, head=45))


def headline(part: Part, args: list[str]) -> None:
    """The headline's workload through the engine in-process (perf/engine/headline.py) at n = 5, 100, 1000, 2000
    and base-only; ARGS add to or override the workload's options (e.g. ``--adapters 5 100``)."""
    work = part.work / "work"
    work.mkdir()
    part.python_step("headline", "perf.engine.headline",
                     [*HEADLINE_ARGS, "--adapters", "5", "100", "1000", "2000", *args,
                      "--out", str(part.work / "headline"), "--workdir", str(work)], "headline.txt")
    part.add("headline", grep(part.work / "headline" / "summary.md", r"^\| engine|ratio", head=20))


def tp_smoke(part: Part, device: str) -> None:
    """The engine at tp = 2 (NCCL on cuda:0 and cuda:1; gloo with ``--device cpu``) against tp = 1 on a small
    random Llama with four adapters: every request's tokens must agree (perf/engine/tp_smoke.py)."""
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "NCCL_NVLS_ENABLE": "0"}
    part.python_step("tp smoke", "perf.engine.tp_smoke", [device], "tp_smoke.txt", 300, env=env)
    part.add("tensor parallel", grep(part.work / "tp_smoke.txt", r"tp=|Error|error", tail=6))
