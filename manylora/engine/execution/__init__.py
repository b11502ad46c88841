"""Execution: from a scheduled plan to a forward step, eager or replayed from CUDA graphs (decode steps and mixed
steps per bucket), and the warm-up that compiles the kernels for the step sizes a server will see.

Imports the engine's top level, adapters, layers, memory and models; the scheduler's types only for annotations
(scheduling imports this).
"""
