"""What a forward step is made of: the step's token batch (``step_batch``), its LoRA batch metadata over the pool
(``lora_batch``), rotary embeddings, prefill attention grouping, the decode GEMMs' SM settings, and a tensor-parallel
rank's collectives (``comm``).

Owns the per-step tables the models read. Imports the engine's top level, adapters, memory and the kernels; never
models, execution or scheduling.
"""
