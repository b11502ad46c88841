"""Capacity through the server: offline throughput, an open-loop rate sweep to saturation, vLLM, a soak.

    python -m perf.capacity --shape tiny --device cpu --requests 48 --adapters 0,4      # CPU smoke, ~1-2 min
    python -m perf.capacity --shape llama3-8b --targets engine --parts offline          # H200: one part a call
    python -m perf.capacity --shape llama3-8b --targets server_stream --parts sweep --soak 120

One machine, one process tree, the same requests for every target (perf/capacity/requests.py: the
same prompt token ids, output lengths and adapter per request; greedy; ignore_eos, so every request
gets exactly its output length). Targets:

- ``engine``: manylora.engine.scheduling.engine.Engine in a child process (perf/capacity/engine.py);
- ``server_stream`` / ``server_nostream``: the real tritonserver (started here through
  scripts/serve.py's functions, perf/capacity/server.py; its part of a call: perf/capacity/serving.py)
  and its ``generator`` model with ``stream`` true / false, over gRPC ModelStreamInfer from several
  client processes (perf/capacity/clients.py);
- ``llm`` (or ``--llm``): the text ensemble, streaming;
- ``vllm``: vLLM offline, one child process per max_loras (perf/peers/vllm_offline.py), where ``import vllm`` works.

Parts: ``offline`` (every request at once, each adapter count), ``sweep`` (Poisson arrivals at
fractions of the target's offline req/s, the engine and --sweep-target (server_stream, or llm), at
--sweep-adapters; the knee), ``soak`` (``--soak SECONDS``: --soak-target, server_stream or llm, at
--soak-fraction of its offline req/s, memory sampled; perf/capacity/soak.py). A sweep or soak without an
offline capacity for it measures that first.

Options and per-shape defaults: perf/capacity/config.py. Results merge across calls in a store in
--workdir (kept while the machine is), so a long run splits into calls of under 10 minutes; --budget
stops starting runs when the call's time is spent; --merge makes one summary of calls made on
different machines. Writes summary.json, summary.md, store.json, PNG plots, per-request JSONL (runs/)
and logs (logs/; both packed into runs_and_logs.tar.gz when the output is $OUT) to --out (default
$OUT, else perf/results/<date>-<gpu or cpu>/capacity) and prints a short table last.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from perf.capacity.clients import ClientConfig, ServerLacksIgnoreEos, saturated
from perf.capacity.config import SERVER_TARGETS, CapacityConfig, parse_args
from perf.capacity.gpu_clock import GpuSampler
from perf.capacity.metrics import ClientLoad
from perf.capacity.prepare import CheckpointSpec, PreparedCheckpoint, package_versions, prepare_in_child
from perf.capacity.report import build_summary, label, markdown, plot_sweeps, short_table
from perf.capacity.requests import CapacityRequest, build_requests
from perf.capacity.runs import Budget, SweepConfig, log
from perf.capacity.store import NOT_INSTALLED, Store, fingerprint, merge_stores

REPO = Path(__file__).resolve().parents[2]
PACKED = "runs_and_logs.tar.gz"  # runs/ and logs/ of a call whose output folder is $OUT


def default_out(gpu_name: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    tag = "cpu" if gpu_name == "cpu" else re.sub(r"[^a-z0-9]", "", gpu_name.lower().split()[-1]) or "gpu"
    return REPO / "perf" / "results" / f"{dt.date.today().isoformat()}-{tag}" / "capacity"


def display_path(path: Path) -> str:
    """``path`` as results record it: ``$OUT`` for the output folder a remote runner copies back, relative to the
    repository inside it, else as it is (results name no machine's folders where they need not)."""
    out = os.environ.get("OUT")
    resolved = Path(path).resolve()
    if out and resolved == Path(out).resolve():
        return "$OUT"
    if out and resolved.is_relative_to(Path(out).resolve()):
        return str(Path("$OUT") / resolved.relative_to(Path(out).resolve()))
    if resolved.is_relative_to(REPO):
        return str(resolved.relative_to(REPO))
    return str(path)


class Call:
    """One invocation: its config, output folders, store, budget, and the summary it keeps up to date."""

    def __init__(self, cfg: CapacityConfig, out: Path | None, command: str) -> None:
        self.cfg = cfg
        self.command = command
        self.budget = Budget(time.monotonic() + cfg.budget_s)
        self.workdir = Path(cfg.workdir or Path(tempfile.gettempdir()) / "manylora-capacity")
        self.requested_out = out
        self.ckpt: PreparedCheckpoint | None = None
        self.gpu: GpuSampler | None = None  # the GPU's clocks through the call (setup starts it on a GPU)
        self.versions = package_versions()
        self.versions.setdefault("tritonserver", self._pytriton_version())

    @staticmethod
    def _pytriton_version() -> str:
        v = package_versions(("nvidia-pytriton",)).get("nvidia-pytriton")
        return f"from nvidia-pytriton {v}" if v else NOT_INSTALLED

    def setup(self) -> None:
        cfg = self.cfg
        spec = CheckpointSpec(cfg.shape, cfg.device, max([*cfg.adapters, cfg.sweep_adapters]), cfg.rank,
                              cfg.distinct_adapters)
        log(f"checkpoint {cfg.shape} with {spec.adapters} adapter names under {self.workdir}")
        self.ckpt = prepare_in_child(spec, self.workdir / "checkpoints")
        self.out = self.requested_out or default_out(self.ckpt.device_name)
        self.out.mkdir(parents=True, exist_ok=True)
        # when the output is $OUT (a folder a remote runner copies back file by file), the many per-run files
        # travel as one archive
        self.pack = cfg.pack if cfg.pack is not None else self.requested_out is None and bool(os.environ.get("OUT"))
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = self.workdir / "calls" / f"{stamp}-{os.getpid()}" if self.pack else self.out
        self.runs, self.logs = folder / "runs", folder / "logs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        identity = {"shape": cfg.shape, "device": self.ckpt.device, "dtype": self.ckpt.dtype,
                    "requests": asdict(cfg.request_set), "engine": cfg.engine_params, "rank": cfg.rank,
                    "distinct": cfg.distinct_adapters}
        self.store = Store(self.workdir / f"store-{fingerprint(identity)}.json", identity, cfg.fresh)
        self.index = len(self.store.data["calls"])
        now = dt.datetime.now().isoformat(timespec="seconds")
        self.store.data["calls"].append({"command": self.command, "date": now, "out": display_path(self.out),
                                         "targets": cfg.targets, "parts": cfg.parts})
        if self.ckpt.write_s:
            self.store.add("notes", f"checkpoint written in {self.ckpt.write_s} s")
        self.gpu = GpuSampler(self.logs / "gpu.csv") if self.ckpt.device.startswith("cuda") else None
        why = self.gpu.start() if self.gpu is not None else None
        if why:
            self.store.add("notes", f"call {self.index}: the GPU's clocks were not sampled ({why})")
            self.gpu = None
        self.write()

    def put_offline(self, result: dict, digests: list[str | None] | None = None) -> None:
        """Store an offline result of this call, with what the GPU did during its run (``meta["gpu"]``, a note)."""
        window = result.get("meta", {}).get("window")
        gpu = self.gpu.window(*window) if self.gpu is not None and window else None
        if gpu is not None:
            result["meta"]["gpu"] = asdict(gpu)
            self.store.add("notes", f"GPU during {label(result['target'])} n={result['adapters']} (call "
                                    f"{self.index}): {gpu.note()}")
        self.store.put_offline(result, self.index, digests)

    def stop_sampling(self) -> None:
        if self.gpu is not None:
            self.gpu.stop()

    # -- output -----------------------------------------------------------------------------------------------------

    def header(self) -> dict:
        cfg, ckpt = self.cfg, self.ckpt
        return {
            "command": self.command,
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "shape": cfg.shape,
            "gpu": ckpt.device_name,
            "device": ckpt.device,
            "dtype": ckpt.dtype,
            "versions": self.all_versions(),
            "workload": (f"{cfg.requests} requests; prompt U[{cfg.input_range[0]}, {cfg.input_range[1]}), output "
                         f"U[{cfg.output_range[0]}, {cfg.output_range[1]}) tokens (S-LoRA); adapter uniform per "
                         f"request over n rank-{cfg.rank} adapters on all 7 projections ({cfg.distinct_adapters} "
                         f"distinct weight files, many names each); n = 0: the base model; seed {cfg.seed}; greedy, "
                         f"ignore_eos"),
            "engine_params": cfg.engine_params,
            "clients": f"{cfg.client_processes} processes x {cfg.client_streams} gRPC streams",
            "sweep": {"adapters": cfg.sweep_adapters, "fractions": list(cfg.sweep_fractions),
                      "duration_s": cfg.sweep_duration_s, "warmup_s": cfg.sweep_warmup_s, "drain_s": cfg.sweep_drain_s},
            "config": asdict(cfg),
        }

    def all_versions(self) -> dict[str, str]:
        """This interpreter's packages, with the server's and vLLM's versions as the calls saw them."""
        versions = dict(self.versions)
        servers = [s["version"] for s in self.store.data["servers"] if s.get("version")]
        if servers:
            versions["tritonserver"] = servers[-1]
        peers = sorted({v["version"] for v in self.store.data["vllm"].values() if v.get("version")})
        if peers:
            versions["vllm"] = ", ".join(peers)
        return versions

    def write(self) -> dict:
        header = self.header()
        self.store.data["header"] = header
        self.store.save()
        return write_summary(self.store, header, self.cfg.adapters, self.out)

    def skip(self, message: str) -> None:
        self.store.add("skipped", f"{message} (call {self.index})")

    def warn(self, message: str) -> None:
        self.store.add("warnings", f"{message} (call {self.index})")

    def pack_files(self) -> None:
        """runs/ and logs/ into runs_and_logs.tar.gz in the output folder (with pack)."""
        if not self.pack:
            return
        archive = self.out / PACKED
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(self.runs, arcname="runs")
            tar.add(self.logs, arcname="logs")
        size = archive.stat().st_size
        self.store.add("notes", f"call {self.index}: per-request records and logs in {PACKED} "
                                f"({size / 2**20:.1f} MiB)")
        if size > 15 * 2**20:
            self.warn(f"{PACKED} is {size / 2**20:.1f} MiB, over 16 MiB (a file that large may not be copied back); "
                      f"split the call")
        self.write()

    def warn_clients(self, what: str, clients: list[ClientLoad], lag_p99: float | None = None) -> None:
        config = self.client_config
        for c in saturated(clients, config):
            self.warn(f"{what}: client process {c.process} used {c.utilization:.2f} of a core "
                      f"(>= {config.saturated_at}): the client may have limited the measurement; "
                      f"raise --client-processes")
        if lag_p99 is not None and lag_p99 > 0.05:
            self.warn(f"{what}: sends ran {lag_p99 * 1e3:.0f} ms late at p99: the open-loop schedule slipped")

    @property
    def client_config(self) -> ClientConfig:
        return ClientConfig(self.cfg.client_processes, self.cfg.client_streams)

    def requests(self, n: int) -> list[CapacityRequest]:
        return build_requests(self.cfg.request_set, n)

    # -- engine -----------------------------------------------------------------------------------------------------

    def run_engine(self) -> None:
        cfg = self.cfg
        offline = list(cfg.adapters) if "offline" in cfg.parts else []
        sweep = "sweep" in cfg.parts
        capacity = None if cfg.sweep_adapters in offline else self.store.capacity("engine", cfg.sweep_adapters)
        if sweep and capacity is None and cfg.sweep_adapters not in offline:
            offline.append(cfg.sweep_adapters)
            self.store.add("notes", f"engine offline n={cfg.sweep_adapters} measured in call {self.index} to give the "
                                    f"sweep its capacity")
        if not offline and not sweep:
            return
        results_path = self.logs / "engine.results.json"
        plan = {
            "base_dir": self.ckpt.base_dir, "catalogue": self.ckpt.catalogue, "device": self.ckpt.device,
            "engine": cfg.engine_params, "requests": asdict(cfg.request_set), "offline_adapters": offline,
            "sweep_adapters": cfg.sweep_adapters if sweep else None, "sweep": asdict(self.sweep_config),
            "capacity_rps": capacity, "offline_cap_s": cfg.offline_cap_s, "keep_ids": cfg.keep_output_ids,
            "runs_dir": str(self.runs), "results": str(results_path), "deadline": self.budget.deadline,
        }
        plan_path = self.logs / "engine.plan.json"
        plan_path.write_text(json.dumps(plan, indent=1))
        log(f"engine: offline n={offline}, sweep {'n=' + str(cfg.sweep_adapters) if sweep else 'no'}")
        error = _run_child([sys.executable, "-m", "perf.capacity.engine", str(plan_path)], self.logs / "engine.log",
                           self.budget.remaining() + 300)
        results = json.loads(results_path.read_text()) if results_path.is_file() else {}
        if error:
            self.warn(f"engine child: {error}")
        for result in results.get("offline", []):
            digests = _digests(self.runs / f"engine_n{result['adapters']}_offline.jsonl")
            self.put_offline(result, digests)
        for point in results.get("sweep", []):
            self.store.put_sweep(point, self.index)
        for message in results.get("skipped", []):
            self.skip(message)
        for message in results.get("warnings", []):
            self.warn(message)
        for message in results.get("notes", []):
            self.store.add("notes", message)
        self.write()

    @property
    def sweep_config(self) -> SweepConfig:
        cfg = self.cfg
        return SweepConfig(tuple(cfg.sweep_fractions), cfg.sweep_duration_s, cfg.sweep_warmup_s, cfg.sweep_drain_s)

    # -- server -----------------------------------------------------------------------------------------------------

    def run_server(self) -> None:
        from perf.capacity.serving import ServerPart

        ServerPart(self).run()

    # -- vLLM -------------------------------------------------------------------------------------------------------

    def run_vllm(self) -> None:
        from perf.peers.vllm_offline import VllmPlan, find_vllm_python, run_child, target_name

        cfg = self.cfg
        if "offline" not in cfg.parts:
            return
        python, why = find_vllm_python(cfg.vllm_python)
        if python is None:
            self.skip(f"vllm: not importable here ({why})")
            self.write()
            return
        for k in cfg.vllm_max_loras:
            if not self.budget.allows(0):
                self.skip(f"vllm max_loras={k}: the time budget was spent")
                continue
            plan = VllmPlan(self.ckpt.base_dir, self.ckpt.catalogue, asdict(cfg.request_set),
                            cfg.vllm_adapter_counts, k, cfg.max_num_seqs, cfg.request_set.max_model_len,
                            max(16, cfg.rank), cfg.max_cpu_loras or max(cfg.adapters), cfg.vllm_gpu_memory_utilization,
                            "bfloat16" if self.ckpt.device.startswith("cuda") else "float32",
                            str(self.logs / f"{target_name(k)}.results.json"), str(self.runs), self.budget.deadline)
            log(f"vLLM {why} max_loras={k} ({python})")
            results = run_child(python, plan, self.logs / f"{target_name(k)}.log", self.budget.remaining() + 240)
            for result in results.get("offline", []):
                self.put_offline(result)
            self.store.data["vllm"][str(k)] = {"version": results.get("vllm"), "start_s": results.get("start_s"),
                                               "error": results.get("error"), "call": self.index}
            if results.get("error"):
                self.warn(results["error"].splitlines()[0])
            for message in results.get("skipped", []):
                self.skip(message)
            self.write()


