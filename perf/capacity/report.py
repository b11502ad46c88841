"""The capacity benchmark's report of a results store (perf/capacity/store.py): the offline table with each
target's ratio to its call's engine, token identity, the sweeps and their knees, summary.json, summary.md, plots
and the short table printed last.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

from perf.capacity.engine_counters import counters_table
from perf.capacity.metrics import KNEE_DEFINITION, SweepPoint, find_knee, knee_notes
from perf.capacity.process_cpu import cpu_table
from perf.capacity.store import Store

LABELS = {
    "engine": "in-process engine",
    "server_stream": "server, streaming",
    "server_nostream": "server, non-streaming",
    "llm": "llm ensemble (text, streaming)",
    "vllm_best": "vLLM best of max_loras",
}
OFFLINE_ORDER = ("engine", "server_stream", "server_nostream", "llm")


def label(target: str) -> str:
    if target.startswith("vllm_k"):
        return f"vLLM max_loras={target[len('vllm_k'):]}"
    return LABELS.get(target, target)


def _fmt(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{v:,.{digits}f}"


def offline_rows(store: Store, adapter_counts: list[int]) -> list[dict]:
    """Rows of table (1): each target at each adapter count, its ratio to the in-process engine of the same call
    (of the latest call that ran it where that call did not: ``baseline_call`` says which); vLLM's best K."""
    offline = store.data["offline"]
    targets = [t for t in OFFLINE_ORDER if any(k.startswith(f"{t}|") for k in offline)]
    vllm_targets = sorted({k.split("|")[0] for k in offline if k.startswith("vllm_k")},
                          key=lambda t: int(t[len("vllm_k"):]))
    rows = []
    for n in adapter_counts:
        candidates = [store.offline(t, n) for t in vllm_targets]
        candidates = [c for c in candidates if c and c["completed"]]
        best = max(candidates, key=lambda c: c["req_per_s"]) if candidates else None
        for target in [*targets, *vllm_targets, "vllm_best"]:
            entry = best if target == "vllm_best" else store.offline(target, n)
            if entry is None:
                continue
            engine = store.baseline(entry.get("call"), n)
            rows.append({
                "target": target,
                "label": label(target),
                "adapters": n,
                "max_loras": entry["meta"].get("max_loras"),
                "req_per_s": entry["req_per_s"],
                "output_tok_per_s": entry["output_tok_per_s"],
                "ratio_req_per_s": entry["req_per_s"] / engine["req_per_s"] if engine and engine["req_per_s"] else None,
                "ratio_tok_per_s": (entry["output_tok_per_s"] / engine["output_tok_per_s"]
                                    if engine and engine["output_tok_per_s"] else None),
                "completed": entry["completed"],
                "requests": entry["requests"],
                "exact_length": entry["exact_length"],
                "capped": entry["capped"],
                "client_cpu_max": entry.get("client_cpu_max"),
                "call": entry.get("call"),
                "baseline_call": engine.get("call") if engine else None,
            })
    return rows


def token_identity(store: Store) -> list[dict]:
    """Per adapter count, requests whose output tokens equal the in-process engine's: each server target against
    the engine run of its call (else the latest), and each later call's engine run against the first call's (how
    far the engine agrees with itself from run to run, the yardstick for the servers' figures)."""
    out = []
    for key, entry in sorted(store.data["offline"].items()):
        target, n = key.split("|")
        engine = store.baseline(entry.get("call"), int(n))
        if target == "engine" or not engine or "digests" not in engine or "digests" not in entry:
            continue
        out.append({"target": target, "adapters": int(n), "engine_call": engine.get("call"),
                    **_agreement(engine["digests"], entry["digests"])})
    runs: dict[int, list[dict]] = {}
    for run in store.data["engine_runs"].values():
        if run.get("digests"):
            runs.setdefault(run["adapters"], []).append(run)
    for n, group in sorted(runs.items()):
        first, *later = sorted(group, key=lambda r: r["call"])
        for run in later:
            out.append({"target": "engine", "adapters": n, "engine_call": first["call"], "call": run["call"],
                        **_agreement(first["digests"], run["digests"])})
    return out


def _agreement(reference: list[str | None], other: list[str | None]) -> dict:
    pairs = [(a, b) for a, b in zip(reference, other, strict=True) if a and b]
    return {"compared": len(pairs), "identical": sum(1 for a, b in pairs if a == b)}


