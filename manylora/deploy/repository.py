"""Render the model repository: a plain Triton model repository that any tritonserver of the supported version loads
with its own flags, no wrapper process.

The template (``model_repository/`` in the source tree, ``manylora/deploy/model_repository`` in the wheel) holds
``${...}`` placeholders in its config.pbtxt files; rendering copies it with every placeholder filled in (the
checkpoint, the adapter catalogue, the engine knobs) and, when given a packed environment (packed_env.py), names
it by ``EXECUTION_ENV_PATH`` in every Python model, so that the server's own Python backend runs the models in it.

Paths are absolute by default. With ``relative_paths`` they are written from the model's own directory,
``$$TRITON_MODEL_DIRECTORY/../...``: Triton's Python backend expands that keyword in EXECUTION_ENV_PATH and a
model that reads its parameters through manylora.engine.repository_paths.model_parameters expands it in the rest,
so the repository, the environment and the checkpoints move together (shared storage mounted anywhere). Rendering
refuses relative paths for a template whose models do not (check_models_expand_paths).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path

# config.pbtxt parameters of the generator other than the checkpoint and the catalogue
ENGINE_PARAMS = (
    "device",
    "dtype",
    "max_lora_rank",
    "max_loras",
    "max_cpu_loras",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "page_size",
    "num_kv_pages",
    "gpu_memory_fraction",
    "max_queue_size",
    "tensor_parallel_size",
    "stream_interval_ms",
    "stream_responses_per_s",
)
# config.pbtxt parameters of the generator model file itself, not EngineConfig fields
MODEL_PARAMS = ("metrics_adapter_labels",)
PLACEHOLDER = re.compile(r"\$\{([a-z_]+)\}")
ENVIRONMENT_PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
# what a template model calls to read its parameters with MODEL_DIRECTORY expanded (manylora.engine.repository_paths)
EXPANDING_CALL = "model_parameters("
# written into every rendered repository: a directory holding it may be replaced by the next rendering
RENDERED_MARKER = ".manylora-rendered"
_PYTHON_BACKEND = re.compile(r'^\s*backend:\s*"python"', re.MULTILINE)


@dataclass(frozen=True)
class RenderSpec:
    """What to render.

    base_model: Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json).
    out: the repository to write; an existing one is replaced only if it is empty or a rendered repository.
    adapters: the adapter catalogue (JSON); None: the base model alone, adapters registered at run time.
    params: engine knobs and model parameters (ENGINE_PARAMS, MODEL_PARAMS, EngineConfig fields); "" or absent:
        the engine's default.
    environment: a packed environment (a directory with bin/activate, or its .tar.gz) for EXECUTION_ENV_PATH;
        None: the models run in the Python the server's stub finds on its own (scripts/serve.py's venv).
    relative_paths: write paths as ``$$TRITON_MODEL_DIRECTORY/..``-relative instead of absolute.
    source: the template repository; None: template_repository().
    """

    base_model: Path
    out: Path
    adapters: Path | None = None
    params: dict[str, str] = field(default_factory=dict)
    environment: Path | None = None
    relative_paths: bool = False
    source: Path | None = None


def template_repository() -> Path:
    """The model repository template: the wheel's copy, else the source tree's ``model_repository/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "model_repository", here.parents[1] / "model_repository"):
        if (candidate / "generator" / "config.pbtxt").is_file():
            return candidate
    raise FileNotFoundError(
        f"no model repository template: neither {here / 'model_repository'} (an installed wheel) nor "
        f"{here.parents[1] / 'model_repository'} (a source tree) holds generator/config.pbtxt"
    )


def known_params() -> set[str]:
    """Parameter names the generator accepts: ENGINE_PARAMS, MODEL_PARAMS and the engine's own fields."""
    known = set(ENGINE_PARAMS) | set(MODEL_PARAMS)
    try:  # the engine's own list, where it is importable (it needs torch)
        from manylora.engine.config import EngineConfig

        known |= {f.name for f in fields(EngineConfig)} - {"model_dir", "adapters"}
    except ImportError:
        pass
    return known


def check_engine_params(params: dict[str, str]) -> None:
    """Raise ValueError naming any parameter the generator does not know."""
    known = known_params()
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")


def parse_params(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (``--param``) -> a dict; ValueError names a malformed one."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param wants KEY=VALUE, got {item!r}")
        params[key.strip()] = value.strip()
    return params


