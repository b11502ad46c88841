"""manylora: serve one base LLM and many LoRA adapters from one GPU, inside Triton Inference Server.

    manylora.engine     the engine: requests, scheduling, the unified pool, adapters, models (plain Python)
    manylora.kernels    OpenAI Triton kernels, each beside a torch reference; know nothing of the engine
    manylora.client     a client of the server (tritonclient) and its CLI (python -m manylora.client)
    manylora.embedded   the small default model and adapters that `make serve` builds

The Triton model repository (model_repository/) imports the engine; the engine imports the kernels;
nothing here imports the model repository, perf/ or tests/.
"""
