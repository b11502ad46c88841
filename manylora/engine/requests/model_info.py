"""What a front end needs to know of the base model, read from its checkpoint directory.

The generator's ``{"op": "model_info"}`` control request answers with this, so that a front end
(the OpenAI-compatible one, manylora/openai/) needs only the server's address: the model's name
(its directory's name), its context length, and the chat template with the special tokens that a
template refers to, as transformers keeps them (``chat_template.jinja`` beside the checkpoint, else
``chat_template`` in tokenizer_config.json: a string, or a list of named templates of which
"default" is used). No server path is given out.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
MAX_TEMPLATE_CHARS = 1 << 20  # a larger template is not one anyone meant


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template(model_dir: str | Path) -> str | None:
    """The checkpoint's default chat template, or None when it has none."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")[:MAX_TEMPLATE_CHARS]
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template[:MAX_TEMPLATE_CHARS] if isinstance(template, str) else None


def model_info(model_dir: str | Path, max_model_len: int | None = None) -> dict:
    """{"name", "max_model_len", "chat_template" (str or None), "special_tokens": {bos_token: "<s>", ...}}."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    return {"name": model_dir.resolve().name, "max_model_len": max_model_len, "chat_template": chat_template(model_dir),
            "special_tokens": special}
