"""config.pbtxt parameters as the models read them: Triton's own parameters set apart, and paths that start with
``$$TRITON_MODEL_DIRECTORY`` (the model's own directory) made absolute.

A rendered repository (``python -m manylora.deploy render``) may hold parameters that are not the models': the
Python backend's EXECUTION_ENV_PATH names the packed environment the stub runs in. With ``--relative-paths`` the
checkpoint and catalogue are written from the model's directory, ``$$TRITON_MODEL_DIRECTORY/../base``, the
keyword Triton's Python backend expands in EXECUTION_ENV_PATH; a model expands it in its own parameters with
model_parameters(), so that the repository moves together with what lies beside it (shared storage mounted
anywhere).
"""

from __future__ import annotations

from pathlib import Path

MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
# parameters Triton's Python backend reads itself: never a model's or the engine's setting
TRITON_PARAMETERS = ("EXECUTION_ENV_PATH",)


def without_triton_parameters(values: dict) -> dict:
    """``values`` (parameters by name) less TRITON_PARAMETERS."""
    return {name: value for name, value in values.items() if name not in TRITON_PARAMETERS}


def expand_model_directory(parameters: dict, model_directory: str | Path) -> dict:
    """config.pbtxt ``parameters`` as Triton gives them (name -> {"string_value": ...}), with a leading
    ``$$TRITON_MODEL_DIRECTORY`` in any string value replaced by ``model_directory``; the rest unchanged."""
    expanded = {}
    for name, value in parameters.items():
        text = value.get("string_value") if isinstance(value, dict) else None
        if isinstance(text, str) and text.startswith(MODEL_DIRECTORY):
            value = {**value, "string_value": str(model_directory) + text[len(MODEL_DIRECTORY):]}
        expanded[name] = value
    return expanded


def model_parameters(parameters: dict, model_directory: str | Path) -> dict:
    """What a Python model reads from its config.pbtxt ``parameters``: Triton's own left out, paths expanded
    (``model_directory``: ``args["model_repository"]`` in the model's initialize)."""
    return expand_model_directory(without_triton_parameters(parameters), model_directory)