def sweeps(store: Store) -> dict[str, dict]:
    """Per target and adapter count: its points in rate order, the knee and its caveats."""
    groups: dict[str, list[SweepPoint]] = {}
    for entry in store.data["sweep"].values():
        fields = {k: v for k, v in entry.items() if k != "call"}
        point = SweepPoint(**fields)
        groups.setdefault(f"{point.target}|{point.adapters}", []).append(point)
    result = {}
    for key, points in sorted(groups.items()):
        points.sort(key=lambda p: p.offered_rps)
        knee = find_knee(points)
        result[key] = {
            "target": points[0].target,
            "adapters": points[0].adapters,
            "points": [asdict(p) for p in points],
            "knee_rps": knee,
            "knee": "none" if knee is None else round(knee, 4),
            "knee_fraction": next((p.fraction for p in points if p.offered_rps == knee), None),
            "notes": knee_notes(points),
        }
    return result


def build_summary(store: Store, header: dict, adapter_counts: list[int]) -> dict:
    return {
        **header,
        "knee_definition": KNEE_DEFINITION,
        "offline_table": offline_rows(store, adapter_counts),
        "token_identity": token_identity(store),
        "sweeps": sweeps(store),
        "soak": list(store.data["soak"].values()),
        "vllm": store.data["vllm"],
        "servers": store.data["servers"],
        "calls": store.data["calls"],
        "skipped": store.data["skipped"],
        "warnings": store.data["warnings"],
        "notes": store.data["notes"],
        "offline": {k: {f: v for f, v in e.items() if f != "digests"} for k, e in store.data["offline"].items()},
    }


