"""What ``Engine.stats()`` reports: counters, queues, pool and adapter tiers, the configuration that shapes them, and
how steps ran (CUDA graphs or eager). Read between two loop iterations (the engine holds its state lock)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from manylora.engine.scheduling.engine import Engine
    from manylora.engine.scheduling.sequence import Sequence


def engine_stats(engine: Engine, counters: dict[str, int], not_yet_queued: int) -> dict:
    """The engine's ``counters`` (steps, requests, finished, errors, tokens) and state as one flat dict (the server's
    metrics and the routers read it); ``not_yet_queued``: requests submitted since the last loop iteration."""
    scheduler = engine.scheduler
    return {
        **counters,
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting) + not_yet_queued,
        # requests per adapter name, for routers (the base model's are not listed): those in the running batch
        # and those queued (a request submitted since the last loop iteration is counted from the next)
        "running_adapters": requests_per_adapter(scheduler.running),
        "waiting_adapters": requests_per_adapter(scheduler.waiting),
        "max_loras": engine.config.max_loras,
        "max_num_seqs": engine.config.max_num_seqs,
        "page_size": engine.kv.page_size,
        "preemptions": scheduler.num_preemptions,
        "adapters_registered": len(engine.catalogue),
        "adapters_refused": len(engine.catalogue.refused()),
        **engine.adapters.stats(),
        "device": engine.device,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "max_model_len": engine.max_len,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "adapter_load_processes": engine.load_processes,
        **graph_stats(engine, counters["steps"]),
        **engine.loop_times.stats(),
    }


def requests_per_adapter(sequences: Iterable[Sequence]) -> dict[str, int]:
    """Requests per adapter name among ``sequences`` (base-model requests left out)."""
    counts: dict[str, int] = {}
    for seq in sequences:
        name = seq.adapter
        if name:
            counts[name] = counts.get(name, 0) + 1
    return counts


def graph_stats(engine: Engine, steps: int) -> dict:
    """Steps replayed from CUDA graphs (decode, mixed) and run eagerly, and the mixed-step buckets captured
    (empty where mixed steps run eagerly: no graphs on this device, or their capture ran out of memory); ``steps``:
    every step the engine ran."""
    graphs, mixed_graphs = engine.graphs, engine.mixed_graphs
    decode = sum(graphs.replays.values()) if graphs is not None else 0
    mixed = sum(mixed_graphs.replays.values()) if mixed_graphs is not None else 0
    return {"steps_decode_graph": decode, "steps_mixed_graph": mixed,
            "steps_eager": steps - decode - mixed,
            "mixed_step_buckets": list(mixed_graphs.buckets) if mixed_graphs is not None else []}
