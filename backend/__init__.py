"""manylora engine: one resident base model, many LoRA adapters, continuous batching.

Plain Python (no Triton Server imports): the Triton model files in model_repository/
translate requests into calls on :class:`backend.engine.Engine`.
"""
