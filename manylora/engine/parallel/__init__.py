"""Tensor parallelism: how a base and its adapters are sharded over ranks (Megatron; LoRA partitioned so that it
adds no communication) and the ranks' worker processes.

Imports the engine's top level, adapters, layers, memory and models; never execution or scheduling.
"""
