"""Real-inference health check: does the server actually generate, through every model?

Triton 2.51 does not restart a dead Python-backend stub, and /v2/health/ready keeps answering
200 while requests to that model fail ("Stub process is not healthy.") or, for the decoupled
`postprocessing` step of the `llm` ensemble, wait forever. This check sends a 1-token request
over a gRPC stream to `generator` (token ids) and then to `llm` (text: preprocessing, generator
and postprocessing in turn) and waits for each to come back:

    python scripts/healthcheck.py --url 127.0.0.1:8001 --timeout 10
    exit 0: both answered ("ok: 1 token from 'generator' ... ; ok: 1 token from 'llm' ...")
    exit 1: an error response, a timeout, or no server; the reason is printed on stderr

As a Kubernetes liveness probe (restart the pod when a stub is dead):

    livenessProbe:
      exec:
        command: ["python", "/opt/manylora/scripts/healthcheck.py", "--url", "127.0.0.1:8001", "--timeout", "10"]
      initialDelaySeconds: 120   # model load
      periodSeconds: 30
      timeoutSeconds: 25         # > 2 x --timeout (two models)
      failureThreshold: 3

Keep the readiness probe on /v2/health/ready (it says when models are loaded); the liveness
probe above catches what readiness misses. The requests go to the base model (no adapter),
so they also succeed while adapters are being loaded or evicted; --adapter checks one adapter;
--model generator checks the generator alone (a repository without the text ensemble).
Uses only tritonclient (no torch, no backend imports): cheap to run every few seconds.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time

import numpy as np

MODELS = ("generator", "llm")  # checked in turn by default: the engine alone, then the whole text path
TEXT_MODEL = "llm"
TEXT_PROMPT = b"ok"


def check(url: str, timeout: float, model: str = "generator", token_id: int = 0, adapter: str | None = None) -> str:
    """Returns a one-line success message; raises RuntimeError with the reason otherwise."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def tensor(name: str, array: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    text_model = model == TEXT_MODEL
    prompt = (tensor("text_input", np.array([[TEXT_PROMPT]], dtype=np.object_), "BYTES") if text_model
              else tensor("input_ids", np.array([[token_id]], dtype=np.int32), "INT32"))
    output = "num_output_tokens" if text_model else "output_ids"
    inputs = [
        prompt,
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
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(output)],
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
            got = result.as_numpy(output)  # llm: the token count; generator: the token ids
            tokens = 0 if got is None else (int(got.reshape(-1)[0]) if text_model else got.size)
            if tokens:
                return f"ok: {tokens} token from '{model}' at {url} in {time.perf_counter() - t0:.2f} s"
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
    ap = argparse.ArgumentParser(description="manylora liveness check: one real token from the generator and "
                                             "through the llm ensemble")
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint host:port (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the token (default %(default)s)")
    ap.add_argument("--model", action="append", choices=MODELS,
                    help="check only this model (repeatable; default: generator, then llm)")
    ap.add_argument("--token-id", type=int, default=0, help="prompt token id (default 0, the BOS of most models)")
    ap.add_argument("--adapter", default=None, help="check this adapter instead of the base model")
    ap.add_argument("--quiet", action="store_true", help="print nothing on success")
    args = ap.parse_args(argv)
    try:
        message = "; ".join(check(args.url, args.timeout, model, args.token_id, args.adapter)
                            for model in args.model or MODELS)
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
