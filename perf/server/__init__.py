"""Load through the running server: the replay target over gRPC (triton_target.py), locust users
(locustfile.py), perf_analyzer sweeps with inputs made from the server's own adapter list (perf_analyzer.py)."""
