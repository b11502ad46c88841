"""Benchmarks of the kernels alone (LoRA shrink/expand, attention, the base GEMM, MoE-LoRA) against their bytes
floor, and what they compile to (compile_report.py)."""
