"""What the attacks of tests/e2e/test_e2e_attacks.py are made of: the ``Attack`` record, the ``Tools`` an attack
uses against the real server (raw HTTP, raw gRPC streams, the engine's counters) and the small arrays and checks
they share."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from grpc_streams import grpc_input, stream_error

PROMPTS = ("In the morning the baker", "The river runs by")
ADMIN = "manylora-admin-key"


@dataclass(frozen=True)
class Attack:
    name: str
    kind: str  # the class of attack
    run: Callable  # (server, tools) -> outcome text; asserts what the attack must get


class Tools:
    """What the attacks use: raw HTTP, raw gRPC streams, the engine's counters."""

    def __init__(self, server, tokenizer) -> None:
        self.server = server
        self.client = server.client()
        self.tokenizer = tokenizer

    def ids(self, text: str = PROMPTS[0]) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def http(self, path: str, body: bytes | dict | None = None, headers: dict | None = None,
             method: str = "POST", timeout: float = 60) -> tuple[int, str]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(f"http://{self.server.http_url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, reply.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def generate(self, body: dict) -> tuple[int, str]:
        return self.http("/v2/models/llm/generate", body)

    def error(self, status_body: tuple[int, str]) -> str:
        status, body = status_body
        assert status == 400, (status, body)
        return json.loads(body)["error"]

    def stream_error(self, model: str, inputs: dict[str, np.ndarray], parameters: dict | None = None) -> str | None:
        return stream_error(self.server, model, [grpc_input(name, array) for name, array in inputs.items()], parameters)

    def in_flight(self) -> int:
        stats = self.client.stats()
        return stats["running"] + stats["waiting"]

    def settles(self, within: float) -> float:
        """Seconds until the engine holds no request; fails after ``within``."""
        start = time.monotonic()
        while self.in_flight():
            assert time.monotonic() - start < within, f"requests still in the engine after {within} s"
            time.sleep(0.02)
        return time.monotonic() - start

    def counts(self) -> tuple[int, int, int]:
        """The engine's finished requests, failed requests (a cancelled one among them) and output tokens."""
        stats = self.client.stats()
        return stats["finished"], stats["errors"], stats["tokens_out"]

    def abandoned(self, before: tuple[int, int, int], n: int, within: float = 5.0) -> str:
        """After the client of ``n`` requests (``ignore_eos``) left: the engine empties, and each of them ended
        cancelled, none ran on to its ``max_tokens`` (``before``: ``counts()`` before they came). The time bound
        only catches a stop that never comes: idle, the engine is empty in about 0.25 s (one cancellation poll);
        a loaded test machine takes longer, and so does the requests' generation."""
        seconds = self.settles(within)
        finished, errors, tokens = (a - b for a, b in zip(self.counts(), before, strict=True))
        assert (finished, errors) == (0, n), f"of {n} abandoned requests {finished} ran to their end, {errors} ended"
        return f"engine empty after {seconds:.2f} s, {tokens} tokens made"

    def baselines(self) -> dict:
        """Greedy text and adapter version of every (prompt, adapter) pair through the llm ensemble."""
        out = {}
        for prompt in PROMPTS:
            for adapter in [None, *sorted(self.server.catalogue)]:
                body = {"text_input": prompt, "max_tokens": 12, **({"lora_name": adapter} if adapter else {})}
                status, text = self.generate(body)
                assert status == 200, text
                reply = json.loads(text)
                out[(prompt, adapter)] = (reply["text_output"], reply["lora_version"])
        return out

    def stub_pids(self) -> set[int]:
        """The server's child processes: its Python-backend stubs."""
        found = subprocess.run(["pgrep", "-P", str(self.server.process.pid)], capture_output=True, text=True).stdout
        return {int(pid) for pid in found.split()}


def as_text(text: str | bytes) -> np.ndarray:
    return np.array([[text.encode() if isinstance(text, str) else text]], dtype=np.object_)


def as_ints(values: list[int]) -> np.ndarray:
    return np.array([values], dtype=np.int32)


def as_one(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def refused(message: str | None, *words: str) -> str:
    assert message, "no error"
    for word in words:
        assert word in message, f"{message!r} does not name {word!r}"
    assert len(message) < 2000
    return f"refused: {message[:110]}"


def metric_sum(text: str, family: str, **labels: str) -> float:
    """The sum of a Prometheus family's samples in ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
