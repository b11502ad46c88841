"""Adapters: a PEFT adapter's spec (parsed, validated, hashed), its layout in pool pages and packing, its
weights, loading by threads or processes, the host-memory tier, the catalogue and the resolvers.

Owns everything about an adapter outside the GPU pool. Imports only the engine's top level: not memory (which
imports it), layers, models, execution or scheduling.
"""
