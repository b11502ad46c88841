"""python -m manylora.deploy render: every placeholder filled, the environment named in the Python models only,
relative paths that resolve from the model's directory, what it refuses; the pack-env pieces that need no server
(the stub's Python, the requirement closure, a symlinked environment that imports the models' modules)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from manylora.deploy import __main__ as cli
from manylora.deploy.packed_env import MANIFEST, PackError, PackSpec, check_stub, pack_environment, requirement_closure
from manylora.deploy.repository import (
    ENVIRONMENT_PARAMETER,
    RENDERED_MARKER,
    RenderSpec,
    parse_params,
    render_repository,
    template_repository,
)
from manylora.deploy.server_flags import ADMIN_HEADER, listen_flags, restriction_flags
from manylora.deploy.stub import stub_python_version
from manylora.engine.repository_paths import expand_model_directory, model_parameters

MODELS = ("generator", "llm", "postprocessing", "preprocessing")
PYTHON_MODELS = ("generator", "postprocessing", "preprocessing")
PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"')


def _parameters(config: Path) -> dict[str, str]:
    return dict(PARAMETER.findall(config.read_text()))


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A deployment folder: base/ (a checkpoint stand-in), catalogue.json, env/ (a packed-environment stand-in)."""
    base = tmp_path / "srv" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    catalogue = tmp_path / "srv" / "catalogue.json"
    catalogue.write_text(json.dumps({"a": "adapters/a"}))
    env = tmp_path / "srv" / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "activate").write_text("")
    return {"base": base, "catalogue": catalogue, "env": env, "out": tmp_path / "srv" / "repository"}


def test_render_fills_every_placeholder_and_names_the_environment(layout):
    out = render_repository(RenderSpec(base_model=layout["base"], out=layout["out"], adapters=layout["catalogue"],
                                       params={"max_loras": "8", "warmup": "false", "page_size": ""},
                                       environment=layout["env"]))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == list(MODELS)
    assert (out / RENDERED_MARKER).is_file()
    for model in MODELS:
        lines = (out / model / "config.pbtxt").read_text().splitlines()
        assert not [line for line in lines if "${" in line and not line.lstrip().startswith("#")], model
        assert (out / model / "1").is_dir()  # the ensemble's empty version directory too
        env = _parameters(out / model / "config.pbtxt").get(ENVIRONMENT_PARAMETER)
        assert env == (str(layout["env"]) if model in PYTHON_MODELS else None), model
    generator = _parameters(out / "generator" / "config.pbtxt")
    assert generator["base_model"] == str(layout["base"])
    assert generator["adapters"] == str(layout["catalogue"])
    assert generator["max_loras"] == "8"
    assert generator["warmup"] == "false"  # an engine knob the template does not list is added
    assert generator["page_size"] == ""  # empty: the engine's default
    for model in ("preprocessing", "postprocessing"):
        assert _parameters(out / model / "config.pbtxt")["tokenizer_dir"] == str(layout["base"])
    assert not list(out.rglob("__pycache__"))


def test_relative_paths_resolve_from_each_model_directory(layout):
    from manylora.deploy import repository

    source = template_repository()
    try:
        repository.check_models_expand_paths(source)
    except ValueError as e:
        # the template's models must read their parameters through model_parameters() first
        with pytest.raises(ValueError, match="relative paths: the models"):
            render_repository(RenderSpec(base_model=layout["base"], out=layout["out"], relative_paths=True))
        pytest.skip(f"the template does not expand relative paths yet: {e}")
    out = render_repository(RenderSpec(base_model=layout["base"], out=layout["out"], adapters=layout["catalogue"],
                                       environment=layout["env"], relative_paths=True))
    moved = out.parent.parent / "moved"
    shutil.move(out.parent, moved)  # shared storage mounted elsewhere: the paths follow
    for model in PYTHON_MODELS:
        config = moved / "repository" / model / "config.pbtxt"
        raw = {k: {"string_value": v} for k, v in _parameters(config).items()}
        assert raw[ENVIRONMENT_PARAMETER]["string_value"].startswith("$$TRITON_MODEL_DIRECTORY/")
        values = {k: v["string_value"] for k, v in model_parameters(raw, config.parent).items()}
        assert ENVIRONMENT_PARAMETER not in values
        for key in ("base_model", "tokenizer_dir"):
            if key in values:
                assert Path(values[key]).resolve() == moved / "base"
        if "adapters" in values:
            assert Path(values["adapters"]).resolve() == moved / "catalogue.json"
        env = expand_model_directory(raw, config.parent)[ENVIRONMENT_PARAMETER]["string_value"]
        assert (Path(env) / "bin" / "activate").is_file()


