"""Scheduling: the engine (its loop, admission, steps, failures isolated per request), the building of its parts
(assembly), what its stats report (engine_stats), the engine in a process of its own for the Triton stub,
iteration-level scheduling, sequences, the observer interface and blocking offline use.

The top of the engine: may import every other subpackage; nothing of the engine imports it.
"""
