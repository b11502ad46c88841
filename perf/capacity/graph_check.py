"""Whether the engine measured is the one configured: mixed steps asked to replay from CUDA graphs but run eagerly
(their capture ran out of memory) make a slower engine, which a capacity result must say it measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from manylora.engine.config import EngineConfig


def graph_warnings(config: EngineConfig, device: str, is_moe: bool, captured: list[int]) -> list[str]:
    """Warnings for an engine of ``config`` on ``device`` whose ``stats()["mixed_step_buckets"]`` is ``captured``:
    none where the configuration has no mixed-step graphs (the CPU, graphs off, MoE bases, tensor parallelism)."""
    from manylora.engine.config import parse_token_buckets
    from manylora.engine.execution.step_graphs import token_buckets

    graphed = device.startswith("cuda") and config.cuda_graphs and config.mixed_step_graphs
    if not graphed or is_moe or config.tensor_parallel_size > 1:
        return []
    wanted = token_buckets(config.max_num_batched_tokens, parse_token_buckets(config.mixed_step_buckets))
    if not captured:
        return ["engine: mixed steps run eagerly, their CUDA graphs were not captured (see the engine log)"]
    if len(captured) < len(wanted):
        return [f"engine: mixed-step CUDA graphs for {len(captured)} of {len(wanted)} token buckets (out of memory "
                f"for the others); steps pad to those captured"]
    return []
