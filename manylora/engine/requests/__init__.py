"""Requests: what one is (``types``), and how it is parsed from Triton tensors and parameters, checked, guarded
against prompts that cannot fit, sampled, detokenized and turned back into response tensors.

Owns the per-request rules. Imports only the engine's top level (config, errors): nothing of the pool, the
models or the scheduler, so the Triton model files can use it without loading the engine.
"""
