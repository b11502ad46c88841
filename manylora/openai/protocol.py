"""Request bodies of the OpenAI API as this front accepts them (pydantic models, validated from the raw JSON).

Every field OpenAI defines for /v1/completions and /v1/chat/completions is declared, so that one this
server cannot honour is refused by name (translate.py) rather than ignored, and an unknown field is
refused as OpenAI refuses it. vLLM's extensions that map onto the engine are accepted too: top_k,
ignore_eos, add_special_tokens, min_tokens (0 only), chat_template_kwargs, add_generation_prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from manylora.openai.errors import OpenAIError, bad_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None  # one last chunk with the usage and no choices
    continuous_usage_stats: bool | None = None  # vLLM's; refused when true


class SamplingFields(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 is off
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = None
    echo: bool | None = False


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message as the chat template sees it; fields beyond OpenAI's (a template may read them) are kept."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the rendered template holds the special tokens it wants
    chat_template_kwargs: dict[str, Any] | None = None


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's names; sha256 and replace are the server's own options)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    sha256: str | None = None
    replace: bool = False
    load_inplace: bool | None = None  # vLLM's name for replace


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; ignored


def parse(model: type[BaseModel], body: bytes) -> Any:
    """``body`` (JSON) as ``model``; OpenAIError(400) naming the first field that is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> OpenAIError:
    error = e.errors(include_url=False)[0]
    loc = [str(part) for part in error.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc)
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"unsupported parameter '{where}'", param)
    if kind == "missing":
        return bad_request(f"'{where}' is required", param)
    if kind == "json_invalid":
        return bad_request(f"the body is not valid JSON: {error.get('msg')}")
    if kind == "model_type" and not loc:
        return bad_request("the body must be a JSON object")
    return bad_request(f"'{where}': {error.get('msg')} (got {error.get('input')!r:.100})", param)