def test_expand_model_directory_and_triton_parameters():
    raw = {"base_model": {"string_value": "$$TRITON_MODEL_DIRECTORY/../base"},
           "max_loras": {"string_value": "8"},
           "EXECUTION_ENV_PATH": {"string_value": "$$TRITON_MODEL_DIRECTORY/../env"}}
    assert model_parameters(raw, "/models/generator") == {"base_model": {"string_value": "/models/generator/../base"},
                                                          "max_loras": {"string_value": "8"}}


def test_the_engine_ignores_the_environment_parameter():
    """A rendered generator's config.pbtxt names the packed environment: Triton's parameter, not an engine knob
    (any other unknown knob is still refused by name)."""
    from manylora.engine.scheduling.engine_process import EngineLaunch

    launch = EngineLaunch(model_dir="/models/base", device="cpu",
                          knobs={ENVIRONMENT_PARAMETER: "/models/env.tar.gz", "max_loras": "4"})
    assert launch.engine_config().max_loras == 4
    with pytest.raises(ValueError, match="unknown engine parameter 'EXECUTION_ENV'"):
        EngineLaunch(model_dir="/models/base", device="cpu", knobs={"EXECUTION_ENV": "/x"}).engine_config()


def test_render_refuses(layout, tmp_path):
    spec = {"base_model": layout["base"], "out": layout["out"]}
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['max_lora'\]"):
        render_repository(RenderSpec(**spec, params={"max_lora": "8"}))
    with pytest.raises(FileNotFoundError, match="config.json"):
        render_repository(RenderSpec(base_model=tmp_path, out=layout["out"]))
    with pytest.raises(FileNotFoundError, match="adapter catalogue"):
        render_repository(RenderSpec(**spec, adapters=tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="bin/activate"):
        render_repository(RenderSpec(**spec, environment=layout["base"]))
    with pytest.raises(ValueError, match="outside the repository"):
        (layout["out"] / "env" / "bin").mkdir(parents=True)
        (layout["out"] / "env" / "bin" / "activate").write_text("")
        render_repository(RenderSpec(**spec, environment=layout["out"] / "env"))
    (layout["out"] / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to replace"):
        render_repository(RenderSpec(**spec))
    assert (layout["out"] / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="outside the template"):
        render_repository(RenderSpec(**spec | {"out": template_repository() / "rendered"}))


def test_render_replaces_its_own_rendering(layout):
    render_repository(RenderSpec(base_model=layout["base"], out=layout["out"], params={"max_loras": "8"}))
    render_repository(RenderSpec(base_model=layout["base"], out=layout["out"], params={"max_loras": "16"}))
    assert _parameters(layout["out"] / "generator" / "config.pbtxt")["max_loras"] == "16"


def test_parse_params():
    assert parse_params(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["novalue"])


def test_cli_render_prints_the_server_flags(layout, capsys):
    assert cli.main(["render", "--base-model", str(layout["base"]), "--out", str(layout["out"]),
                     "--param", "max_loras=4"]) == 0
    printed = capsys.readouterr().out
    assert f"--model-repository={layout['out']}" in printed
    assert "shm-default-byte-size" in printed and ADMIN_HEADER in printed
    assert cli.main(["render", "--base-model", str(layout["base"]), "--out", str(layout["out"]),
                     "--param", "bogus=1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err


def test_server_flags():
    assert listen_flags("0.0.0.0", 1, 2, 3) == ["--http-address=0.0.0.0", "--http-port=1", "--grpc-address=0.0.0.0",
                                                "--grpc-port=2", "--metrics-address=0.0.0.0", "--metrics-port=3"]
    flags = restriction_flags("k-1", ("trace",))
    assert all(f.endswith(f":{ADMIN_HEADER}=k-1") and "trace" not in f for f in flags)
    assert restriction_flags("k", ("all",)) == []
    with pytest.raises(ValueError, match="unknown API"):
        restriction_flags("k", ("everything",))
    with pytest.raises(ValueError, match="admin key"):
        restriction_flags("a key")


def _pytriton_stubs() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"]) / "pytriton" / "tritonserver" / "python_backend_stubs"


def test_stub_python_version_reads_the_linked_libpython(tmp_path):
    stubs = _pytriton_stubs()
    if not stubs.is_dir():
        pytest.skip("nvidia-pytriton is not installed")
    for version in ("3.10", "3.11", "3.12"):
        assert stub_python_version(stubs / version / "triton_python_backend_stub") == version
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    other = "3.12" if here != "3.12" else "3.11"
    with pytest.raises(PackError, match=f"embeds Python {other} but this interpreter is Python {here}"):
        check_stub(stubs / other / "triton_python_backend_stub", here)
    (tmp_path / "stub").write_text("#!/bin/sh\n")
    with pytest.raises(PackError, match="not an ELF"):
        check_stub(tmp_path / "stub", here)


def test_requirement_closure_follows_requirements_and_names_what_is_missing():
    found = requirement_closure(["tokenizers"])
    assert "tokenizers" in found and "huggingface-hub" in found  # tokenizers needs huggingface_hub
    with pytest.raises(PackError, match=r"no-such-distribution-xyz \(needed by manylora\) is not installed"):
        requirement_closure(["no-such-distribution-xyz>=1"])


def test_pack_symlinked_environment_imports_the_models_modules(tmp_path):
    """A symlinked environment (this machine only) is built and checked by pack_environment itself: its python,
    started as the stub starts, takes the environment as its prefix and imports the models' modules from it."""
    env = pack_environment(PackSpec(out=tmp_path / "env", link="symlink"))
    manifest = json.loads((env / MANIFEST).read_text())
    assert manifest["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert {"manylora", "torch", "numpy", "tokenizers", "safetensors"} <= set(manifest["distributions"])
    assert not {"transformers", "peft", "fastapi", "pytest"} & set(manifest["distributions"])  # extras stay out
    assert (env / "bin" / "activate").is_file() and (env / "bin" / "python3").exists()
    # packing again replaces a packed environment, never anything else
    assert pack_environment(PackSpec(out=env, link="symlink", requirements=("packaging",))) == env
    assert set(json.loads((env / MANIFEST).read_text())["distributions"]) == {"manylora", "packaging"}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a packed environment"):
        pack_environment(PackSpec(out=tmp_path / "other", link="symlink"))


def test_packed_archive_works_where_it_is_unpacked(tmp_path):
    """The .tar.gz form (the files themselves, links resolved) unpacked elsewhere, as the Python backend unpacks
    it: its python takes the new place as its prefix and imports from it. Packed with a small requirement set
    (the archive of torch takes minutes), at the fastest gzip level."""
    import tarfile

    from manylora.deploy.packed_env import verify_environment

    archive = pack_environment(PackSpec(out=tmp_path / "env.tar.gz", requirements=("packaging",), compresslevel=1))
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        assert "bin/activate" in {m.name for m in members}
        assert not [m.name for m in members if m.issym()]  # the files themselves: no link out of the archive
        tar.extractall(tmp_path / "unpacked", filter="tar")
    verify_environment(tmp_path / "unpacked", ("manylora.deploy.repository", "packaging.requirements"))
    assert json.loads((tmp_path / "unpacked" / MANIFEST).read_text())["distributions"].keys() == {"manylora",
                                                                                                  "packaging"}


def test_operator_key_is_given_or_kept_private_in_its_file(tmp_path):
    from manylora.deploy.operator_key import operator_key

    path = tmp_path / "keys" / "admin-key"
    made = operator_key(None, path)
    assert len(made) >= 32 and path.read_text().strip() == made and (path.stat().st_mode & 0o777) == 0o600
    assert not made.startswith("-")  # `--admin-key KEY` must parse as a value
    assert operator_key("", path) == made  # kept, not made again
    assert operator_key("given", path) == "given" and path.read_text().strip() == made
    path.write_text("\n")
    assert operator_key(None, path) not in ("", made)  # an empty file gets a new key