def offline_table(rows: list[dict], adapter_counts: list[int]) -> str:
    """Targets down, adapter counts across: req/s, output tok/s and the ratio to the engine's req/s."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    by = {(r["target"], r["adapters"]): r for r in rows}
    counts = [n for n in adapter_counts if any(r["adapters"] == n for r in rows)]
    head = "| target | " + " | ".join(f"n={n}: req/s, tok/s (x engine)" for n in counts) + " |"
    lines = [head, "|---|" + "---|" * len(counts)]
    for t in targets:
        cells = []
        for n in counts:
            r = by.get((t, n))
            if r is None:
                cells.append("-")
                continue
            if r["ratio_req_per_s"] is None or t == "engine":
                ratio = ""
            elif r["baseline_call"] == r["call"]:
                ratio = f" (x{r['ratio_req_per_s']:.2f})"
            else:
                ratio = f" (x{r['ratio_req_per_s']:.2f} of call {r['baseline_call']}'s engine)"
            flag = " capped" if r["capped"] else ""
            best = f" [max_loras {r['max_loras']}]" if t == "vllm_best" else ""
            cells.append(f"{r['req_per_s']:.2f}, {r['output_tok_per_s']:,.0f}{ratio}{best}{flag}")
        name = next(r["label"] for r in rows if r["target"] == t)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def offline_details(rows: list[dict]) -> str:
    """Each offline run: completions, exact lengths, whether capped, the busiest client process's CPU, its call."""
    lines = ["| target | n | done / sent | exact length | capped | busiest client (cores) | call | x engine of call |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["target"], r["adapters"])):
        if r["target"] == "vllm_best":
            continue
        lines.append(f"| {r['label']} | {r['adapters']} | {r['completed']} / {r['requests']} | {r['exact_length']} "
                     f"| {'yes' if r['capped'] else 'no'} | {_fmt(r['client_cpu_max'])} | {r['call']} "
                     f"| {_ratio(r)} |")
    return "\n".join(lines) + "\n"


def _ratio(row: dict) -> str:
    if row["target"] == "engine" or row["ratio_req_per_s"] is None:
        return "-"
    return f"{row['ratio_req_per_s']:.3f} of call {row['baseline_call']}"


def sweep_table(sweep: dict) -> str:
    lines = [
        "| x capacity | offered req/s | in window | achieved req/s | achieved tok/s | TTFT p50 (s) | TTFT p99 (s) "
        "| ITL p50 (ms) | ITL p99 (ms) | sent | done | steady | busiest client (cores) | meets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sweep["points"]:
        p99 = "inf" if p["ttft_inf"] else _fmt(p["ttft_p99"], 3)
        lines.append(
            f"| {p['fraction']:.2f} | {p['offered_rps']:.2f} | {p['offered_in_window_rps']:.2f} "
            f"| {p['achieved_rps']:.2f} | {p['achieved_tok_per_s']:,.0f} | {_fmt(p['ttft_p50'], 3)} | {p99} "
            f"| {_fmt(None if p['itl_p50'] is None else p['itl_p50'] * 1e3, 1)} "
            f"| {_fmt(None if p['itl_p99'] is None else p['itl_p99'] * 1e3, 1)} | {p['sent']} | {p['completed']} "
            f"| {'yes' if p['steady'] else 'no'} | {_fmt(p['client_cpu_max'])} "
            f"| {'yes' if p['meets_throughput'] and p['meets_ttft'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def soak_lines(soak: dict) -> list[str]:
    load = soak["load"]
    lines = [
        f"### {label(soak['target'])}, n={soak['adapters']}: {soak['duration_s']:g} s at {soak['fraction']:g} x "
        f"{soak['capacity_rps']:.2f} req/s (call {soak.get('call')})",
        "",
        f"sent {load['sent']}, completed {load['completed']}, failed {load['failed']}, unfinished "
        f"{load['unfinished']}; achieved {load['achieved_rps']:.2f} req/s, TTFT p50 {_fmt(load['ttft_p50'], 3)} s, "
        f"p99 {'inf' if load['ttft_inf'] else _fmt(load['ttft_p99'], 3)} s",
        "",
        "| process | start MB | end MB | max MB | slope MB/min |",
        "|---|---|---|---|---|",
    ]
    memory = soak["memory"]
    for name, s in memory.get("host_rss", {}).items():
        lines.append(f"| RSS {name} | {s['start_mb']:,.1f} | {s['end_mb']:,.1f} | {s['max_mb']:,.1f} "
                     f"| {_fmt(s['slope_mb_per_min'], 3)} |")
    gpu = memory.get("gpu")
    if gpu is None:
        lines.append("| GPU | no nvidia-smi on this machine | | | |")
    elif not gpu:
        lines.append("| GPU | no process of the server in nvidia-smi's list (another PID namespace?) | | | |")
    for name, s in (gpu or {}).items():
        lines.append(f"| GPU {name} (MiB) | {s['start_mb']:,.1f} | {s['end_mb']:,.1f} | {s['max_mb']:,.1f} "
                     f"| {_fmt(s['slope_mb_per_min'], 3)} |")
    s = memory.get("gpu_all_processes")
    if s:
        lines.append(f"| GPU, every compute process (MiB) | {s['start_mb']:,.1f} | {s['end_mb']:,.1f} "
                     f"| {s['max_mb']:,.1f} | {_fmt(s['slope_mb_per_min'], 3)} |")
    return [*lines, ""]


def markdown(summary: dict, adapter_counts: list[int]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    lines = [
        f"# Capacity: {summary['shape']} on {summary['gpu']}",
        "",
        f"- command: `{summary['command']}`",
        f"- date: {summary['date']}",
        f"- GPU: {summary['gpu']}",
        f"- packages: {versions}",
        f"- workload: {summary['workload']}",
        f"- engine and server: {summary['engine_params']}",
        f"- clients: {summary['clients']}",
        f"- calls merged here: {len(summary['calls'])} (each entry's `call` is its index in summary.json's `calls`)",
        "",
        "## 1. Offline throughput (every request at once, greedy, ignore_eos: exact output lengths)",
        "",
        offline_table(summary["offline_table"], adapter_counts),
        "The engine's row is its latest run; each ratio is against the engine run of the call that measured the "
        "entry (the details below give both).",
        "",
    ]
    lines.append(offline_details(summary["offline_table"]))
    for t in summary["token_identity"]:
        which = f"in-process engine of call {t['call']}" if t["target"] == "engine" else label(t["target"])
        lines.append(f"- {which}, n={t['adapters']}: {t['identical']}/{t['compared']} requests' output tokens "
                     f"identical to the in-process engine's of call {t['engine_call']}")
    counters = counters_table(summary["offline"].values(), label)
    if counters:
        lines += ["", "The engine's counters over each run (its stats before and after the run; the server's engine "
                      "through the generator's `stats` control op): where two targets differ on the same requests, "
                      "whether the engine ran more or slower steps or moved more adapters. A step's wall time splits "
                      "into the engine loop's time in the step itself (the forward, sampling, emitting), sending "
                      "the outputs to the server's stub (the in-process engine sends nothing) and waiting for work "
                      "while the run lasted, each per step; \"outside the run\" is the loop's waiting before the "
                      "first request and after the last (the readings bracket the client processes' start and end).",
                  "", counters.rstrip()]
    cores = cpu_table(summary["offline"].values(), label)
    if cores:
        lines += ["", "The CPU each target's processes used over each run, in cores (their user + system seconds "
                      "between readings before and after the run, over the seconds between the readings; "
                      "perf/capacity/process_cpu.py): the stubs share the host with the engine process's launches.",
                  "", cores.rstrip()]
    lines += ["", "## 2. Open-loop sweep (Poisson arrivals; offered = fraction x the target's offline req/s)", "",
              KNEE_DEFINITION + ".", ""]
    for sweep in summary["sweeps"].values():
        knee = "none" if sweep["knee_rps"] is None else f"{sweep['knee_rps']:.2f} req/s"
        lines += [f"### {label(sweep['target'])}, n={sweep['adapters']}: knee {knee}"
                  + (f" ({sweep['knee_fraction']:g} x capacity)" if sweep["knee_fraction"] else ""), "",
                  sweep_table(sweep)]
        lines += [f"- {n}" for n in sweep["notes"]]
        lines.append("")
    lines += ["## 3. Soak", ""]
    if not summary["soak"]:
        lines += ["not run (--soak SECONDS)", ""]
    for soak in summary["soak"]:
        lines += soak_lines(soak)
    for kind in ("warnings", "skipped", "notes"):
        if summary[kind]:
            lines += [f"## {kind.capitalize()}", "", *[f"- {m}" for m in summary[kind]], ""]
    return "\n".join(lines)


def plot_sweeps(summary: dict, out: Path) -> list[Path]:
    """sweep_throughput.png (achieved vs offered req/s) and sweep_ttft_p99.png; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - absent, or built for another numpy (the H200 server venv's numpy 1.26)
        return []
    sweeps_ = list(summary["sweeps"].values())
    if not sweeps_:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(5.5, 4))
    top = 0.0
    for s in sweeps_:
        xs = [p["offered_rps"] for p in s["points"]]
        ax.plot(xs, [p["achieved_rps"] for p in s["points"]], marker="o",
                label=f"{label(s['target'])} n={s['adapters']} (knee {s['knee']})")
        top = max(top, *xs)
    ax.plot([0, top], [0, top], linestyle=":", color="gray", linewidth=1, label="achieved = offered")
    ax.set_xlabel("offered (req/s)")
    ax.set_ylabel("achieved in the window (req/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "sweep_throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for s in sweeps_:
        points = [p for p in s["points"] if p["ttft_p99"] is not None]
        ax.plot([p["offered_rps"] for p in points], [p["ttft_p99"] for p in points], marker="o",
                label=f"{label(s['target'])} n={s['adapters']}")
    ax.axhline(1.0, linestyle=":", color="red", linewidth=1, label="1 s (knee criterion)")
    ax.set_yscale("log")
    ax.set_xlabel("offered (req/s)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "sweep_ttft_p99.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def short_table(summary: dict, adapter_counts: list[int]) -> str:
    """What is printed last: the offline table, the knees, the soak's total RSS slope."""
    lines = [offline_table(summary["offline_table"], adapter_counts)]
    for s in summary["sweeps"].values():
        knee = "none" if s["knee_rps"] is None else f"{s['knee_rps']:.2f} req/s ({s['knee_fraction']:g} x capacity)"
        lines.append(f"knee of {label(s['target'])}, n={s['adapters']}: {knee}")
    for soak in summary["soak"]:
        total = soak["memory"].get("host_rss", {}).get("total", {})
        lines.append(f"soak {soak['duration_s']:g} s: host RSS total {total.get('start_mb')} -> {total.get('end_mb')} "
                     f"MB, slope {total.get('slope_mb_per_min')} MB/min")
    lines += [f"WARNING: {w}" for w in summary["warnings"]]
    return "\n".join(lines) + "\n"
