"""Benchmarks of the engine in-process: the decode step against its bytes floor, the MoE step, per-step
profiles, the headline workload, adapter loading; random-weight checkpoints of named shapes (checkpoint.py,
shapes.py); the engine as a replay target (engine_target.py)."""
