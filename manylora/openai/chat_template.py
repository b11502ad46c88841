"""Chat messages -> prompt text with the checkpoint's chat template, rendered as transformers renders it.

transformers' ``apply_chat_template`` compiles the template in a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, the loopcontrols extension, a ``tojson`` filter that keeps non-ASCII
text, ``raise_exception`` and ``strftime_now``; it renders with ``messages``,
``add_generation_prompt`` and the tokenizer's special tokens (bos_token, eos_token, ...), and the
text it makes is tokenized without adding special tokens again. The same here, so that a chat
request reaches the engine as the same tokens transformers would give it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from manylora.openai.errors import bad_request


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e} (line {e.lineno})") from None
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               **kwargs: Any) -> str:
        """The prompt text; OpenAIError(400) with the template's own message when it refuses the conversation."""
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
        if continue_final_message:  # end the prompt with the last message's text, as transformers does
            final = messages[-1].get("content") or ""
            if not isinstance(final, str) or final.strip() not in text:
                raise bad_request("continue_final_message: the last message's text is not in the rendered prompt",
                                  "continue_final_message")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text


def message_dicts(messages: list) -> list[dict]:
    """ChatMessage models -> the plain dicts a template reads; text parts joined by newlines (vLLM's "string"
    content format); OpenAIError(400) for a part that is not text."""
    out = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got '{part.type}'",
                                      "messages")
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        elif content is None:
            item["content"] = ""
        out.append(item)
    return out
