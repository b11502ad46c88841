"""Memory: the unified pool (S-LoRA's Unified Paging), its page allocator, the paged KV cache, the adapter slots and
their residency (``adapter_manager``: host tier -> pool, eviction, uploads), pinned copies and sizing.

Owns every byte of the GPU pool. Imports the engine's top level and adapters; never layers, models, execution or
scheduling.
"""
