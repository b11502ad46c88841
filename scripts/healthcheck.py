"""Real-inference health check: is the generator actually generating?

Triton 2.51 does not restart a dead Python-backend stub, and /v2/health/ready keeps answering
200 while every request to the model fails ("Stub process is not healthy."). This check sends
a 1-token generate to the `generator` model over a gRPC stream and waits for the token:

    python scripts/healthcheck.py --url 127.0.0.1:8001 --timeout 10
    exit 0: a token came back ("ok: 1 token in 0.02 s")
    exit 1: an error response, a timeout, or no server; the reason is printed on stderr

As a Kubernetes liveness probe (restart the pod when the stub is dead):

    livenessProbe:
      exec:
        command: ["python", "/opt/manylora/scripts/healthcheck.py", "--url", "127.0.0.1:8001", "--timeout", "10"]
      initialDelaySeconds: 120   # model load
      periodSeconds: 30
      timeoutSeconds: 15         # > --timeout
      failureThreshold: 3

Keep the readiness probe on /v2/health/ready (it says when models are loaded); the liveness
probe above catches what readiness misses. The request goes to the base model (no adapter),
so it also succeeds while adapters are being loaded or evicted; --adapter checks one adapter.
Uses only tritonclient (no torch, no backend imports): cheap to run every few seconds.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time

import numpy as np


def check(url: str, timeout: float, model: str = "generator", token_id: int = 0, adapter: str | None = None) -> str:
    """Returns a one-line success message; raises RuntimeError with the reason otherwise."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor("input_ids", np.array([[token_id]], dtype=np.int32), "INT32"),
        tensor("max_tokens", np.array([[1]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[False]], dtype=np.bool_), "BOOL"),
    ]
    if adapter:
        inputs.append(tensor("lora_name", np.array([[adapter.encode()]], dtype=np.object_), "BYTES"))
    results: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    try:
        client = grpcclient.InferenceServerClient(url)
    except Exception as e:  # noqa: BLE001 - report any client failure as unhealthy
        raise RuntimeError(f"cannot create a gRPC client for {url}: {e}") from None
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)), stream_timeout=timeout)
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput("output_ids")],
                                  enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no token from '{model}' at {url} within {timeout} s")
            try:
                result, error = results.get(timeout=left)
            except queue.Empty:
                raise RuntimeError(f"no token from '{model}' at {url} within {timeout} s") from None
            if error is not None:
                message = error.message() if isinstance(error, InferenceServerException) else str(error)
                raise RuntimeError(f"'{model}' at {url} answered with an error: {message}")
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                return f"ok: {ids.size} token from '{model}' at {url} in {time.perf_counter() - t0:.2f} s"
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                raise RuntimeError(f"'{model}' at {url} finished without a token")
    finally:
        try:
            client.stop_stream(cancel_requests=True)
            client.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken stream must not mask the verdict
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="manylora liveness check: one real token from the generator")
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint host:port (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the token (default %(default)s)")
    ap.add_argument("--model", default="generator")
    ap.add_argument("--token-id", type=int, default=0, help="prompt token id (default 0, the BOS of most models)")
    ap.add_argument("--adapter", default=None, help="check this adapter instead of the base model")
    ap.add_argument("--quiet", action="store_true", help="print nothing on success")
    args = ap.parse_args(argv)
    try:
        message = check(args.url, args.timeout, args.model, args.token_id, args.adapter)
    except RuntimeError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - any other failure is also "not healthy"
        print(f"unhealthy: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
