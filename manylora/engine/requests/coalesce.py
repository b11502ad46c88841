"""Two consecutive outputs of one request as one: how a response path that falls behind sends fewer, larger chunks.

A request's outputs waiting for the same slow consumer (a Triton response sender, the OpenAI front) can be handed
on as one chunk, so that the rate of responses adapts to what the path can carry while the engine never waits for
it. The merged chunk says exactly what the two said in turn: its tokens are both chunks' tokens, its text (the rule
in GenerationOutput's docstring, from the first chunk's context) is the first chunk's text followed by the second's,
its output_tokens add up, and it ends the request if the second did. A heartbeat says nothing that a chunk next to
it does not. An error output stays an output of its own: it carries no tokens, and callers send errors differently.
"""

from __future__ import annotations

from dataclasses import replace

from manylora.engine.requests.types import GenerationOutput


def merge_outputs(first: GenerationOutput, then: GenerationOutput) -> GenerationOutput | None:
    """One output saying what ``first`` then ``then`` say, or None where they must stay two: ``then`` is an
    error, or ``first`` already ended the request or cut text (which only a last chunk does)."""
    if first.request_id != then.request_id:
        raise ValueError(f"outputs of requests {first.request_id} and {then.request_id} cannot be merged")
    if then.error is not None or first.error is not None or first.finished or first.strip_chars:
        return None
    if then.heartbeat:
        return first
    if first.heartbeat:
        return then
    return replace(first, token_ids=[*first.token_ids, *then.token_ids], strip_chars=then.strip_chars,
                   finished=then.finished, finish_reason=then.finish_reason,
                   adapter_sha256=then.adapter_sha256 or first.adapter_sha256,
                   prompt_tokens=then.prompt_tokens or first.prompt_tokens,
                   output_tokens=first.output_tokens + then.output_tokens)
