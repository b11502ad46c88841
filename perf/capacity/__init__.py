"""Capacity through the server: the same requests to the engine in-process, the real tritonserver and vLLM;
offline throughput, an open-loop sweep, a soak (``python -m perf.capacity``; perf/capacity/command.py)."""
