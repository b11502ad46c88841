"""S-LoRA's workload and its replay: the trace (trace.py), sending it (replay.py, runner.py), per-request records,
the summary and plots (records.py, report.py, plots.py)."""
