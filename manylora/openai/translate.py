"""OpenAI requests -> the ``llm`` ensemble's Generation: what maps onto the engine, and what is refused by name.

Supported: max_tokens (chat: max_completion_tokens too), temperature, top_p, seed, stop (truncated
by the engine at the first stop string, which then ends the generation), n = 1, stream (with
stream_options.include_usage), and vLLM's top_k, ignore_eos, add_special_tokens. Refused with 400:
n > 1, best_of > 1, echo, logprobs, suffix, non-zero presence / frequency penalties, repetition
penalty other than 1, a logit bias, min_tokens, tools and function calls, response formats other
than text, token-id prompts and more than one prompt.
"""

from __future__ import annotations

from manylora.openai.chat_template import message_dicts
from manylora.openai.errors import OpenAIError, bad_request
from manylora.openai.models import BaseModelInfo
from manylora.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from manylora.openai.triton import Generation

MAX_STOP_STRINGS = 16


def _refuse_unsupported(req: SamplingFields) -> None:
    if req.n not in (None, 1):
        raise bad_request(f"n must be 1 (one choice per request), got {req.n}", "n")
    if req.echo:
        raise bad_request("echo is not supported (outputs never repeat the prompt)", "echo")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported (only 0), got {value}", name)
    if req.repetition_penalty not in (None, 1, 1.0):
        raise bad_request(f"repetition_penalty is not supported (only 1), got {req.repetition_penalty}",
                          "repetition_penalty")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.min_tokens not in (None, 0):
        raise bad_request(f"min_tokens is not supported (only 0), got {req.min_tokens}", "min_tokens")
    if req.stream_options is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if req.stream_options.continuous_usage_stats:
            raise bad_request("stream_options.continuous_usage_stats is not supported", "stream_options")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def _generation(req: SamplingFields, prompt: str, adapter: str | None, max_tokens: int,
                add_special_tokens: bool) -> Generation:
    return Generation(
        prompt=prompt,
        max_tokens=max_tokens,
        adapter=adapter,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,
        seed=req.seed,
        stop=_stops(req.stop),
        add_special_tokens=add_special_tokens,
        ignore_eos=bool(req.ignore_eos),
        stream=bool(req.stream),
    )


def completion_generation(req: CompletionRequest, adapter: str | None, default_max_tokens: int) -> Generation:
    """The Generation of a /v1/completions request."""
    _refuse_unsupported(req)
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1, got {req.best_of}", "best_of")
    if req.logprobs is not None:
        raise bad_request("logprobs are not supported", "logprobs")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request("prompt must be one string (token ids and several prompts are not supported)",
                              "prompt")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("prompt is empty: it needs at least one character", "prompt")
    return _generation(req, prompt, adapter, req.max_tokens or default_max_tokens, req.add_special_tokens)


def chat_generation(req: ChatCompletionRequest, adapter: str | None, info: BaseModelInfo) -> Generation:
    """The Generation of a /v1/chat/completions request: the messages rendered with the chat template."""
    _refuse_unsupported(req)
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not supported", "logprobs")
    if req.tools or req.functions or req.tool_choice not in (None, "none") or req.function_call not in (None, "none"):
        raise bad_request("tools and function calls are not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format {req.response_format.get('type')!r} is not supported (only text)",
                          "response_format")
    if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
    if info.chat_template is None:
        raise OpenAIError(400, f"the model '{info.name}' has no chat template (tokenizer_config.json chat_template, "
                               "chat_template.jinja); start the front with --chat-template FILE, or use "
                               "/v1/completions", param="messages", code="no_chat_template")
    prompt = info.chat_template.render(message_dicts(req.messages), add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       **(req.chat_template_kwargs or {}))
    if not prompt:
        raise bad_request("the chat template made an empty prompt from these messages", "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens or context_left(prompt, info.max_model_len)
    return _generation(req, prompt, adapter, max_tokens, req.add_special_tokens)


def context_left(prompt: str, max_model_len: int | None) -> int:
    """max_tokens for a chat that gives none: the context less an upper bound of the prompt's tokens (its UTF-8
    bytes, and two for a tokenizer's own prefix), at least 1."""
    if not max_model_len:
        raise bad_request("max_tokens is required (the server did not say its context length)", "max_tokens")
    return max(1, max_model_len - len(prompt.encode("utf-8")) - 2)