def write_summary(store: Store, header: dict, adapter_counts: list[int], out: Path) -> dict:
    """summary.json, summary.md and store.json (what ``--merge`` reads) in ``out``."""
    summary = build_summary(store, header, adapter_counts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary, adapter_counts))
    (out / "store.json").write_text(json.dumps(store.data, indent=1) + "\n")
    return summary


def merge(paths: list[Path], out: Path | None, command: str) -> dict:
    """One summary of several calls' results (their store.json files), e.g. calls on machines that were
    given back in between (a fresh machine has no store of the earlier calls)."""
    store = merge_stores(paths, out or Path("."))
    header = dict(store.data.get("header") or {})
    if not header:
        raise ValueError("the stores hold no header (written by perf.capacity)")
    out = out or default_out(header["gpu"])
    out.mkdir(parents=True, exist_ok=True)
    store.path = out / "store.json"
    header.update(command=command, date=dt.datetime.now().isoformat(timespec="seconds"),
                  merged_from=[str(p) for p in paths])
    counts = sorted({e["adapters"] for e in store.data["offline"].values()})
    summary = write_summary(store, header, counts, out)
    if summary["sweeps"] and not plot_sweeps(summary, out):
        store.add("notes", "no plots: matplotlib is not importable here")
        summary = write_summary(store, header, counts, out)
    summary["out"], summary["adapter_counts"] = display_path(out), counts
    return summary


