"""Benchmarks: S-LoRA's workload, replay against the engine or the Triton server, baselines, reports."""
