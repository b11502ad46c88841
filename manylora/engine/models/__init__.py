"""Model families the engine serves (dense Llama-family and MoE bases) and checkpoint loading.

Owns the weights and the forward. Imports the engine's top level, layers, memory and the kernels; never execution,
parallel (except a rank's collectives from layers) or scheduling.
"""
