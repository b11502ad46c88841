"""What ``model`` names: the base model, or an adapter (alone, or as ``<base><separator><adapter>``).

The base model's name, context length and chat template come from the server once (the generator's
``model_info`` control request), so the front needs nothing but the server's address. Adapters are
not checked here: the server knows them (and may resolve names it has not seen yet, with
resolvers), and its refusal of an unknown one becomes a 404 naming the model. /v1/models lists the
base model and every adapter the server can serve, with its rank and sha256.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from manylora.openai.chat_template import ChatTemplate
from manylora.openai.config import FrontConfig
from manylora.openai.errors import OpenAIError, bad_request, model_not_found
from manylora.openai.triton import TritonBackend

log = logging.getLogger("manylora.openai")
OWNER = "manylora"


@dataclass(frozen=True)
class BaseModelInfo:
    """The served base model: its name in ``model``, its context and its chat template (None: the checkpoint has
    none and --chat-template gave none)."""

    name: str
    max_model_len: int | None
    chat_template: ChatTemplate | None


class ModelCatalog:
    """Resolves ``model`` and lists models; model_info is fetched on first use (the server may still be starting)."""

    def __init__(self, config: FrontConfig, backend: TritonBackend) -> None:
        self.config = config
        self.backend = backend
        self.created = int(time.time())
        self._info: BaseModelInfo | None = None
        self._lock = asyncio.Lock()

    async def info(self) -> BaseModelInfo:
        """The base model's info, asked of the server until it answers (at most config.ready_timeout_s)."""
        if self._info is not None:
            return self._info
        async with self._lock:
            deadline = time.monotonic() + self.config.ready_timeout_s
            while self._info is None:
                try:
                    self._info = self._make_info(await self.backend.control({"op": "model_info"}))
                except OpenAIError as e:
                    if e.status != 503 or time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
        return self._info

    def _make_info(self, answer: dict) -> BaseModelInfo:
        source = self.config.chat_template or answer.get("chat_template")
        template = None
        if source:
            try:
                template = ChatTemplate(source, answer.get("special_tokens") or {})
            except ValueError as e:
                log.error("chat template unusable, chat requests will be refused: %s", e)
        name = self.config.served_model_name or answer.get("name") or "base"
        log.info("serving base model '%s' (context %s tokens, chat template %s)", name, answer.get("max_model_len"),
                 "set" if template else "none")
        return BaseModelInfo(name=name, max_model_len=answer.get("max_model_len"), chat_template=template)

    async def resolve(self, model: str) -> tuple[str, str | None]:
        """(the model's name as given, the adapter it names or None for the base model)."""
        if not model or not model.strip():
            raise bad_request("'model' must name the base model or an adapter", "model")
        base = (await self.info()).name
        if model == base:
            return model, None
        prefix, sep, adapter = model.partition(self.config.separator)
        if sep and prefix == base:
            if not adapter:
                raise model_not_found(model, f"no adapter named after '{base}{sep}'")
            return model, adapter
        return model, model

    async def list_models(self) -> list[dict]:
        """The /v1/models entries: the base model, then each adapter the server can serve (refused ones left out)."""
        info = await self.info()
        base = {"id": info.name, "object": "model", "created": self.created, "owned_by": OWNER, "root": info.name,
                "parent": None, "max_model_len": info.max_model_len}
        answer = await self.backend.control({"op": "list_adapters"})
        adapters = [
            {"id": a["name"], "object": "model", "created": self.created, "owned_by": OWNER, "root": a["name"],
             "parent": info.name, "rank": a.get("rank"), "sha256": a.get("sha256"),
             "target_modules": a.get("target_modules")}
            for a in answer.get("adapters", []) if a.get("status", "ready") == "ready"
        ]
        return [base, *sorted(adapters, key=lambda a: a["id"])]

    async def find(self, model: str) -> dict:
        """One /v1/models entry, by the name as ``model`` gives it; 404 when no model has it."""
        model_name, adapter = await self.resolve(model)
        entries = await self.list_models()
        if adapter is None:
            return entries[0]
        for entry in entries[1:]:
            if entry["id"] == adapter:
                return {**entry, "id": model_name}
        raise model_not_found(model)
