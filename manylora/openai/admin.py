"""Adapter management on the front (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter), for operators.

Off unless the front runs with --allow-adapter-management, and then only for requests that carry the
operator key (header ``manylora-admin-key: KEY``, or ``Authorization: Bearer KEY``). The key is the
front's own: --admin-key, else $MANYLORA_OPENAI_ADMIN_KEY, else a random one kept in a file (mode
0600). A request goes on as the generator's load_adapter / unload_adapter control request, the path
`python -m manylora.client adapters load` takes, so the server must also allow runtime updates
(MANYLORA_ALLOW_RUNTIME_ADAPTERS=1 in its environment; otherwise 403 with the server's reason).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from manylora.deploy.operator_key import operator_key as stored_key
from manylora.openai.errors import OpenAIError
from manylora.openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from manylora.openai.triton import TritonBackend

KEY_HEADER = "manylora-admin-key"
KEY_ENV = "MANYLORA_OPENAI_ADMIN_KEY"


def operator_key(given: str | None, key_file: str | Path) -> str:
    """The front's operator key: ``given``, else $MANYLORA_OPENAI_ADMIN_KEY, else the one kept in ``key_file``."""
    return stored_key(given or os.environ.get(KEY_ENV), key_file)


def check_operator(headers, enabled: bool, key: str | None) -> None:
    """OpenAIError unless management is on (404 otherwise, as vLLM without the feature) and ``headers`` carry
    the key (401)."""
    if not enabled or not key:
        raise OpenAIError(404, "adapter management is off on this front; the operator starts it with "
                               "--allow-adapter-management", code="adapter_management_off")
    given = headers.get(KEY_HEADER)
    if given is None:
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        raise OpenAIError(401, f"adapter management needs the operator key (header {KEY_HEADER} or "
                               "Authorization: Bearer)", "authentication_error", code="invalid_operator_key")


async def load_adapter(backend: TritonBackend, req: LoadLoraAdapterRequest) -> dict:
    command = {"op": "load_adapter", "name": req.lora_name, "path": req.lora_path,
               "replace": bool(req.replace or req.load_inplace)}
    if req.sha256:
        command["sha256"] = req.sha256
    info = await backend.control(command)
    return {"object": "lora_adapter", "message": f"Success: LoRA adapter '{req.lora_name}' added successfully.",
            **info}


async def unload_adapter(backend: TritonBackend, req: UnloadLoraAdapterRequest) -> dict:
    info = await backend.control({"op": "unload_adapter", "name": req.lora_name})
    return {"object": "lora_adapter", "message": f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
            **info}
