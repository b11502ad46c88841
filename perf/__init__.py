"""Benchmarks and their results: S-LoRA's workload and its replay (workload/), the kernels (kernels/), the engine
(engine/), capacity through the server (capacity/), load on the running server (server/), vLLM and PEFT on the
same requests (peers/), the GPU machine's entry point (device/); perf/README.md."""
