"""manylora client: a thin library over tritonclient (gRPC streaming, HTTP generate) and a CLI.

from manylora.client import ManyLoraClient
c = ManyLoraClient()                      # gRPC localhost:8001, HTTP localhost:8000
for piece in c.stream("Once upon a time", adapter="shout", max_tokens=32):
    print(piece, end="", flush=True)
"""

from manylora.client.api import GenerateResult, ManyLoraClient, ManyLoraError

__all__ = ["GenerateResult", "ManyLoraClient", "ManyLoraError"]
