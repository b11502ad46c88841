"""The OpenAI-compatible front's overhead: the same requests, all at once, through Triton's gRPC and through the front.

    python -m perf.server.openai_overhead --grpc 127.0.0.1:8001 --openai http://127.0.0.1:9000 \\
        --requests 1000 --prompt-words 256 --max-tokens 256 --processes 8

Starts nothing: a running server (``make serve``, which starts the front beside tritonserver) is measured.
Each path gets the same N requests (prompt "Hello " * words, the adapters round-robin, greedy, ignore_eos so every
request generates exactly --max-tokens), submitted at once from --processes client processes (each an asyncio loop;
the requests split evenly), after a warm-up of a few requests. gRPC: the ``llm`` ensemble's ModelStreamInfer
(tritonclient.grpc.aio), the call the front itself makes; OpenAI: streamed POST /v1/completions (httpx, HTTP/1.1,
one connection per request) with stream_options.include_usage. Output tokens are the server's own counts
(num_output_tokens; the usage chunk). Prints output tokens/s for each path and their ratio (the goal: >= 0.90);
--json writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

PATHS = ("grpc", "openai")


@dataclass(frozen=True)
class Job:
    """One request, as both paths send it."""

    prompt: str
    adapter: str | None
    max_tokens: int


@dataclass
class PathResult:
    """What one path did: requests finished and failed, output tokens, wall time (first submit to last end), TTFTs."""

    path: str
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        return {"path": self.path, "requests": self.requests, "errors": len(self.errors),
                "first_errors": self.errors[:3], "output_tokens": self.output_tokens,
                "seconds": round(self.seconds, 3), "output_tokens_per_s": round(self.tokens_per_s, 1),
                "ttft_p50_s": round(statistics.median(ttft), 4) if ttft else None,
                "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4) if ttft else None}


# ------------------------------------------------------------------------------------------------- one request
async def _grpc_one(client, job: Job, index: int) -> tuple[int, float]:
    """(output tokens, seconds to the first text) of one llm ensemble stream."""
    from tritonclient.grpc import InferRequestedOutput

    from manylora.openai.triton import ENSEMBLE, OUTPUTS, Generation, llm_inputs, read_chunk

    inputs, parameters = llm_inputs(Generation(prompt=job.prompt, max_tokens=job.max_tokens, adapter=job.adapter,
                                               ignore_eos=True, stream=True))
    request = {"model_name": ENSEMBLE, "inputs": inputs, "outputs": [InferRequestedOutput(o) for o in OUTPUTS],
               "request_id": f"overhead-{index}", "parameters": parameters}

    async def one():
        yield request

    start, first, tokens = time.perf_counter(), None, 0
    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise RuntimeError(str(error))
        chunk = read_chunk(result.get_response())
        if chunk.text and first is None:
            first = time.perf_counter() - start
        tokens += chunk.output_tokens
    return tokens, first or 0.0


async def _openai_one(http, model: str, job: Job) -> tuple[int, float]:
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start, first, tokens = time.perf_counter(), None, None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            if first is None and any(c.get("text") for c in event.get("choices", ())):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return tokens, first or 0.0


# ------------------------------------------------------------------------------------------- one client process
async def _run_jobs(path: str, target: str, base_model: str, jobs: list[tuple[int, Job]], start_at: float,
                    timeout_s: float) -> dict:
    """All ``jobs`` at once at wall time ``start_at``: {"tokens", "ttfts", "errors", "t0", "t1"} (wall times)."""
    if path == "grpc":
        import tritonclient.grpc.aio as grpcaio

        client = grpcaio.InferenceServerClient(target)

        def send(i: int, job: Job):
            return _grpc_one(client, job, i)
    else:
        import httpx

        client = httpx.AsyncClient(base_url=target, timeout=timeout_s,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

        def send(i: int, job: Job):
            return _openai_one(client, job.adapter or base_model, job)

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        results = await asyncio.gather(*(asyncio.wait_for(send(i, job), timeout_s) for i, job in jobs),
                                       return_exceptions=True)
        t1 = time.time()
    finally:
        await (client.close() if path == "grpc" else client.aclose())
    out = {"tokens": 0, "ttfts": [], "errors": [], "t0": t0, "t1": t1}
    for result in results:
        if isinstance(result, BaseException):
            out["errors"].append(f"{type(result).__name__}: {result}"[:300])
        else:
            out["tokens"] += result[0]
            out["ttfts"].append(result[1])
    return out


def _worker(args: tuple) -> dict:
    return asyncio.run(_run_jobs(*args))


def run_path(path: str, target: str, base_model: str, jobs: list[Job], processes: int, timeout_s: float) -> PathResult:
    """Every job through ``path`` at once, split over ``processes`` client processes."""
    indexed = list(enumerate(jobs))
    slices = [indexed[k::processes] for k in range(processes) if indexed[k::processes]]
    start_at = time.time() + 1.0 + 0.2 * len(slices)  # every process is up and waiting by then
    context = mp.get_context("spawn")
    with context.Pool(len(slices)) as pool:
        parts = pool.map(_worker, [(path, target, base_model, s, start_at, timeout_s) for s in slices])
    result = PathResult(path)
    for part in parts:
        result.output_tokens += part["tokens"]
        result.ttft_s += part["ttfts"]
        result.errors += part["errors"]
    result.requests = len(jobs) - len(result.errors)
    result.seconds = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    return result


# ---------------------------------------------------------------------------------------------------- the command
def models_of(openai_url: str) -> tuple[str, list[str]]:
    """(the base model's name, the adapters) from the front's /v1/models."""
    import httpx

    data = httpx.get(f"{openai_url.rstrip('/')}/v1/models", timeout=30).raise_for_status().json()["data"]
    base = next(m["id"] for m in data if m.get("parent") is None)
    return base, [m["id"] for m in data if m.get("parent") is not None]


def build_jobs(n: int, adapters: list[str | None], prompt_words: int, max_tokens: int) -> list[Job]:
    prompt = ("Hello " * prompt_words).strip()
    return [Job(prompt, adapters[i % len(adapters)] if adapters else None, max_tokens) for i in range(n)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.server.openai_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--grpc", required=True, help="host:port of the Triton server's gRPC endpoint")
    ap.add_argument("--openai", required=True, help="the front's URL, http://host:port")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-words", type=int, default=256, help='prompt "Hello " * words')
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (ignore_eos)")
    ap.add_argument("--adapters", help="comma-separated; 'base' for the base model (default: every adapter of "
                                       "/v1/models, and the base)")
    ap.add_argument("--processes", type=int, default=4, help="client processes per path")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent through each path first, not measured")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per request")
    ap.add_argument("--order", default="grpc,openai", help="which path runs first")
    ap.add_argument("--json", help="write the results here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    order = [p.strip() for p in args.order.split(",") if p.strip()]
    if sorted(order) != sorted(PATHS):
        print(f"--order must name {', '.join(PATHS)} once each", file=sys.stderr)
        return 2
    base, served = models_of(args.openai)
    names = args.adapters.split(",") if args.adapters else [*served, base]
    adapters = [None if name in ("base", base) else name for name in names]
    jobs = build_jobs(args.requests, adapters, args.prompt_words, args.max_tokens)
    targets = {"grpc": args.grpc, "openai": args.openai.rstrip("/")}
    results: dict[str, PathResult] = {}
    for path in order:
        if args.warmup:
            run_path(path, targets[path], base, jobs[:args.warmup], 1, args.timeout)
        results[path] = run_path(path, targets[path], base, jobs, max(1, min(args.processes, len(jobs))),
                                 args.timeout)
        print(json.dumps(results[path].summary()), flush=True)
    ratio = results["openai"].tokens_per_s / results["grpc"].tokens_per_s if results["grpc"].tokens_per_s else 0.0
    print(f"\n{'path':8} {'requests':>9} {'errors':>7} {'out tokens':>11} {'seconds':>9} {'tokens/s':>10}")
    for path in PATHS:
        r = results[path]
        print(f"{path:8} {r.requests:>9} {len(r.errors):>7} {r.output_tokens:>11} {r.seconds:>9.2f} "
              f"{r.tokens_per_s:>10.1f}")
    print(f"openai / grpc throughput: {ratio:.3f} (goal >= 0.90)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "json"}, "adapters": names,
                       "results": {p: r.summary() for p, r in results.items()}, "ratio": round(ratio, 4),
                       "jobs": [asdict(j) for j in jobs[:1]]}, out, indent=2)
    return 0 if all(not r.errors for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