def render_repository(spec: RenderSpec) -> Path:
    """Write the repository ``spec`` describes; return its (absolute) path."""
    params = {k: v for k, v in spec.params.items() if v != ""}
    check_engine_params(params)
    source = Path(spec.source or template_repository()).resolve()
    out = Path(spec.out).resolve()
    base_model = _existing(spec.base_model, "config.json", "base model (a checkpoint directory)")
    catalogue = _existing(spec.adapters, None, "adapter catalogue") if spec.adapters else None
    environment = _environment(spec.environment) if spec.environment else None
    if out == source or source in out.parents:
        raise ValueError(f"{out}: the rendered repository must lie outside the template {source}")
    if spec.relative_paths:
        check_models_expand_paths(source)
    if environment and (environment == out or out in environment.parents):
        raise ValueError(f"{environment}: the environment must lie outside the repository {out} (Triton would "
                         "take it for a model); put it beside the repository")

    def written(path: Path) -> str:
        if not spec.relative_paths:
            return str(path)
        return f"{MODEL_DIRECTORY}/{Path('..', os.path.relpath(path, out)).as_posix()}"

    values = {name: "" for name in (*ENGINE_PARAMS, *MODEL_PARAMS)}
    values.update(params)
    values["base_model"] = values["tokenizer_dir"] = written(base_model)
    values["adapters"] = written(catalogue) if catalogue else ""
    _replace_rendered(out, source)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep"))
    for config in sorted(out.glob("*/config.pbtxt")):
        text = config.read_text()
        missing = sorted(set(PLACEHOLDER.findall(text)) - set(values))
        if missing:
            raise ValueError(f"{config}: no value for {missing}")
        if config.parent.name == "generator":  # engine knobs the template does not list
            for key in sorted(set(params) - set(PLACEHOLDER.findall(text))):
                text += f'parameters {{ key: "{key}" value: {{ string_value: "${{{key}}}" }} }}\n'
        text = PLACEHOLDER.sub(lambda m: _pbtxt_string(values[m.group(1)]), text)
        if environment and _PYTHON_BACKEND.search(text):
            text += (f'parameters {{ key: "{ENVIRONMENT_PARAMETER}" '
                     f'value: {{ string_value: "{_pbtxt_string(written(environment))}" }} }}\n')
        config.write_text(text)
    # an empty version directory (the ensemble's) must exist; git does not keep empty directories
    for model in out.iterdir():
        if (model / "config.pbtxt").is_file():
            (model / "1").mkdir(exist_ok=True)
    (out / RENDERED_MARKER).write_text("written by python -m manylora.deploy render; the next rendering replaces it\n")
    return out


def check_models_expand_paths(source: Path) -> None:
    """Raise ValueError unless every Python model of the template ``source`` reads its parameters through
    manylora.engine.repository_paths.model_parameters (which expands ``$$TRITON_MODEL_DIRECTORY``): a model that
    does not would take a relative path literally and fail to start."""
    lacking = sorted(
        config.parent.name for config in source.glob("*/config.pbtxt")
        if _PYTHON_BACKEND.search(config.read_text())
        and EXPANDING_CALL not in (config.parent / "1" / "model.py").read_text(errors="replace")
    )
    if lacking:
        raise ValueError(f"relative paths: the models {lacking} of {source} do not expand {MODEL_DIRECTORY} in their "
                         f"parameters ({EXPANDING_CALL}); render with absolute paths")


def _existing(path: Path | str, inside: str | None, what: str) -> Path:
    path = Path(path).resolve()
    if inside is None and not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    if inside is not None and not (path / inside).is_file():
        raise FileNotFoundError(f"{path / inside} not found: the {what} must hold {inside}")
    return path


def _environment(path: Path | str) -> Path:
    path = Path(path).resolve()
    if path.is_dir():
        if not (path / "bin" / "activate").is_file():
            raise FileNotFoundError(f"{path}/bin/activate not found: the environment must be a packed environment "
                                    "(python -m manylora.deploy pack-env)")
    elif not (path.is_file() and path.name.endswith(".tar.gz")):
        raise FileNotFoundError(f"{path}: environment not found (a directory with bin/activate, or its .tar.gz)")
    return path


def _replace_rendered(out: Path, source: Path) -> None:
    """Remove ``out`` if it is a repository rendered before (or empty); refuse to remove anything else."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    entries = {p.name for p in out.iterdir()}
    models = {p.name for p in source.iterdir() if (p / "config.pbtxt").is_file()}
    if entries and RENDERED_MARKER not in entries and not entries <= models:
        raise FileExistsError(f"{out} holds other files ({', '.join(sorted(entries - models)[:5])}): refusing to "
                              "replace it; remove it or render into another directory")
    shutil.rmtree(out)


def _pbtxt_string(value: str) -> str:
    """``value`` escaped for a double-quoted protobuf text-format string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')