def _digests(path: Path) -> list[str | None] | None:
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    digests: list[str | None] = [None] * len(rows)
    for row in rows:
        digests[row["request"]] = row["output_digest"]
    return digests


def _http_get(url: str) -> str | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.read().decode()
    except OSError:
        return None


def _run_child(command: list[str], log: Path, timeout_s: float) -> str | None:
    """Run a child (its output to ``log``, its progress lines also here); None, or what went wrong."""
    import threading

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def copy() -> None:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if line.startswith("[capacity"):
                    print(line, end="", flush=True)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        copier.join(timeout=10)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        return f"exited with {code}; log {log}:\n{tail}"
    return None


def run(cfg: CapacityConfig, out: Path | None, command: str) -> dict:
    call = Call(cfg, out, command)
    call.setup()
    log(f"device {call.ckpt.device} ({call.ckpt.device_name}); results in {display_path(call.out)}")
    try:
        if "engine" in cfg.targets:
            call.run_engine()
        if any(t in cfg.targets for t in SERVER_TARGETS) or "soak" in cfg.parts:
            call.run_server()
        if "vllm" in cfg.targets:
            call.run_vllm()
        summary = call.write()
        if summary["sweeps"] and not plot_sweeps(summary, call.out):
            call.store.add("notes", "no plots: matplotlib is not importable here")
    finally:
        call.stop_sampling()
        call.pack_files()
    summary = call.write()
    summary["out"] = display_path(call.out)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg, out = parse_args(args, __doc__)
    except ValueError as e:
        print(f"capacity: {e}", file=sys.stderr)
        return 2
    command = "python -m perf.capacity " + shlex.join(args)
    # a SIGTERM (a runner's time limit) unwinds like Ctrl-C, so the server and the children are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    try:
        summary = merge([Path(m) for m in cfg.merge], out, command) if cfg.merge else run(cfg, out, command)
    except ServerLacksIgnoreEos as e:
        print(f"\ncapacity: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as e:
        if not cfg.merge:
            raise
        print(f"capacity: {e}", file=sys.stderr)
        return 2
    print(f"\nresults in {summary['out']} ({time.monotonic() - t0:.0f} s in all)\n")
    print(short_table(summary, summary.get("adapter_counts", cfg.adapters)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
