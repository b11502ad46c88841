"""What one replayed request did, with its timings; per-request JSONL."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    """Timings of one request, in seconds from the start of the replay.

    chunk_times[i] is when chunk i (with chunk_tokens[i] tokens) arrived; with text streaming
    (the llm ensemble) output_chars counts the text's characters too.
    """

    index: int
    adapter: str | None
    prompt_tokens: int
    output_tokens_requested: int
    arrival_s: float
    send_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_chars: int = 0
    error: str | None = None

    def add_chunk(self, t: float, tokens: int, chars: int = 0) -> None:
        """A response with ``tokens`` tokens and ``chars`` characters of text arrived at ``t``; one without
        tokens is no chunk (no token time), its characters still count."""
        self.output_chars += chars
        if tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = t
        self.chunk_times.append(t)
        self.chunk_tokens.append(tokens)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def completed(self) -> bool:
        return self.end_s is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        if self.first_token_s is None or self.send_s is None:
            return None
        return self.first_token_s - self.send_s

    @property
    def latency(self) -> float | None:
        if not self.completed or self.send_s is None:
            return None
        return self.end_s - self.send_s

    def inter_token_latencies(self) -> list[float]:
        """Per-token gaps: a chunk of k tokens after a gap g counts as k gaps of g/k."""
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            out += [(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k
        return out


def write_records(path: str | Path, records: list[RequestRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r)) + "\n")
    return path


def read_records(path: str | Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord(**json.loads(line)) for line in f if line.strip()]
