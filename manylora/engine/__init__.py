"""The engine: one resident base model, many LoRA adapters, continuous batching, one paged pool.

Plain Python, no Triton Server import: the model files in model_repository/ translate requests into calls
on :class:`manylora.engine.scheduling.engine.Engine` (through ``scheduling.engine_process``). Subpackages by
concern, each importing only those listed before it:

    (top)       config, errors, devices, processes, model_config, safetensors_view: the engine's vocabulary
    requests    what a request is, and how it is parsed, checked, sampled and detokenized
    adapters    adapter specs, their layout in pages, weights, loading, the host tier, catalogue, resolvers
    memory      the unified pool: pages, KV cache, adapter slots and residency, sizing
    layers      what a forward step is made of: step and LoRA batch metadata, RoPE, attention grouping,
                decode GEMM settings, collectives
    models      model families (Llama, MoE) and checkpoint loading
    parallel    tensor parallelism: sharding, LoRA partition, the ranks' runtime
    execution   from a scheduled plan to a forward: step building, CUDA graphs, warm-up
    scheduling  the engine loop and its process, the scheduler, sequences, observers

tests/test_layout.py checks the order.
"""
