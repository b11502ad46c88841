"""The capacity benchmark's results store: what each call measured, merged across calls of one configuration.

A run on a GPU machine is split into several calls of under 10 minutes, so results accumulate in a store in the
work folder (kept while the machine stays warm): each call merges what it measured into the store (each entry says
which call measured it, every call's engine run is kept as the baseline of that call's other targets), and stores
of calls on machines given back in between merge into one (``merge_stores``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

NOT_INSTALLED = "not installed"  # a package version the call could not find


def fingerprint(config: dict) -> str:
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


class Store:
    """Results by key, merged across calls of the same configuration (a JSON file)."""

    def __init__(self, path: Path, config: dict, fresh: bool = False) -> None:
        self.path = path
        data = {} if fresh or not path.is_file() else json.loads(path.read_text())
        self.data = {"config": config, "offline": {}, "sweep": {}, "soak": {}, "vllm": {}, "calls": [],
                     "skipped": [], "warnings": [], "notes": [], "servers": [], "engine_runs": {}, **data}
        self.data["config"] = config
        for entry in self.data["offline"].values():  # stores written before engine_runs existed
            if entry["target"] == "engine":
                self._keep_engine_run(entry)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")

    def put_offline(self, result: dict, call: int, digests: list[str | None] | None = None) -> None:
        entry = {**result, "call": call}
        if digests is not None:
            entry["digests"] = digests
        self.data["offline"][f"{result['target']}|{result['adapters']}"] = entry
        if result["target"] == "engine":
            self._keep_engine_run(entry)

    def _keep_engine_run(self, entry: dict) -> None:
        """Every call's engine run at each adapter count (``offline`` keeps only the latest): the baseline of
        the other targets that call measured."""
        if entry.get("call") is None:
            return
        keep = ("adapters", "call", "req_per_s", "output_tok_per_s", "completed", "digests")
        self.data["engine_runs"].setdefault(f"{entry['call']}|{entry['adapters']}",
                                            {k: entry[k] for k in keep if k in entry})

    def offline(self, target: str, adapters: int) -> dict | None:
        return self.data["offline"].get(f"{target}|{adapters}")

    def baseline(self, call: int | None, adapters: int) -> dict | None:
        """The engine run a result is rated against: the one of the same call, else the latest at that count."""
        same = self.data["engine_runs"].get(f"{call}|{adapters}")
        return same if same and same["completed"] else self.offline("engine", adapters)

    def capacity(self, target: str, adapters: int) -> float | None:
        entry = self.offline(target, adapters)
        return entry["req_per_s"] if entry and entry["completed"] else None

    def put_sweep(self, point: dict, call: int) -> None:
        key = f"{point['target']}|{point['adapters']}|{point['fraction']:.4f}"
        self.data["sweep"][key] = {**point, "call": call}

    def put_soak(self, soak: dict, call: int) -> None:
        self.data["soak"][f"{soak['target']}|{soak['adapters']}"] = {**soak, "call": call}

    def add(self, kind: str, message: str) -> None:
        if message not in self.data[kind]:
            self.data[kind].append(message)

    def absorb(self, other: dict) -> None:
        """Add another store's calls and results (``other`` = its data). A call both hold (same date and
        command: a later call on a machine that stayed warm carries the earlier ones) is kept once; the others'
        call numbers are mapped onto this store's, and their entries replace ours where both measured one thing."""
        if other.get("config") != self.data["config"]:
            raise ValueError(f"the stores measured different configurations:\n{other.get('config')}\n"
                             f"{self.data['config']}")
        known = {(c["date"], c["command"]): i for i, c in enumerate(self.data["calls"])}
        mapping = {}
        for i, call in enumerate(other.get("calls", [])):
            key = (call["date"], call["command"])
            if key not in known:
                known[key] = len(self.data["calls"])
                self.data["calls"].append(call)
            mapping[i] = known[key]

        def renumber(text: str) -> str:
            return re.sub(r"\bcall (\d+)", lambda m: f"call {mapping.get(int(m.group(1)), int(m.group(1)))}", text)

        for kind in ("offline", "sweep", "soak", "vllm"):
            for key, entry in other.get(kind, {}).items():
                self.data[kind][key] = {**entry, "call": mapping.get(entry["call"])} if "call" in entry else entry
        engine_runs = [*other.get("engine_runs", {}).values(),
                       *(e for e in other.get("offline", {}).values() if e["target"] == "engine")]
        for run in engine_runs:
            self._keep_engine_run({**run, "call": mapping.get(run["call"])})
        for kind in ("skipped", "warnings", "notes"):
            for message in other.get(kind, []):
                self.add(kind, renumber(message))
        servers = {(s["call"], s.get("ready_s")) for s in self.data["servers"]}
        for server in other.get("servers", []):
            moved = {**server, "call": mapping.get(server["call"])}
            if (moved["call"], moved.get("ready_s")) not in servers:
                self.data["servers"].append(moved)
        if other.get("header"):  # the later call's header, with the versions every call saw
            seen = self.data.get("header", {}).get("versions", {})
            later = other["header"].get("versions", {})
            versions = {**seen, **{k: v for k, v in later.items() if k not in seen or v != NOT_INSTALLED}}
            self.data["header"] = {**other["header"], "versions": versions}


def merge_stores(paths: list[Path], out: Path) -> Store:
    """One store of several calls' store.json files (or folders holding one), oldest call first."""
    files = [p / "store.json" if p.is_dir() else p for p in paths]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"no store.json at {missing}")
    datas = [json.loads(f.read_text()) for f in files]
    datas.sort(key=lambda d: d["calls"][-1]["date"] if d["calls"] else "")  # the latest store's header wins
    store = Store(out / "store.json", datas[0]["config"], fresh=True)
    for data in datas:
        store.absorb(data)
    return store
